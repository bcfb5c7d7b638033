"""Whole-checkpoint conversion: discovery, conversion, copying, manifest, resume, ranges."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from service.formats import registry
from service.formats.checkpoint.job import convert_checkpoint
from service.formats.checkpoint.journal import remove_if_bare
from service.formats.checkpoint.plan import (
    INDEX_NAME,
    JOURNAL_DIR,
    MANIFEST_NAME,
    CheckpointJob,
    find_moe_layers,
    plan_job,
)
from service.formats.errors import (
    ConversionUnsupported,
    ConvertCancelledError,
    ConvertInputError,
    PermissionDeniedError,
)
from service.formats.io.naming import match_expert_tensor
from service.formats.io.paths import DataRoot
from service.formats.synthetic.checkpoints import SyntheticSpec, write_synthetic_checkpoint
from service.oracle import DEFAULT_RULESET, preset

SMALL = SyntheticSpec(num_layers=3, num_experts=4, hidden_size=128, intermediate_size=128)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Any]]:
    root = tmp_path_factory.mktemp("root")
    layers = write_synthetic_checkpoint(root / "mixtral-gptq", SMALL)
    return root, layers


def job_for(root: Path, out: str, backend: str = "TRITON", **kwargs: Any) -> CheckpointJob:
    return plan_job(
        "mixtral-gptq",
        out,
        root=DataRoot.at(root),
        platform=preset("a100"),
        backend=backend,
        **kwargs,
    )


def test_expert_names_of_each_family() -> None:
    assert match_expert_tensor("model.layers.3.block_sparse_moe.experts.7.w2.qweight") == (
        "mixtral",
        "model.layers.3.block_sparse_moe.experts",
        3,
        "7.w2.qweight",
    )
    assert match_expert_tensor("model.layers.0.mlp.experts.12.gate_proj.scales") == (
        "hf",
        "model.layers.0.mlp.experts",
        0,
        "12.gate_proj.scales",
    )
    hit = match_expert_tensor("model.language_model.layers.5.mlp.experts.0.up_proj.qzeros")
    assert hit is not None and hit[1] == "model.language_model.layers.5.mlp.experts"
    for other in (
        "model.layers.0.mlp.shared_experts.gate_proj.qweight",  # DeepSeek shared expert
        "model.layers.0.mlp.shared_expert.up_proj.qweight",  # Qwen2-MoE shared expert
        "model.layers.0.block_sparse_moe.gate.weight",  # the router
        "model.layers.0.mlp.gate_proj.qweight",  # a dense MLP
    ):
        assert match_expert_tensor(other) is None
    layers, rest = find_moe_layers(
        {
            "a": ["model.layers.1.mlp.experts.0.gate_proj.qweight", "model.norm.weight"],
            "b": ["model.layers.1.mlp.experts.1.gate_proj.qweight", "lm_head.weight"],
        }
    )
    assert [(layer.index, layer.num_experts, sorted(layer.files)) for layer in layers] == [
        (1, 2, ["a", "b"])
    ]
    assert rest == {"a": ["model.norm.weight"], "b": ["lm_head.weight"]}


def test_plan_reads_config_and_asks_the_oracle(checkpoint: tuple[Path, Any]) -> None:
    root, _ = checkpoint
    job = job_for(root, "out-plan", backend="")
    assert (job.target.backend, job.target.chosen_by) == ("MARLIN", "oracle")
    assert (job.source.layout, job.source.bits, job.source.group_size) == ("gptq", 4, 64)
    assert job.num_experts == 4 and job.gated
    with pytest.raises(ConvertInputError, match="unknown backend"):
        job_for(root, "out-plan", backend="WARP_DRIVE")
    with pytest.raises(PermissionDeniedError):
        job_for(root, "../escape")


def convert(job: CheckpointJob, **kwargs: Any) -> tuple[Any, list[dict[str, Any]]]:
    events: list[dict[str, Any]] = []
    result = convert_checkpoint(job, progress=events.append, **kwargs)
    return result, events


def test_converts_every_layer_and_copies_the_rest(checkpoint: tuple[Path, Any]) -> None:
    root, layers = checkpoint
    job = job_for(root, "out-triton")
    result, events = convert(job)
    out = root / "out-triton"
    assert result.manifest_path == out / MANIFEST_NAME
    assert (result.layers_converted, result.layers_skipped) == (3, 0)
    assert not (out / JOURNAL_DIR).exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "temp files left"

    source = root / "mixtral-gptq"
    originals: dict[str, torch.Tensor] = {}
    for shard in sorted(source.glob("*.safetensors")):
        originals |= load_file(shard)
    index = json.loads((out / INDEX_NAME).read_text())
    converted: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        converted |= load_file(out / file)
    assert set(converted) == set(index["weight_map"])
    # Everything but the experts is copied byte for byte.
    for name, tensor in originals.items():
        if ".experts." not in name:
            assert torch.equal(converted[name], tensor), name
    assert not [n for n in converted if ".experts." in n and ".experts.0." in n]
    # Each MoE layer holds exactly what the registry's TRITON writer makes of it.
    for index_, layer in layers.items():
        module = f"model.layers.{index_}.block_sparse_moe.experts"
        expected = registry.convert(layer, "TRITON", source="gptq").tensors
        for name, tensor in expected.items():
            assert torch.equal(converted[f"{module}.{name}"], tensor), (module, name)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["backend"] == "TRITON" and manifest["ruleset"] == DEFAULT_RULESET
    assert [layer["index"] for layer in manifest["layers"]] == [0, 1, 2]
    assert manifest["target_format"]["backend"] == "TRITON"
    files = {f["name"]: f for f in manifest["source"]["files"]}
    assert {"config.json", INDEX_NAME, "tokenizer.json"} <= set(files)
    assert all(len(f["sha256"]) == 64 for f in files.values())
    # config.json is the source's but for the quantization config of the converted files.
    written = json.loads((out / "config.json").read_text())
    original = json.loads((source / "config.json").read_text())
    quant = written.pop("quantization_config")
    assert written == {k: v for k, v in original.items() if k != "quantization_config"}
    assert quant["source_quantization_config"] == original["quantization_config"]
    assert (quant["quant_method"], quant["backend"]) == ("moe_control", "TRITON")
    assert (out / "tokenizer.json").exists()
    by_name = {t["name"]: t for t in result.tensors}
    assert set(by_name) == set(index["weight_map"])
    stages = [e["stage"] for e in events]
    assert stages[0] == "planning" and "converted" in stages and "finalizing" in stages
    assert events[-1]["layers_done"] == 3


def test_a_second_run_verifies_and_skips(checkpoint: tuple[Path, Any]) -> None:
    root, _ = checkpoint
    job = job_for(root, "out-resume")
    convert(job)
    before = {p.name: p.stat().st_mtime_ns for p in (root / "out-resume").iterdir()}

    def refuse(*args: Any) -> Any:
        raise AssertionError("a finished layer was converted again")

    again, events = convert(job, converter=refuse)
    assert (again.layers_converted, again.layers_skipped) == (0, 3)
    assert "skipped" in [e["stage"] for e in events]
    after = {p.name: p.stat().st_mtime_ns for p in (root / "out-resume").iterdir()}
    shard_files = [n for n in before if n.endswith(".safetensors")]
    assert all(before[n] == after[n] for n in shard_files), "finished files were rewritten"
    assert len(again.tensors) == len(
        json.loads((root / "out-resume" / INDEX_NAME).read_text())["weight_map"]
    )


def test_a_damaged_layer_is_converted_again(checkpoint: tuple[Path, Any]) -> None:
    root, _ = checkpoint
    job = job_for(root, "out-damaged")
    convert(job)
    victim = root / "out-damaged" / "moe-layer-00001.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    again, _ = convert(job)
    assert (again.layers_converted, again.layers_skipped) == (1, 2)
    manifest = json.loads((root / "out-damaged" / MANIFEST_NAME).read_text())
    unit = next(u for u in manifest["units"] if u["unit"] == "moe-layer-00001")
    assert all(
        load_file(victim)[name].numel() >= 0 and unit["tensors"][name]["sha256"]
        for name in unit["tensors"]
    )
    convert(job, converter=lambda *a: (_ for _ in ()).throw(AssertionError("converted")))


def test_cancel_leaves_only_finished_units(checkpoint: tuple[Path, Any]) -> None:
    root, _ = checkpoint
    job = job_for(root, "out-cancel")
    calls = 0

    def check() -> None:
        nonlocal calls
        calls += 1
        if calls > 4:
            raise ConvertCancelledError("cancelled")

    with pytest.raises(ConvertCancelledError):
        convert_checkpoint(job, check=check)
    out = root / "out-cancel"
    assert not (out / MANIFEST_NAME).exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".") and p.name != JOURNAL_DIR]
    assert not [p for p in (out / JOURNAL_DIR).iterdir() if ".tmp-" in p.name]
    finished = sorted(p.name for p in out.glob("moe-layer-*.safetensors"))
    result, _ = convert(job)
    assert result.layers_skipped == len(finished)
    assert result.manifest_path is not None


def test_layer_ranges_split_the_work(checkpoint: tuple[Path, Any]) -> None:
    root, _ = checkpoint
    second = convert_checkpoint(job_for(root, "out-ranges", layers=(2, 10)))
    assert second.manifest_path is None and second.layers_converted == 1
    assert not (root / "out-ranges" / "model-00001-of-00002.safetensors").exists()
    first = convert_checkpoint(job_for(root, "out-ranges", layers=(0, 2)))
    assert first.layers_converted == 2 and first.manifest_path is not None
    index = json.loads((root / "out-ranges" / INDEX_NAME).read_text())
    assert "model.layers.2.block_sparse_moe.experts.w2_qweight" in index["weight_map"]
    assert "lm_head.weight" in index["weight_map"]


def test_another_conversion_in_the_directory_is_refused(checkpoint: tuple[Path, Any]) -> None:
    root, _ = checkpoint
    convert(job_for(root, "out-other"))
    with pytest.raises(ConvertInputError, match="another conversion") as info:
        convert(job_for(root, "out-other", backend="EMULATION"))
    assert info.value.field == "checkpoint.output_dir"
    (root / "not-empty").mkdir()
    (root / "not-empty" / "mine.txt").write_text("keep me")
    with pytest.raises(ConvertInputError, match="not empty"):
        convert(job_for(root, "not-empty"))
    assert (root / "not-empty" / "mine.txt").read_text() == "keep me"


def test_unsupported_backend_fails_before_writing(checkpoint: tuple[Path, Any]) -> None:
    root, _ = checkpoint
    with pytest.raises(ConversionUnsupported):
        convert(job_for(root, "out-cpu", backend="CPU"))
    assert not (root / "out-cpu").exists()


def test_a_refused_layer_leaves_no_directory(tmp_path: Path) -> None:
    """An act-order layer for Marlin under a release whose kernel takes no g_idx: refused
    by the writer, and the directories the run made (journal and all) are gone."""
    spec = SyntheticSpec(
        num_layers=2, num_experts=4, hidden_size=128, intermediate_size=128, desc_act=True
    )
    write_synthetic_checkpoint(tmp_path / "act-order", spec)
    job = plan_job(
        "act-order",
        "refused/deep/out",
        root=DataRoot.at(tmp_path),
        platform=preset("a100"),
        backend="MARLIN",
        ruleset="vllm-0.33",
    )
    with pytest.raises(ConversionUnsupported, match="act-order"):
        convert(job)
    assert not (tmp_path / "refused").exists()
    # under a release that converts act-order the same job writes the sorted form
    kept = replace(job, target=replace(job.target, ruleset="vllm-0.29"))
    summary, _ = convert(kept)
    assert summary.layers_converted == 2


def test_a_refusal_keeps_a_directory_that_holds_a_unit(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / JOURNAL_DIR).mkdir(parents=True)
    for name in ("job.json", "source-model.safetensors.json", ".job.json.tmp-1-ab"):
        (out / JOURNAL_DIR / name).write_text("{}")
    (out / "moe-layer-00000.safetensors").write_bytes(b"x")
    assert not remove_if_bare(out, out)
    assert (out / "moe-layer-00000.safetensors").exists()
    (out / "moe-layer-00000.safetensors").unlink()
    (out / JOURNAL_DIR / "moe-layer-00000.json").write_text("{}")
    assert not remove_if_bare(out, out)
    (out / JOURNAL_DIR / "moe-layer-00000.json").unlink()
    assert remove_if_bare(out, out)
    assert not out.exists()


@pytest.mark.parametrize("out", ["mixtral-gptq", "mixtral-gptq/converted", "mixtral-gptq/a/b"])
def test_an_output_inside_the_input_is_refused(checkpoint: tuple[Path, Any], out: str) -> None:
    root, _ = checkpoint
    before = sorted(p.name for p in (root / "mixtral-gptq").iterdir())
    with pytest.raises(ConvertInputError, match="inside the input directory") as info:
        job_for(root, out)
    assert info.value.field == "checkpoint.output_dir"
    assert sorted(p.name for p in (root / "mixtral-gptq").iterdir()) == before


def test_symlinked_shard_outside_the_root_is_refused(
    checkpoint: tuple[Path, Any], tmp_path: Path
) -> None:
    root, _ = checkpoint
    evil = root / "evil"
    evil.mkdir()
    source = root / "mixtral-gptq"
    for item in source.iterdir():
        (evil / item.name).symlink_to(item)
    outside = tmp_path / "secret.safetensors"
    outside.write_bytes((source / "model-00002-of-00002.safetensors").read_bytes())
    os.unlink(evil / "model-00002-of-00002.safetensors")
    (evil / "model-00002-of-00002.safetensors").symlink_to(outside)
    job = plan_job(
        "evil", "out-evil", root=DataRoot.at(root), platform=preset("a100"), backend="TRITON"
    )
    with pytest.raises(PermissionDeniedError, match="symbolic link"):
        convert(job)


@pytest.mark.parametrize(
    ("family", "layout", "symmetric"),
    [
        ("qwen3_moe", "awq", False),
        ("deepseek_v3", "compressed-tensors", True),
        ("qwen2_moe", "gptq", True),
    ],
)
def test_other_families_and_layouts(
    tmp_path: Path, family: str, layout: str, symmetric: bool
) -> None:
    spec = SyntheticSpec(
        family=family,
        layout=layout,
        symmetric=symmetric,
        num_layers=2,
        num_experts=4,
        hidden_size=128,
        intermediate_size=128,
        shards=1,
    )
    layers = write_synthetic_checkpoint(tmp_path / "model", spec)
    job = plan_job(
        "model", "out", root=DataRoot.at(tmp_path), platform=preset("a100"), backend="TRITON"
    )
    assert job.source.layout == layout and job.source.symmetric == symmetric
    result = convert_checkpoint(job)
    assert result.layers_converted == 2 and result.manifest_path is not None
    for index, layer in layers.items():
        written = load_file(tmp_path / "out" / f"moe-layer-{index:05d}.safetensors")
        for name, tensor in registry.convert(layer, "TRITON", source=layout).tensors.items():
            assert torch.equal(written[f"model.layers.{index}.mlp.experts.{name}"], tensor)
