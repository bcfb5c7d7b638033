"""The segment directory both sides share: private, sized, cleaned up by prefix."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.ipc.errors import SegmentError
from service.ipc.segments import SegmentDir


def test_segments_are_private_sized_and_removed_by_prefix(tmp_path: Path) -> None:
    segments = SegmentDir.create(tmp_path)
    assert segments.path.stat().st_mode & 0o777 == 0o700
    with segments.new("c1-in-0", 16) as segment:
        segment.view[:4] = b"abcd"
    with segments.new("c1-in-1", 0) as empty:
        assert len(empty.view) == 0
    segments.new("c2-in-0", 8).close()
    with pytest.raises(SegmentError):
        segments.open("c1-in-0", 17)
    with pytest.raises(SegmentError):
        segments.new("../escape", 1)
    assert segments.remove("c1-") == 2
    assert segments.names() == ["c2-in-0"]
    segments.destroy()
    assert not segments.path.exists()
