"""Tensor segments: how tensors cross the server <-> worker process boundary.

This module is the part both sides share: the segment file, its mapping, and the private
directory that holds them. The server's pool of reusable segments is `service.pool.segments`;
the worker's kept mappings are `service.worker.mapped`.

The pipe protocol carries JSON only; a tensor's bytes go into a file in a private directory
that the server creates (mode 0700, on `/dev/shm` when it has room, so the "file" is shared
memory) and both processes map. The JSON message names the file and the tensor's dtype,
shape, size and checksum. Nothing is pickled, the data is written once by the producer and
read in place by the consumer, and cleaning up is deleting files: every segment of a call
carries the call's prefix, so the server removes them all when the call ends however it
ends (answered, failed, cancelled, or the worker died), and the whole directory at shutdown.

Space is reserved with `posix_fallocate` when a segment is created: writing into a mapped
tmpfs file that has run out of room would kill the process with SIGBUS, a full disk here is
an error the caller sees instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import shutil
import tempfile
from pathlib import Path

from service.ipc.errors import SegmentError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")
SHM = Path("/dev/shm")


def check_name(name: str) -> str:
    """`name` itself when it is a safe segment file name (no path, no leading dot)."""
    if not _NAME.match(name):
        raise SegmentError(f"bad segment name {name!r}")
    return name


class Segment:
    """One mapped segment file. `view` is its whole data (empty for a zero-size one)."""

    def __init__(self, path: Path, size: int, *, writable: bool, shared: bool = False) -> None:
        """Map the first `size` bytes of `path`: shared and writable, or read-only as a
        private copy-on-write mapping, or (`shared`) as a shared read-only one (PROT_READ:
        always the file's current bytes; a write into it is a fault, not a private copy)."""
        self.path = path
        self.size = size
        self._map: mmap.mmap | None = None
        self.identity: tuple[int, int, int] = (0, 0, 0)
        """(device, inode, file size) of the file mapped (zeros for a zero-size segment)."""
        if size == 0:
            return
        flags = os.O_RDWR if writable else os.O_RDONLY
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            found = os.fstat(fd)
            actual = found.st_size
            self.identity = (found.st_dev, found.st_ino, actual)
            if actual < size:
                # A pooled segment (service.pool.segments) is a size class: the tensor
                # is its start.
                raise SegmentError(f"segment {path.name} holds {actual} bytes, not {size}")
            access = (
                mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ if shared else mmap.ACCESS_COPY
            )
            self._map = mmap.mmap(fd, size, access=access)
        finally:
            os.close(fd)

    @property
    def view(self) -> memoryview:
        return memoryview(self._map) if self._map is not None else memoryview(bytearray())

    def close(self) -> None:
        if self._map is not None:
            # A view still alive (a tensor over it) keeps the mapping until it goes.
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: A server's segment directory is `moe-control-seg-<random>`, flock()ed for as long as the
#: server runs. A server killed outright (SIGKILL, the OOM killer) deletes nothing, and in a
#: pod a restarted container finds the same memory-backed /dev/shm, so the segments of the
#: calls then in flight would stay, counted against the pod's memory, until the pod goes;
#: the next server removes every such directory it can lock (a lock, unlike a pid, holds
#: across pid namespaces). Made under another name and renamed once locked, so a sweep
#: never sees a live directory unlocked.
_PREFIX = "moe-control-seg-"
_NEW_PREFIX = "moe-control-new-"


def sweep_dead(base: str | os.PathLike[str]) -> list[str]:
    """Remove the segment directories under `base` whose server is gone; returns them."""
    removed: list[str] = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(base):
            if not entry.name.startswith(_PREFIX) or not entry.is_dir(follow_symlinks=False):
                continue
            try:
                fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                if os.fstat(fd).st_uid != os.getuid():
                    continue
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # locked: its server runs
            else:
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
            finally:
                os.close(fd)
    return removed


class SegmentDir:
    """The private segment directory of one server (or, in a worker, the one it was told)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock: int | None = None

    @classmethod
    def create(
        cls, base: str | os.PathLike[str] | None = None, *, prefer_shm: int = 0
    ) -> SegmentDir:
        """A fresh private directory under `base`; without one, under /dev/shm when it has
        at least `prefer_shm` bytes free, else the system temp directory."""
        if base is None:
            base = tempfile.gettempdir()
            if SHM.is_dir() and os.access(SHM, os.W_OK):
                stats = os.statvfs(SHM)
                if stats.f_bavail * stats.f_frsize >= prefer_shm:
                    base = str(SHM)
        sweep_dead(base)
        made = Path(tempfile.mkdtemp(prefix=_NEW_PREFIX, dir=base))
        os.chmod(made, 0o700)
        lock = os.open(made, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        path = made.with_name(_PREFIX + made.name.removeprefix(_NEW_PREFIX))
        os.rename(made, path)
        segments = cls(path)
        segments._lock = lock
        return segments

    def file(self, name: str) -> Path:
        return self.path / check_name(name)

    def new(self, name: str, size: int) -> Segment:
        """Create a segment of exactly `size` bytes (its space reserved) and map it."""
        path = self.file(name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            if size:
                os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise SegmentError(
                f"no room for a {size}-byte tensor segment in {self.path}: {exc.strerror}"
            ) from None
        os.close(fd)
        try:
            return Segment(path, size, writable=True)
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    def open(self, name: str, size: int, *, writable: bool = False) -> Segment:
        """Map the first `size` bytes of an existing segment: copy-on-write (the reader
        never changes the file), or shared and `writable` (a pooled output segment)."""
        return Segment(self.file(name), size, writable=writable)

    def write(self, name: str, data: memoryview) -> None:
        """Write `data` at the start of an existing segment (a pooled output segment).

        Written into the file's pages, not through a fresh mapping: mapping it would fault
        every page in again, several times the cost of the copy (bench/RESULTS.md)."""
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        fd = os.open(self.file(name), os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            actual = os.fstat(fd).st_size
            if actual < len(view):
                raise SegmentError(f"segment {name} holds {actual} bytes, not {len(view)}")
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], done)
        finally:
            os.close(fd)

    def remove(self, prefix: str) -> int:
        """Delete every segment whose name starts with `prefix`; returns how many."""
        count = 0
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.path):
                if entry.name.startswith(prefix):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                        count += 1
        return count

    def names(self) -> list[str]:
        try:
            return sorted(os.listdir(self.path))
        except FileNotFoundError:
            return []

    def destroy(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
