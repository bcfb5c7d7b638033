"""bench/prefill_rs_bench.py without a GPU: its candidate tiles, the winning rows it keeps and
the merge into a tuned table (the device run itself needs an H200)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

# The bench imports every Triton kernel module; Triton decides interpret-or-compile when a
# kernel is decorated, so on a machine without a GPU the interpreter must be on first (as
# the kernel tests switch it on), or later tests would call compiled-mode kernels.
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import prefill_rs_bench as bench

from service.kernels.triton.config import PREFILL_RS
from service.kernels.triton.tuned import config_from_dict, config_to_dict


def test_candidates_follow_routes_per_expert() -> None:
    # Mixtral-8x7B: 16 tokens x top-2 on 8 experts is 4 routes per expert -> 16-token blocks.
    small = bench.candidates(16, 2, 8, 4096, 132)
    assert small
    assert {c.block_m for c in small} == {16}
    assert all(c.kernel == PREFILL_RS for c in small)
    # 4096 tokens: 1024 routes per expert -> 128-token blocks, the scale folded in.
    large = bench.candidates(4096, 2, 8, 4096, 132)
    assert {c.block_m for c in large} == {128}
    assert not any(c.w13.scale_after for c in large)


def _row(shape: str, m: int, v3: float, rs: dict[str, float]) -> bench.Row:
    row = bench.Row(shape, "int4-g128-sym", m, 10.0, "mem")
    row.trials.append(bench.Trial("v3 prefill bm16", "pass", v3))
    for n, (label, us) in enumerate(rs.items()):
        config = bench.candidates(m, 2, 8, 4096, 132)[n]
        row.trials.append(bench.Trial(label, "pass", us, config=config_to_dict(config)))
    return row


def test_tuned_rows_keep_only_points_the_new_kernels_won() -> None:
    rows = [
        _row("A", 16, 100.0, {"rs one": 80.0, "rs two": 70.0}),
        _row("A", 4096, 100.0, {"rs one": 120.0}),
    ]
    rows[0].trials.append(bench.Trial("rs failed", "FAIL", 1.0))
    kept = bench.tuned_rows(rows, {("A", "int4-g128-sym"): "KEY"})
    assert list(kept) == ["KEY"]
    assert list(kept["KEY"]) == ["16"]
    best = config_from_dict(kept["KEY"]["16"])
    assert best == config_from_dict(rows[0].trials[2].config or {})


def test_merge_adds_and_replaces_rows_in_order(tmp_path: Path) -> None:
    table = tmp_path / "NVIDIA_H200.json"
    old = config_to_dict(bench.candidates(16, 2, 8, 4096, 132)[0])
    table.write_text(json.dumps({"made_by": "tuner", "configs": {"KEY": {"1": old, "256": old}}}))
    new = config_to_dict(bench.candidates(4096, 2, 8, 4096, 132)[0])
    text = bench.merge_rows(table, {"KEY": {"256": new, "64": new}, "OTHER": {"16": new}})
    data = json.loads(table.read_text())
    assert text == table.read_text()
    assert list(data["configs"]["KEY"]) == ["1", "64", "256"]
    assert data["configs"]["KEY"]["256"] == new
    assert data["configs"]["KEY"]["1"] == old
    assert data["configs"]["OTHER"] == {"16": new}
    assert data["made_by"].startswith("tuner; ")
