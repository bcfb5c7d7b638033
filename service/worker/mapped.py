"""The worker's kept mappings of the server's segment files.

The server lends the same pooled segments call after call (`service.pool.segments`); a worker
that keeps its mapping of each from the last call serves the next one for one `stat` instead
of an open, a map and a page fault per page. `MappedSegments` is that cache, never stale and
bounded.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from service.ipc.segments import Segment, SegmentDir, check_name

#: Most segment mappings a worker keeps between calls (per segment directory).
MAPPED_MAX_ENTRIES = 16
#: Largest segment file whose mapping is kept; bigger ones are mapped for one call only
#: (their open and map cost little next to their bytes, and kept they would hold memory).
MAPPED_MAX_FILE_BYTES = 1 << 20
#: Seconds a kept mapping may go unused before the next use of the cache closes it (the
#: server's idle pooled segments are deleted after as long: service.pool.segments).
MAPPED_IDLE_S = 2.0


class MappedSegments:
    """Mappings of a segment directory's files, kept by a worker from one call to the next.

    Why: mapping a segment per call costs open + fstat + mmap + close and a page fault on
    first touch of each page, every call (bench/RESULTS.md has the host time it costs). The
    server lends the same pooled segments call after call, so a mapping kept from the last
    call serves the next one for one `stat`.

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
    is what the next call reads (tests/worker/test_mapped.py).

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
        path = f"{self._base}/{check_name(name)}"
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
