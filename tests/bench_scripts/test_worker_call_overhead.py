"""bench/worker_call_overhead.py on the CPU default, a few calls: a real worker process
runs the kept layer at M = 1 and the stage table has every stage run_moe reports, plus the
pipe and hand-over, each a positive time."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import worker_call_overhead


def test_the_stage_table_on_a_cpu_worker(capsys: pytest.CaptureFixture[str]) -> None:
    asyncio.run(worker_call_overhead.measure("cpu", "small", "", calls=5, warmup=1))
    out = capsys.readouterr().out
    assert "run_moe M=1 on cpu (small: E=4 k=2 H=64 I=64 int4 g32, EMULATION)" in out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ")][1:]
    stages = [row[0].removeprefix("| ") for row in rows]
    assert stages == [
        "open", "layer", "routing", "to_device", "forward", "output", "pipe + hand-over",
    ]  # fmt: skip
    assert all(float(row[1]) > 0 for row in rows)
