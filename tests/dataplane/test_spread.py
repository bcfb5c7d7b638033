"""How a whole-checkpoint job is cut into layer ranges for several workers, and how their
progress merges (the runs themselves: tests/integration/test_multi_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from service.dataplane import spread as convert_spread
from service.dataplane.spread import SpreadPlan, _Merged, chunk_size, plan_spread
from service.formats.checkpoint.job import convert_checkpoint
from service.formats.checkpoint.plan import JOURNAL_DIR, MANIFEST_NAME, CheckpointJob, plan_job
from service.formats.io.paths import DataRoot
from service.formats.synthetic.checkpoints import SyntheticSpec, write_synthetic_checkpoint
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


def test_ranges_cover_the_job_the_first_with_one_layer(root: Path) -> None:
    plan = plan_spread(job(root, "out/a"), 2)
    assert plan is not None
    # The first range starts at 0 and owns the copies: one layer beside them; the five
    # small layers after it, about two ranges per worker.
    assert plan.ranges == ((0, 1), (1, 3), (3, 5), (5, 6))
    assert (plan.layers_total, plan.end) == (6, 6)
    assert [plan.layers_in(n) for n in range(len(plan.ranges) + 1)] == [1, 2, 2, 1, 0]
    assert plan.modules[0] == "model.layers.0.block_sparse_moe.experts"
    # Every shard hashed once, over the first ranges (one per worker), none twice.
    shards = sorted(p.name for p in (root / "model").glob("*.safetensors"))
    hashed = [name for names in plan.hashes for name in names]
    assert sorted(hashed) == shards and len(plan.hashes) == 2
    part = plan_spread(job(root, "out/b", layers=(2, 6)), 2)
    assert part is not None
    assert part.ranges == ((2, 3), (3, 4), (4, 5), (5, 6))
    assert part.layers_total == 4
    assert all(not names for names in part.hashes)  # the range owning the rest hashes


def test_large_layers_one_per_range(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(convert_spread, "LARGE_LAYER_BYTES", 1)
    plan = plan_spread(job(root, "out/large"), 2)
    assert plan is not None
    assert plan.ranges == tuple((i, i + 1) for i in range(6))


def test_only_the_final_call_finalizes_byte_for_byte_as_one_run(root: Path) -> None:
    """The plan's range jobs run here one after another, in reverse (ranges end in any
    order), then the finalizing call: the tree is what one whole run writes."""
    whole = job(root, "out/whole")
    convert_checkpoint(whole)
    spread = job(root, "out/ranges")
    plan = plan_spread(spread, 2)
    assert plan is not None
    stages: dict[str, float] = {}
    for number in reversed(range(len(plan.ranges))):
        ranged = CheckpointJob.from_json(plan.range_job(spread.to_json(), number))
        assert not ranged.finalize
        result = convert_checkpoint(ranged)
        assert result.manifest_path is None
        for name, seconds in result.stage_seconds.items():
            stages[name] = stages.get(name, 0.0) + seconds
    assert not (root / "out" / "ranges" / MANIFEST_NAME).exists()
    final = CheckpointJob.from_json(plan.range_job(spread.to_json(), len(plan.ranges)))
    assert final.finalize and final.layers == (6, 6)
    assert convert_checkpoint(final).manifest_path == root / "out" / "ranges" / MANIFEST_NAME
    assert tree(root / "out" / "ranges") == tree(root / "out" / "whole")
    # Stage times: every layer converted and written, every shard hashed once.
    assert {"convert", "write_hash", "fsync_rename", "hash_sources", "copy_rest"} <= set(stages)
    assert all(seconds >= 0 for seconds in stages.values())


def tree(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


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
        # Each converted layer says where its time went (the server logs it at debug).
        converted = [e for e in events if e["stage"] == "converted"]
        assert len(converted) == plan.layers_total
        for event in converted:
            assert {"verify", "repack", "convert", "wait_write", "write_hash"} <= set(
                event["stages"]
            )
            assert {"fsync_rename", "journal"} <= set(event["stages"])


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
    # An interrupted run, even one with its last layer done, spreads: each range verifies
    # its own records, and only the final call finalizes.
    (nearly / "moe-layer-00005.json").write_text("{}")
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
