"""Segment mappings a worker keeps between calls (segments.MappedSegments): a kept mapping
serves the next call, the bytes read are always the file's current ones however the server
wrote them, a replaced, resized or removed segment is never served from a stale mapping,
and the cache stays bounded (entries, file size, idle time)."""

from __future__ import annotations

import os
import time

import pytest
from ipc.fixtures import Clock

from service.ipc.errors import SegmentError
from service.ipc.segments import SegmentDir
from service.worker.mapped import MappedSegments

KIB = 1024


def put(directory: SegmentDir, name: str, data: bytes, size: int | None = None) -> None:
    """A new segment of `size` bytes (default: the data's) starting with `data`."""
    with directory.new(name, size or len(data)) as segment:
        segment.view[: len(data)] = data


def test_a_kept_mapping_serves_the_next_call(directory: SegmentDir) -> None:
    put(directory, "a", b"x" * 100, 4 * KIB)
    mapped = MappedSegments(directory)
    assert bytes(mapped.read("a", 100)) == b"x" * 100
    assert bytes(mapped.read("a", 10)) == b"x" * 10
    assert bytes(mapped.read("a", 4 * KIB))[:100] == b"x" * 100  # the whole file is mapped
    assert mapped.mapped == 1 and len(mapped) == 1


def test_a_kept_input_mapping_cannot_be_written(directory: SegmentDir) -> None:
    """Shared read-only: a write can never leave a private page that later calls would read
    instead of the file's bytes (a copy-on-write mapping would)."""
    put(directory, "a", b"x" * 64)
    mapped = MappedSegments(directory)
    view = mapped.read("a", 64)
    assert view.readonly
    with pytest.raises(TypeError):
        view[0] = 1


def test_new_bytes_are_seen_however_the_server_writes_them(directory: SegmentDir) -> None:
    """The server refills a pooled segment through its own shared mapping or `pwrite`: the
    kept (copy-on-write, never written) mapping reads the new bytes, with no re-mapping."""
    put(directory, "in", b"\0" * (8 * KIB))
    mapped = MappedSegments(directory)
    first = mapped.read("in", 8 * KIB)
    assert bytes(first) == b"\0" * (8 * KIB)
    with directory.open("in", 8 * KIB, writable=True) as server:
        server.view[:] = b"\1" * (8 * KIB)
    assert bytes(mapped.read("in", 8 * KIB)) == b"\1" * (8 * KIB)
    assert bytes(first) == b"\1" * (8 * KIB)  # the very same pages
    directory.write("in", memoryview(b"\2" * 5000))
    assert bytes(mapped.read("in", 8 * KIB)) == b"\2" * 5000 + b"\1" * (8 * KIB - 5000)
    assert mapped.mapped == 1


def test_what_the_worker_writes_reaches_the_server(directory: SegmentDir) -> None:
    put(directory, "out", b"\0" * (4 * KIB))
    mapped = MappedSegments(directory)
    with directory.open("out", 4 * KIB, writable=True) as server:
        for value in (5, 6):
            mapped.write("out", memoryview(bytes([value]) * 3000))
            assert bytes(server.view[:3000]) == bytes([value]) * 3000
            assert bytes(server.view[3000:]) == b"\0" * (4 * KIB - 3000)
    assert mapped.mapped == 1
    with pytest.raises(SegmentError):
        mapped.write("out", memoryview(b"\0" * (4 * KIB + 1)))  # bigger than the segment


@pytest.mark.parametrize("size", [4 * KIB, 8 * KIB], ids=["same size", "resized"])
def test_a_replaced_segment_is_mapped_anew(directory: SegmentDir, size: int) -> None:
    """Removed and made again under the same name (a new file, so a new identity even if
    the file system recycles inode numbers: the kept mapping holds the old one)."""
    put(directory, "a", b"o" * (4 * KIB))
    mapped = MappedSegments(directory)
    assert bytes(mapped.read("a", 16)) == b"o" * 16
    os.unlink(directory.file("a"))
    put(directory, "a", b"n" * size)
    assert bytes(mapped.read("a", 16)) == b"n" * 16
    assert mapped.mapped == 2 and len(mapped) == 1
    mapped.write("a", memoryview(b"w" * 16))
    os.unlink(directory.file("a"))
    put(directory, "a", b"m" * size)
    mapped.write("a", memoryview(b"v" * 8))
    assert bytes(mapped.read("a", 16)) == b"v" * 8 + b"m" * 8


def test_a_truncated_segment_is_not_read_past_its_end(directory: SegmentDir) -> None:
    put(directory, "a", b"x" * (8 * KIB))
    mapped = MappedSegments(directory)
    mapped.read("a", 8 * KIB)
    os.truncate(directory.file("a"), 4 * KIB)
    with pytest.raises(SegmentError):
        mapped.read("a", 8 * KIB)
    assert bytes(mapped.read("a", 4 * KIB)) == b"x" * (4 * KIB)


def test_a_removed_segment_is_an_error_and_its_mapping_closed(directory: SegmentDir) -> None:
    put(directory, "a", b"x" * 64)
    mapped = MappedSegments(directory)
    mapped.read("a", 64)
    directory.remove("a")
    with pytest.raises(FileNotFoundError):
        mapped.read("a", 64)
    with pytest.raises(FileNotFoundError):
        mapped.write("a", memoryview(b"y"))
    assert len(mapped) == 0


def test_bad_names_and_sizes_fail_as_without_the_cache(directory: SegmentDir) -> None:
    put(directory, "a", b"x" * 64)
    mapped = MappedSegments(directory)
    with pytest.raises(SegmentError):
        mapped.read("../a", 64)
    with pytest.raises(SegmentError):
        mapped.read("a", 65)
    os.symlink(directory.file("a"), directory.file("link"))
    with pytest.raises(OSError):
        mapped.read("link", 64)  # not followed, as SegmentDir.open
    assert bytes(mapped.read("missing", 0)) == b""


def test_at_most_max_entries_kept_least_recently_used_first(directory: SegmentDir) -> None:
    for number in range(5):
        put(directory, f"s{number}", bytes([number]) * 64)
    mapped = MappedSegments(directory, max_entries=3)
    for number in (0, 1, 2, 0, 3):  # s1 is then the least recently used
        assert bytes(mapped.read(f"s{number}", 64)) == bytes([number]) * 64
    assert len(mapped) == 3 and mapped.mapped == 4
    mapped.read("s0", 64)
    assert mapped.mapped == 4  # s0 still kept
    mapped.read("s1", 64)
    assert mapped.mapped == 5 and len(mapped) == 3


def test_big_files_are_mapped_per_call_not_kept(directory: SegmentDir) -> None:
    put(directory, "big", b"b" * (8 * KIB))
    mapped = MappedSegments(directory, max_file_bytes=4 * KIB)
    assert bytes(mapped.read("big", 8 * KIB)) == b"b" * (8 * KIB)
    mapped.write("big", memoryview(b"c" * 10))  # through pwrite
    assert bytes(mapped.read("big", 12)) == b"c" * 10 + b"bb"
    assert len(mapped) == 0 and mapped.mapped == 0


def test_mappings_idle_too_long_are_closed_at_the_next_use(
    directory: SegmentDir, clock: Clock
) -> None:
    put(directory, "a", b"a" * 64)
    put(directory, "b", b"b" * 64)
    mapped = MappedSegments(directory, idle_s=2.0, clock=clock)
    mapped.read("a", 64)
    clock.now += 1.5
    mapped.read("b", 64)
    clock.now += 1.0  # a idle 2.5 s, b 1.0 s
    mapped.read("b", 64)
    assert len(mapped) == 1 and mapped.mapped == 2
    mapped.close()
    assert len(mapped) == 0


def test_a_view_outlives_its_mapping_being_closed(directory: SegmentDir) -> None:
    """A call's view stays valid while another call evicts or closes the kept mapping
    (run jobs run side by side): the mapping goes only with the last view."""
    put(directory, "a", b"a" * 64)
    put(directory, "b", b"b" * 64)
    mapped = MappedSegments(directory, max_entries=1)
    view = mapped.read("a", 64)
    mapped.read("b", 64)  # evicts a's mapping
    assert len(mapped) == 1 and bytes(view) == b"a" * 64
    held = mapped.read("b", 64)
    mapped.close()
    assert bytes(held) == b"b" * 64


def test_an_idle_worker_gives_its_mappings_and_descriptors_back(directory: SegmentDir) -> None:
    """Without any further call, a background sweep closes idle mappings (each holds a
    descriptor: the soak's fd check counts them) within about two idle periods."""
    put(directory, "a", b"x" * 64)
    put(directory, "b", b"y" * 64)
    before = len(os.listdir("/proc/self/fd"))
    mapped = MappedSegments(directory, idle_s=0.2)
    mapped.read("a", 64)
    mapped.write("b", memoryview(b"z" * 8))
    assert len(mapped) == 2 and len(os.listdir("/proc/self/fd")) >= before + 2
    deadline = time.monotonic() + 5
    while len(mapped) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(mapped) == 0
    assert len(os.listdir("/proc/self/fd")) <= before
    assert bytes(mapped.read("b", 8)) == b"z" * 8  # and the next call maps again
    mapped.close()
