"""How a whole-checkpoint job is cut into layer ranges for several workers, and how their
progress merges (the runs themselves: tests/integration/test_multi_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from service.api.convert_spread import SpreadPlan, _Merged, chunk_size, plan_spread
from service.formats.checkpoint import JOURNAL_DIR, MANIFEST_NAME, convert_checkpoint, plan_job
from service.formats.paths import DataRoot
from service.formats.synthetic import SyntheticSpec, write_synthetic_checkpoint
from service.oracle import preset

SPEC = SyntheticSpec(num_layers=6, num_experts=2, hidden_size=64, intermediate_size=64)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("spread")
    write_synthetic_checkpoint(base / "model", SPEC)
    return base


def job(root: Path, out: str, layers: tuple[int, int] | None = None) -> Any:
    return plan_job(
        "model",
        out,
        root=DataRoot.at(root),
        platform=preset("h200"),
        backend="TRITON",
        layers=layers,
    )


@pytest.mark.parametrize(
    ("layers", "workers", "size"), [(0, 2, 1), (1, 2, 1), (5, 2, 2), (31, 2, 8), (31, 8, 2)]
)
def test_about_two_ranges_per_worker(layers: int, workers: int, size: int) -> None:
    assert chunk_size(layers, workers) == size


def test_ranges_cover_the_job_with_the_last_layer_alone(root: Path) -> None:
    plan = plan_spread(job(root, "out/a"), 2)
    assert plan is not None
    # Five layers before the last, about two ranges per worker: two layers each; the first
    # range starts at 0 (it owns the copies), the last layer is a range of its own.
    assert plan.ranges == ((0, 2), (2, 4), (4, 5), (5, 6))
    assert plan.layers_total == 6
    assert plan.modules[0] == "model.layers.0.block_sparse_moe.experts"
    part = plan_spread(job(root, "out/b", layers=(2, 6)), 2)
    assert part is not None
    assert part.ranges == ((2, 3), (3, 4), (4, 5), (5, 6))
    assert part.layers_total == 4


def test_totals_match_what_one_run_reports(root: Path) -> None:
    for layers in (None, (2, 6)):
        events: list[dict[str, Any]] = []
        whole = job(root, f"out/one-{layers}", layers)
        plan = plan_spread(whole, 2)
        assert plan is not None
        convert_checkpoint(whole, progress=events.append)
        assert (events[0]["layers_total"], events[0]["bytes_total"]) == (
            plan.layers_total,
            plan.bytes_total,
        )


def test_reruns_and_single_layers_run_whole(root: Path) -> None:
    assert plan_spread(job(root, "out/c", layers=(3, 4)), 2) is None  # one layer
    broken = root / "broken"
    broken.mkdir(exist_ok=True)
    (broken / "config.json").write_bytes((root / "model" / "config.json").read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    unreadable = plan_job(
        "broken", "out/x", root=DataRoot.at(root), platform=preset("h200"), backend="TRITON"
    )
    assert plan_spread(unreadable, 2) is None  # the worker's run reports it, as always
    done = root / "out" / "done"
    done.mkdir(parents=True)
    (done / MANIFEST_NAME).write_text("{}")
    assert plan_spread(job(root, "out/done"), 2) is None
    nearly = root / "out" / "nearly" / JOURNAL_DIR
    nearly.mkdir(parents=True)
    (nearly / "moe-layer-00005.json").write_text("{}")
    assert plan_spread(job(root, "out/nearly"), 2) is None
    (nearly / "moe-layer-00005.json").unlink()
    (nearly / "moe-layer-00001.json").write_text("{}")  # an interrupted spread run
    assert plan_spread(job(root, "out/nearly"), 2) is not None


def test_merged_progress_only_grows_and_ends_complete() -> None:
    plan = SpreadPlan(ranges=((0, 1), (1, 2)), modules=("a", "b"), layers_total=2, bytes_total=100)
    sent: list[dict[str, Any]] = []
    merged = _Merged(plan, sent.append)
    merged.start()
    merged.update(0, {"stage": "planning", "layers_total": 1, "bytes_total": 60})
    merged.update(1, {"stage": "planning", "layers_total": 1, "bytes_total": 40})
    merged.update(0, {"stage": "converting", "layers_done": 0, "bytes_done": 30})
    merged.update(1, {"stage": "converted", "layers_done": 1, "bytes_done": 40})
    merged.update(0, {"stage": "copying", "layers_done": 0, "bytes_done": 10})  # a retry
    merged.finish(0)
    merged.update(1, {"stage": "finalizing", "layers_done": 1, "bytes_done": 40})
    assert [e["stage"] for e in sent] == [
        "planning",
        "converting",
        "converted",
        "copying",
        "finalizing",
    ]
    assert [e["bytes_done"] for e in sent] == [0, 30, 70, 70, 100]
    assert [e["layers_done"] for e in sent] == [0, 0, 1, 1, 2]
    assert all((e["layers_total"], e["bytes_total"]) == (2, 100) for e in sent)
    json.dumps(sent)  # what the codec turns into ConvertProgress
