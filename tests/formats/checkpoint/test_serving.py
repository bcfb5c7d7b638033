"""The converted directory's config.json: the quantization config vLLM serves it by."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from service.formats.checkpoint.job import convert_checkpoint
from service.formats.checkpoint.plan import MANIFEST_NAME, plan_job
from service.formats.checkpoint.serving import CONVERSION_SLOTS, QUANT_METHOD, slot_of
from service.formats.io.paths import DataRoot
from service.formats.synthetic.checkpoints import SyntheticSpec, write_synthetic_checkpoint
from service.oracle import DEFAULT_RULESET, preset

SPEC = SyntheticSpec(layout="compressed-tensors", symmetric=False, num_layers=2, num_experts=2)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("root")
    write_synthetic_checkpoint(root / "src", SPEC)
    return root


def _convert(root: Path, backend: str) -> dict[str, Any]:
    out = f"out-{backend}"
    job = plan_job("src", out, root=DataRoot.at(root), platform=preset("h100"), backend=backend)
    convert_checkpoint(job)
    return dict(json.loads((root / out / "config.json").read_text()))


def test_config_names_the_conversion_and_keeps_the_rest(root: Path) -> None:
    config = _convert(root, "TRITON")
    source = json.loads((root / "src" / "config.json").read_text())
    quant = config.pop("quantization_config")
    assert config == {k: v for k, v in source.items() if k != "quantization_config"}
    assert quant["quant_method"] == QUANT_METHOD
    assert (quant["backend"], quant["ruleset"]) == ("TRITON", DEFAULT_RULESET)
    assert quant["source_quantization_config"] == source["quantization_config"]
    assert quant["source"]["layout"] == "compressed-tensors"
    names = ("w13_qweight", "w2_qweight", "w13_scales", "w2_scales", "w13_qzeros", "w2_qzeros")
    assert quant["tensors"] == {name: name for name in names}
    manifest = root / "out-TRITON" / MANIFEST_NAME
    assert quant["manifest"] == {
        "path": MANIFEST_NAME,
        "sha256": hashlib.sha256(manifest.read_bytes()).hexdigest(),
        "bytes": manifest.stat().st_size,
    }


def test_every_tensor_gets_its_slot_per_backend(root: Path) -> None:
    quant = _convert(root, "EMULATION")["quantization_config"]
    assert quant["tensors"] == {"w13_weight": "w13_qweight", "w2_weight": "w2_qweight"}
    assert set(quant["tensors"].values()) <= set(CONVERSION_SLOTS)


def test_a_layout_vllm_converts_in_place_has_no_slots() -> None:
    assert slot_of("HUMMING", "w13_weight") is None
    assert slot_of("MARLIN", "w13_g_idx") is None
    assert slot_of("MARLIN", "w13_input_global_scale") == "w13_input_global_scale"
