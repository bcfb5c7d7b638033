"""Fixtures shared by the segment tests (tests/worker/test_segment_pool.py and
test_segments_mapped.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from service.worker.segments import SegmentDir


class Clock:
    """A monotonic clock the test moves by hand (`now`)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def directory(tmp_path: Path) -> Iterator[SegmentDir]:
    """A fresh segment directory, destroyed after the test."""
    made = SegmentDir.create(tmp_path)
    yield made
    made.destroy()


@pytest.fixture
def clock() -> Clock:
    return Clock()
