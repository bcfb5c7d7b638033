"""The server's pool of segment files, reused from one call to the next.

A tensor crosses to a worker in a segment file (`service.ipc.segments`). Making, reserving,
mapping and deleting a file per tensor per call is most of a small call's cost, so the server
keeps the files of past calls mapped, by size class, and lends them to the next call; idle
ones are deleted after a short while, so an idle server holds none.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import time
from collections.abc import Callable, Iterable

from service.ipc.segments import Segment, SegmentDir

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

    Creating, reserving, mapping and deleting a file per tensor per call allocates, zeroes
    and faults in every page anew on tmpfs (bench/RESULTS.md has what it costs); writing
    into a mapping kept from the last call costs the copy alone. A segment is lent to one
    call at a time: `give` returns it once the worker has answered (it no longer reads or
    writes it); `drop` deletes it instead when the worker may still use it (an abandoned
    call, a dead worker). Idle segments beyond `max_idle_bytes`, or idle longer than
    `idle_s` (`trim`), are deleted. Not thread-safe: one event loop owns it.
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
