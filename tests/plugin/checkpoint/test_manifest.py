"""The plugin's reader of converted checkpoints agrees with the format moe-control writes.

The plugin runs in vLLM's environment and reads config.json's ``quantization_config`` and
the manifest with its own reader (`plugin/moe_control_vllm/checkpoint/manifest.py`, plain
JSON, no torch). The format is declared once, on moe-control's side
(`service/formats/checkpoint/serving.py`, `plan.py`): these tests check that the reader's
names are those, and that it reads what a real conversion writes and refuses what it must.
The slot tables (`slots.py`, vLLM knowledge) are checked against what the converter writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from moe_control_vllm.checkpoint import manifest as reader
from moe_control_vllm.checkpoint import slots

from service.formats.checkpoint import plan, serving
from service.formats.checkpoint.job import convert_checkpoint
from service.formats.io.paths import DataRoot
from service.formats.synthetic.checkpoints import SyntheticSpec, write_synthetic_checkpoint
from service.oracle import preset


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("root")
    spec = SyntheticSpec(layout="awq", symmetric=False, num_layers=2, num_experts=2, shards=2)
    write_synthetic_checkpoint(root / "src", spec)
    job = plan.plan_job(
        "src", "out", root=DataRoot.at(root), platform=preset("h100"), backend="EMULATION"
    )
    convert_checkpoint(job)
    return root / "out"


def _quantization_config(directory: Path) -> dict[str, Any]:
    return dict(json.loads((directory / "config.json").read_text())["quantization_config"])


def test_the_reader_names_what_moe_control_declares() -> None:
    assert reader.QUANT_METHOD == serving.QUANT_METHOD
    assert (reader.FORMAT, reader.FORMAT_VERSION) == (plan.FORMAT, plan.FORMAT_VERSION)
    assert reader.CONVERSION_SLOTS == serving.CONVERSION_SLOTS


def test_reads_a_converted_directory(converted: Path) -> None:
    config = reader.ServingConfig.from_quantization_config(_quantization_config(converted))
    assert (config.backend, config.source_method) == ("EMULATION", "awq")
    manifest = reader.Manifest.load(converted, config)
    modules = [f"model.layers.{i}.block_sparse_moe.experts" for i in (0, 1)]
    assert sorted(manifest.layers) == modules
    layer = manifest.layer_for(modules[1])
    assert {n: t.slot for n, t in layer.tensors.items()} == {
        "w13_weight": "w13_qweight",
        "w2_weight": "w2_qweight",
    }
    w13 = layer.tensors["w13_weight"]
    assert (w13.dtype, w13.shape, len(w13.sha256)) == ("BF16", (2, 512, 128), 64)
    # A vLLM module name that differs from the checkpoint's finds its layer by index.
    assert manifest.layer_for("language_model.model.layers.1.mlp.experts") is layer
    with pytest.raises(reader.ConvertedCheckpointError, match="no converted MoE layer"):
        manifest.layer_for("model.layers.7.block_sparse_moe.experts")


def test_refuses_another_format_or_an_unknown_slot(converted: Path) -> None:
    good = _quantization_config(converted)
    with pytest.raises(reader.ConvertedCheckpointError, match="version 2"):
        reader.ServingConfig.from_quantization_config({**good, "format_version": 2})
    with pytest.raises(reader.ConvertedCheckpointError, match="unknown slot"):
        reader.ServingConfig.from_quantization_config({**good, "tensors": {"w13_weight": "w9"}})
    with pytest.raises(reader.ConvertedCheckpointError, match="source_quantization_config"):
        reader.ServingConfig.from_quantization_config({**good, "source_quantization_config": 1})


def test_refuses_a_tensor_without_a_slot(converted: Path) -> None:
    """HUMMING's layout has no slots (vLLM converts it in place): the reader names it."""
    quant = _quantization_config(converted)
    quant["tensors"] = {**quant["tensors"], "w2_weight": None}
    config = reader.ServingConfig.from_quantization_config(quant)
    with pytest.raises(reader.ConvertedCheckpointError, match=r"experts\.w2_weight: no vLLM"):
        reader.Manifest.load(converted, config)


def test_refuses_a_changed_manifest(converted: Path, tmp_path: Path) -> None:
    quant = _quantization_config(converted)
    config = reader.ServingConfig.from_quantization_config(
        {**quant, "manifest": {**quant["manifest"], "sha256": "0" * 64}}
    )
    with pytest.raises(reader.ConvertedCheckpointError, match="changed after the conversion"):
        reader.Manifest.load(converted, config)
    missing = reader.ServingConfig.from_quantization_config(quant)
    with pytest.raises(reader.ConvertedCheckpointError, match="cannot read the manifest"):
        reader.Manifest.load(tmp_path, missing)


def test_the_slot_tables_cover_what_the_converter_writes() -> None:
    for method, names in slots.PARAMETERS.items():
        assert set(names) == set(serving.CONVERSION_SLOTS), method
    # Every backend the plugin serves gets its tensors' slots from the converter.
    assert set(slots.FORCED_BACKEND) <= set(serving.SLOT_RENAMES)
    assert set(slots.PLACEHOLDERS) <= set(slots.FORCED_BACKEND)
    assert set(slots.ALIASES.values()) <= set(serving.CONVERSION_SLOTS)
