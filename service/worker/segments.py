"""Tensor segments: how tensors cross the server <-> worker process boundary.

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
import itertools
import mmap
import os
import re
import secrets
import shutil
import stat
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")
SHM = Path("/dev/shm")


class SegmentError(OSError):
    """A segment cannot be created or opened (no room, a bad name)."""


def _check_name(name: str) -> str:
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
                # A pooled segment (SegmentPool) is a size class: the tensor is its start.
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
        return self.path / _check_name(name)

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
        every page in again, about three times the cost of the copy (8 MiB: 3.5 ms against
        1.2 ms, bench/RESULTS.md)."""
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


#: Smallest pooled segment: one page.
POOL_MIN_BYTES = 4096
#: Most bytes of idle pooled segments kept; a segment given back beyond this is deleted.
POOL_MAX_IDLE_BYTES = 256 << 20
#: Seconds a pooled segment may stay idle before `trim` deletes it: an idle server holds no
#: segment files (nothing counted against a pod's memory, nothing left for a sweep).
POOL_IDLE_S = 2.0


def pool_class(nbytes: int) -> int:
    """The pooled segment size that holds `nbytes`: 1, 1.25, 1.5 or 1.75 times a power of
    two (at most a quarter unused, since tmpfs zeroes every reserved page), in whole pages."""
    size = POOL_MIN_BYTES
    while size * 2 <= nbytes:
        size <<= 1
    for step in (4, 5, 6, 7, 8):
        candidate = size * step // 4
        if candidate >= nbytes:
            return -(-candidate // POOL_MIN_BYTES) * POOL_MIN_BYTES
    raise AssertionError("unreachable: 2 * size > nbytes")


class Pooled:
    """One pooled segment, mapped writable in the owner for as long as the pool keeps it."""

    def __init__(self, segment: Segment, name: str) -> None:
        self.segment = segment
        self.name = name
        self.capacity = segment.size
        self.idle_since = 0.0

    def view(self, nbytes: int) -> memoryview:
        """The first `nbytes` of the segment (what a tensor of that size occupies)."""
        return self.segment.view[:nbytes]


class SegmentPool:
    """Segment files reused across calls, kept mapped, by size class.

    Creating, reserving, mapping and deleting a file per tensor per call costs about 0.13 ms
    for a few KB and 20 ms for 8 MiB on tmpfs (every page allocated, zeroed and faulted in
    anew; measured in bench/RESULTS.md); writing into a mapping kept from the last call
    costs the copy alone. A segment is lent to one call at a time: `give` returns it once
    the worker has answered (it no longer reads or writes it); `drop` deletes it instead
    when the worker may still use it (an abandoned call, a dead worker). Idle segments
    beyond `max_idle_bytes`, or idle longer than `idle_s` (`trim`), are deleted.
    Not thread-safe: one event loop owns it.
    """

    def __init__(
        self,
        directory: SegmentDir,
        *,
        max_idle_bytes: int = POOL_MAX_IDLE_BYTES,
        idle_s: float = POOL_IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory
        self.max_idle_bytes = max_idle_bytes
        self.idle_s = idle_s
        self._clock = clock
        self._idle: dict[int, list[Pooled]] = {}
        self._idle_bytes = 0
        self._made = itertools.count(1)
        self.created = 0
        """Segment files made so far (a reused one is not counted again)."""

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def take(self, nbytes: int) -> Pooled:
        """A mapped segment of at least `nbytes`, lent to the caller until give/drop."""
        size = pool_class(nbytes)
        idle = self._idle.get(size)
        if idle:
            found = idle.pop()
            self._idle_bytes -= size
            return found
        name = f"pool-{next(self._made)}-{secrets.token_hex(3)}"
        self.created += 1
        return Pooled(self.directory.new(name, size), name)

    def give(self, items: Iterable[Pooled]) -> None:
        """Segments no process uses any more, back to the pool (or deleted beyond its size)."""
        now = self._clock()
        for item in items:
            if self._idle_bytes + item.capacity > self.max_idle_bytes:
                self._delete(item)
                continue
            item.idle_since = now
            self._idle.setdefault(item.capacity, []).append(item)
            self._idle_bytes += item.capacity

    def drop(self, items: Iterable[Pooled]) -> None:
        """Delete segments a worker may still map (its mapping stays valid, the file goes)."""
        for item in items:
            self._delete(item)

    def trim(self) -> int:
        """Delete the segments idle for `idle_s` or longer; returns how many are left idle."""
        limit = self._clock() - self.idle_s
        left = 0
        for size, idle in self._idle.items():
            keep = [item for item in idle if item.idle_since > limit]
            for item in idle:
                if item.idle_since <= limit:
                    self._delete(item)
                    self._idle_bytes -= size
            idle[:] = keep
            left += len(keep)
        return left

    def clear(self) -> None:
        """Delete every idle segment."""
        for idle in self._idle.values():
            for item in idle:
                self._delete(item)
        self._idle.clear()
        self._idle_bytes = 0

    def _delete(self, item: Pooled) -> None:
        item.segment.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.directory.file(item.name))


#: Most segment mappings a worker keeps between calls (per segment directory).
MAPPED_MAX_ENTRIES = 16
#: Largest segment file whose mapping is kept; bigger ones are mapped for one call only
#: (their open and map cost little next to their bytes, and kept they would hold memory).
MAPPED_MAX_FILE_BYTES = 1 << 20
#: Seconds a kept mapping may go unused before the next use of the cache closes it.
MAPPED_IDLE_S = POOL_IDLE_S


class MappedSegments:
    """Mappings of a segment directory's files, kept by a worker from one call to the next.

    Why: mapping a segment per call costs open + fstat + mmap + close and a page fault on
    first touch of each page, every call (two M = 1 inputs: 0.09 ms of host time on the
    2-core box, 0.22 ms on the H200 host; bench/RESULTS.md). The server lends the same
    pooled segments (SegmentPool) call after call, so a mapping kept from the last call
    serves the next one for one `stat`.

    Never stale: each use stats the name (one syscall) and reuses the mapping only while the
    name is still the same file (device, inode) of the same size; a replaced or resized file
    is mapped anew, a removed one is an error as before (and its mapping closed). While a
    mapping is kept its file cannot be freed, so its inode number cannot be handed to a new
    file under the same name: a different file always has a different identity. The bytes
    are always the file's current ones: a writable mapping is shared (it reads and writes
    the file's pages), and a read mapping is shared and read-only (PROT_READ) rather than
    `SegmentDir.open`'s private copy-on-write one: a page written by mistake would become
    a private copy that later calls read instead of the server's bytes; read-only, such a
    write faults (the worker dies, the call fails) and nothing stale is ever read. What the
    server writes into a pooled segment for the next call, through its mapping or `pwrite`,
    is what the next call reads (tests/worker/test_segments_mapped.py).

    Bounded: files of at most `max_file_bytes` only, at most `max_entries` mappings (the
    least recently used closed first), and any unused for `idle_s` closed at the next use
    or by a background sweep within about 2 x `idle_s`. A kept mapping of a file the server
    has since deleted (trimmed from its pool) holds that file's pages and a descriptor
    until then: at most max_entries x max_file_bytes (16 MiB). Thread-safe (run jobs may
    run side by side).
    """

    def __init__(
        self,
        directory: SegmentDir,
        *,
        max_entries: int = MAPPED_MAX_ENTRIES,
        max_file_bytes: int = MAPPED_MAX_FILE_BYTES,
        idle_s: float = MAPPED_IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory
        self._base = str(directory.path)
        self.max_entries = max_entries
        self.max_file_bytes = max_file_bytes
        self.idle_s = idle_s
        self._clock = clock
        self._kept: OrderedDict[tuple[str, bool], tuple[Segment, float]] = OrderedDict()
        self._lock = threading.Lock()
        self._sweeper: threading.Timer | None = None
        self.mapped = 0
        """Mappings made so far (a reused one is not counted again)."""

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    def read(self, name: str, size: int) -> memoryview:
        """The first `size` bytes of an existing segment, read-only (a kept mapping is
        shared read-only; one not kept is `SegmentDir.open`'s): the view keeps its mapping
        alive."""
        if size == 0:
            return memoryview(bytearray())
        view = self._kept_view(name, size, writable=False)
        if view is None:
            # Not kept (too big, not a plain file, gone): mapped for this use only, with
            # `SegmentDir.open`'s checks and errors. Its view keeps it mapped while used.
            view = self.directory.open(name, size).view
        return view[:size]

    def write(self, name: str, data: memoryview) -> None:
        """Write `data` at the start of an existing segment (a pooled output segment)."""
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        if not len(view):
            return
        target = self._kept_view(name, len(view), writable=True)
        if target is None:
            self.directory.write(name, view)
            return
        target[: len(view)] = view

    def close(self) -> None:
        """Close every kept mapping (views still alive keep theirs until they go)."""
        with self._lock:
            kept, self._kept = list(self._kept.values()), OrderedDict()
            if self._sweeper is not None:
                self._sweeper.cancel()
                self._sweeper = None
        for segment, _ in kept:
            segment.close()

    def _schedule_sweep(self) -> None:
        """(Under the lock.) Close idle mappings in the background too, not only at the next
        use: each kept mapping holds a file descriptor (Python's mmap keeps a duplicate) and
        the pages of a file the server may have deleted, which an idle worker should give
        back within about 2 x `idle_s` (the soak's fd check waits 10 s for that)."""
        if self._sweeper is None and self._kept:
            sweeper = threading.Timer(self.idle_s, self._sweep)
            sweeper.daemon = True
            self._sweeper = sweeper
            sweeper.start()

    def _sweep(self) -> None:
        with self._lock:
            self._sweeper = None
            self._close_idle(self._clock())
            self._schedule_sweep()

    def _kept_view(self, name: str, size: int, *, writable: bool) -> memoryview | None:
        """A view of the kept mapping of `name` (made now if need be), or None when it is
        not kept. The view is taken under the lock: once it exists, another thread closing
        the mapping (evicted, stale) leaves it mapped until the view goes."""
        # A string path, not `SegmentDir.file`'s Path: this runs on every call (pathlib's
        # parsing alone is a few µs a name).
        path = f"{self._base}/{_check_name(name)}"
        key = (name, writable)
        now = self._clock()
        try:
            found = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            found = None
        with self._lock:
            self._close_idle(now)
            entry = self._kept.pop(key, None)
            stale: Segment | None = None
            if entry is not None:
                segment = entry[0]
                if found is not None and segment.identity == (
                    found.st_dev,
                    found.st_ino,
                    found.st_size,
                ):
                    self._kept[key] = (segment, now)
                    return segment.view if size <= segment.size else None
                stale = segment
            if stale is not None:
                stale.close()
            if (
                found is None
                or not stat.S_ISREG(found.st_mode)
                or not 0 < found.st_size <= self.max_file_bytes
                or size > found.st_size
            ):
                return None
            # The whole file: any tensor that fits in it later is served by this mapping.
            segment = Segment(Path(path), found.st_size, writable=writable, shared=True)
            self.mapped += 1
            self._kept[key] = (segment, now)
            while len(self._kept) > self.max_entries:
                self._kept.popitem(last=False)[1][0].close()
            self._schedule_sweep()
            return segment.view

    def _close_idle(self, now: float) -> None:
        """Close the mappings unused for `idle_s` (the least recently used come first)."""
        while self._kept:
            key, (segment, used) = next(iter(self._kept.items()))
            if now - used < self.idle_s:
                return
            del self._kept[key]
            segment.close()
