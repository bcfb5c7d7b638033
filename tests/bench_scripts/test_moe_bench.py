"""bench/moe_bench.py's CPU side: the plan, the floors, the dry run and its files.

The device run itself is `make bench-gpu` on the H200; what can be wrong without a device
is the arithmetic that every row is judged by, so it is checked against the independent
figures of shared/reference/peer_bench.md (same definition, measured the same day).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import moe_bench  # noqa: E402

#: peer_bench.md's floors (µs) with its ceilings, int4 g128 sym, expected distinct experts;
#: its bytes are weights + scales only, ours add the activations (a few KB at these M).
PEER_FLOORS = {
    ("qwen3", 1): 4.5,
    ("qwen15", 4): 15.1,
    ("mixtral", 16): 167.9,
    ("deepseek", 64): 1179.0,
    ("mixtral", 4096): 4289.1,
    ("qwen3", 1024): 114.9,
}


@pytest.mark.parametrize(("key", "peer"), list(PEER_FLOORS.items()))
def test_floor_matches_peer_bench(key: tuple[str, int], peer: float) -> None:
    shape = moe_bench.SHAPES[key[0]]
    m = key[1]
    fl = moe_bench.floor(
        shape,
        moe_bench.VARIANTS[moe_bench.PRIMARY],
        m,
        bandwidth=moe_bench.PEER_BANDWIDTH,
        rate=moe_bench.PEER_MATMUL_RATE,
        experts=moe_bench.expected_experts(shape, m),
    )
    assert fl.us == pytest.approx(peer, rel=0.005, abs=0.05)  # peer figures have 1 decimal


def test_floor_counts_zero_points_and_int8() -> None:
    shape = moe_bench.SHAPES["qwen3"]
    sym = moe_bench.expert_bytes(shape, moe_bench.VARIANTS["int4-g128-sym"])
    zp = moe_bench.expert_bytes(shape, moe_bench.VARIANTS["int4-g128-zp"])
    g32 = moe_bench.expert_bytes(shape, moe_bench.VARIANTS["int4-g32-zp"])
    int8 = moe_bench.expert_bytes(shape, moe_bench.VARIANTS["int8-g128-sym"])
    weights = 3 * 2048 * 768
    assert sym == weights / 2 + weights / 128 * 2
    assert zp == sym + weights / 128 / 2
    assert g32 == weights / 2 + weights / 32 * 2.5
    assert int8 == weights + weights / 128 * 2


def test_expected_experts_limits() -> None:
    shape = moe_bench.SHAPES["deepseek"]
    assert moe_bench.expected_experts(shape, 1) == pytest.approx(8)
    assert moe_bench.expected_experts(shape, 4096) == pytest.approx(256)


def test_plan_covers_the_issue_and_quick_is_smaller() -> None:
    full = moe_bench.plan()
    primary = [c for c in full if c.variant == moe_bench.PRIMARY]
    assert {moe_bench.SHAPES[c.shape].name for c in primary} == {
        "Mixtral-8x7B",
        "Qwen1.5-MoE-A2.7B",
        "Qwen3-30B-A3B",
        "DeepSeek-V3",
    }
    assert all(c.tokens == (1, 4, 16, 64, 256, 1024, 4096) for c in primary)
    assert {c.variant for c in full} >= {"int8-g128-sym", "int4-g32-zp"}
    # the extras come last, so a time budget cuts them first
    assert full[: len(primary)] == primary
    quick = moe_bench.plan(quick=True)
    assert sum(len(c.tokens) for c in quick) < sum(len(c.tokens) for c in full)
    # one device call (8 minutes, humming's JIT included) must hold the full plan
    assert moe_bench.estimate_s(full) < 390  # the default --budget-s
    assert moe_bench.estimate_s(quick) < moe_bench.estimate_s(full)


def test_dry_run_writes_the_table_with_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["moe_bench.py", "--dry-run", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    assert moe_bench.main(argv[1:]) == 0
    assert "36 points" in capsys.readouterr().out
    md = (tmp_path / "moe_bench_plan.md").read_text()
    assert md.startswith("Command: `") and "--dry-run" in md
    assert "| DeepSeek-V3 | int4-g128-sym | 4096 |" in md
    payload = json.loads((tmp_path / "moe_bench_plan.json").read_text())
    assert len(payload["points"]) == 36
    assert payload["estimate_s"] > 0


def test_table_marks_fastest_and_ratios() -> None:
    point = moe_bench.Point("Qwen3-30B-A3B", moe_bench.PRIMARY, 1, 8.0, 8, 4.5, "mem")
    point.results["TRITON"] = moe_bench.Result("TRITON", "pass", 20.0, "graph", 3e-3, 3e-3)
    point.results["HUMMING"] = moe_bench.Result("HUMMING", "pass", 36.0, "graph", 5e-3, 5e-3)
    point.results["MARLIN"] = moe_bench.Result("MARLIN", "FAIL", 30.0, "graph", 0.5, 0.5)
    point.results["EMULATION"] = moe_bench.Result("EMULATION", "pass", 900.0, "eager", 1e-7)
    assert point.fastest() is point.results["TRITON"]
    row = moe_bench.table([point]).splitlines()[2]
    cells = [c.strip() for c in row.strip("|").split("|")]
    # TRITON, HUMMING, MARLIN, BATCHED_MARLIN (not run), EMULATION
    assert cells[5:10] == ["20.0", "36.0", "FAIL", "", "900.0 [eager]"]
    assert cells[10:14] == ["TRITON", "4.44", "4.0x", "0.56"]  # 80.2 / 20 and 20 / 36


def test_device_path_runs_on_cpu_with_emulation(tmp_path: Path) -> None:
    """The run itself (layer, reference, poisoned output, timing, table, files) at a tiny
    shape on the CPU: what the H200 run does, minus the GPU backends."""
    assert moe_bench.main(["--cpu-smoke", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "moe_bench.json").read_text())
    results = [p["results"]["EMULATION"] for p in payload["points"]]
    assert [r["status"] for r in results] == ["pass", "pass"]
    assert all(0 < r["rel_err"] < 1e-2 and r["us"] > 0 for r in results)
    assert "| small | int4-g128-sym | 1 |" in (tmp_path / "moe_bench.md").read_text()


def test_goals_count_the_points_that_meet_each_aim() -> None:
    def point(shape: str, m: int, floor_us: float, **us: float) -> moe_bench.Point:
        p = moe_bench.Point(shape, moe_bench.PRIMARY, m, 8.0, 8, floor_us, "mem")
        for backend, value in us.items():
            p.results[backend] = moe_bench.Result(backend, "pass", value, "graph", 3e-3, 3e-3)
        return p

    points = [
        point("Qwen3-30B-A3B", 1, 4.5, TRITON=12.0, HUMMING=36.0),  # 80.2/12 = 6.7x
        point("Qwen3-30B-A3B", 16, 46.8, TRITON=200.0, HUMMING=90.0),  # 681.5/200 = 3.4x
        point("Mixtral-8x7B", 16, 168.0, TRITON=2000.0, HUMMING=200.0),
    ]
    points[2].results["TRITON"].status = "FAIL"
    text = moe_bench.goals(points).splitlines()
    assert text[0].startswith("- TRITON >= 5x faster than vLLM's Triton (peer figure): 1 of 3")
    assert "worst 3.41 at Qwen3-30B-A3B M=16" in text[0]
    assert text[1].startswith("- TRITON within 1.5x of humming (same run): 1 of 3")
    assert "worst 2.22 at Qwen3-30B-A3B M=16" in text[1]
    # fastest at M >= 16: Qwen3 humming 90 / 46.8 = 1.92, Mixtral humming 200 / 168 = 1.19
    assert text[2].startswith("- fastest within 1.25x of the floor, M >= 16: 1 of 2")
    assert text[3].startswith("- fastest forward at M = 1 on the Qwen shapes <= 15 µs: 1 of 1")
