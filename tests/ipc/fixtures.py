"""Fixtures shared by the tests of segment users on both sides of the boundary (the
server's pool, tests/pool/test_segment_pool.py; the worker's kept mappings,
tests/worker/test_mapped.py): their conftest modules take them from here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from service.ipc.segments import SegmentDir


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
