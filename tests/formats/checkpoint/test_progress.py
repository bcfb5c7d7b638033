"""Progress events of a whole-checkpoint run: counts and their reports are one step.

Two converted layers are written by two threads at once; when counting and reporting were
separate steps both could report the same count ("2/2 layers" twice) or a lower count after
a higher one. These tests hammer `Progress` from threads and check what a consumer sees.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from service.formats.checkpoint.progress import Progress

THREADS = 8
PER_THREAD = 2000


@pytest.fixture
def switch_often() -> Iterator[None]:
    """Make the interpreter switch threads as often as it can, so an unlocked window
    between a count and its report is hit within a few hundred events."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def hammer(report: Progress, body: Any) -> None:
    start = threading.Barrier(THREADS)

    def run(thread: int) -> None:
        start.wait()
        for step in range(PER_THREAD):
            body(report, thread, step)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


@pytest.mark.usefixtures("switch_often")
def test_forced_reports_carry_distinct_increasing_counts() -> None:
    events: list[dict[str, Any]] = []
    total = THREADS * PER_THREAD
    report = Progress(events.append, layers_total=total, bytes_total=3 * total)

    def body(report: Progress, thread: int, step: int) -> None:
        report("writing", f"{thread}.{step}", nbytes=1)  # throttled, not forced
        report.add(nbytes=1)
        report("converted", f"{thread}.{step}", force=True, layers=1, nbytes=1)

    hammer(report, body)
    converted = [e["layers_done"] for e in events if e["stage"] == "converted"]
    assert converted == list(range(1, total + 1))
    # Every event, throttled ones included, leaves in count order.
    layers = [e["layers_done"] for e in events]
    nbytes = [e["bytes_done"] for e in events]
    assert layers == sorted(layers) and nbytes == sorted(nbytes)
    assert (report.layers_done, report.bytes_done) == (total, 3 * total)
    assert len({e["current"] for e in events if e["stage"] == "converted"}) == total


@pytest.mark.usefixtures("switch_often")
def test_counts_without_a_listener() -> None:
    report = Progress(None, layers_total=THREADS * PER_THREAD, bytes_total=0)

    def body(report: Progress, thread: int, step: int) -> None:
        report("converted", force=True, layers=1, nbytes=2)
        report.add(nbytes=1)

    hammer(report, body)
    total = THREADS * PER_THREAD
    assert (report.layers_done, report.bytes_done) == (total, 3 * total)


def test_bytes_reported_never_exceed_the_total() -> None:
    events: list[dict[str, Any]] = []
    report = Progress(events.append, layers_total=1, bytes_total=10)
    report("copying", "a", force=True, nbytes=25)
    assert events[-1]["bytes_done"] == 10 and report.bytes_done == 25
