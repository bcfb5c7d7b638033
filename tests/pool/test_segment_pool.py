"""Pooled segments (segments.SegmentPool): size classes, reuse of the same mapped file
across calls, what a worker writes into a lent segment seen by the pool's mapping, and the
files deleted when given back beyond the pool's size, dropped, or idle too long."""

from __future__ import annotations

import pytest
from ipc.fixtures import Clock

from service.ipc.errors import SegmentError
from service.ipc.segments import SegmentDir
from service.pool.segments import SegmentPool, pool_class

KIB = 1024
MIB = 1024 * KIB


#: bytes asked for -> pooled segment size (a page at least; at most a quarter unused).
CLASSES = [
    (0, 4 * KIB),
    (1, 4 * KIB),
    (4 * KIB, 4 * KIB),
    (4 * KIB + 1, 8 * KIB),
    (8 * KIB + 1, 12 * KIB),
    (8 * MIB, 8 * MIB),
    (8 * MIB + 1, 10 * MIB),
    (11 * MIB, 12 * MIB),
    (13 * MIB, 14 * MIB),
    (15 * MIB, 16 * MIB),
]


@pytest.mark.parametrize(("nbytes", "size"), CLASSES)
def test_size_classes(nbytes: int, size: int) -> None:
    assert pool_class(nbytes) == size


def test_a_given_back_segment_is_reused_with_its_mapping(directory: SegmentDir) -> None:
    pool = SegmentPool(directory)
    first = pool.take(3000)
    first.view(5)[:] = b"hello"
    with directory.open(first.name, 5) as seen:  # the worker's read: the first bytes
        assert bytes(seen.view) == b"hello"
    pool.give([first])
    assert pool.idle_bytes == 4 * KIB
    again = pool.take(4000)  # same class
    assert again is first and pool.created == 1 and pool.idle_bytes == 0
    other = pool.take(100)  # the only idle one is lent: a new file
    assert other.name != first.name and pool.created == 2
    assert sorted(directory.names()) == sorted([first.name, other.name])


def test_what_the_worker_writes_into_a_lent_segment_is_in_the_pools_mapping(
    directory: SegmentDir,
) -> None:
    pool = SegmentPool(directory)
    out = pool.take(6)
    with directory.open(out.name, 6, writable=True) as segment:
        segment.view[:] = b"output"
    assert bytes(out.view(6)) == b"output"
    with pytest.raises(SegmentError):  # a segment never maps past its file
        directory.open(out.name, out.capacity + 1)


def test_beyond_the_idle_limit_dropped_or_idle_too_long_the_file_goes(
    directory: SegmentDir, clock: Clock
) -> None:
    pool = SegmentPool(directory, max_idle_bytes=12 * KIB, idle_s=2.0, clock=clock)
    small, large = pool.take(10), pool.take(9 * KIB)
    pool.give([small, large])  # 4 KiB kept, 12 KiB more would pass the limit
    assert directory.names() == [small.name]
    lent = pool.take(10)
    assert lent is small
    pool.drop([lent])  # the worker may still map it
    assert directory.names() == [] and pool.idle_bytes == 0
    a, b = pool.take(10), pool.take(10)
    pool.give([a])
    clock.now += 1.5
    pool.give([b])
    clock.now += 1.0  # a idle 2.5 s, b 1 s
    assert pool.trim() == 1
    assert directory.names() == [b.name] and pool.idle_bytes == 4 * KIB
    clock.now += 5
    assert pool.trim() == 0
    assert directory.names() == [] and pool.idle_bytes == 0
    c = pool.take(10)
    pool.give([c])
    pool.clear()
    assert directory.names() == [] and pool.idle_bytes == 0
