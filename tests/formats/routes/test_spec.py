"""What a conversion reads: the source layout a checkpoint's `quantization_config` names.

AMD Quark's int4 exports read by their export's pack method; the reader's canonical layer is
then what any writer takes (the exactness suite checks the TRITON bytes against vLLM's own
Quark loader and conversion).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from service.formats.errors import ConvertInputError
from service.formats.readers import LAYOUTS, SourceQuantization, write_checkpoint
from service.formats.registry import convert, read_layer
from service.formats.routes.spec import source_spec
from service.formats.synthetic.quantize import random_layer


def _quark(pack_method: str | None = "reorder", **weight: Any) -> dict[str, Any]:
    scheme = {"dtype": "int4", "qscheme": "per_group", "group_size": 64, "symmetric": True}
    export = {"kv_cache_group": []} | ({} if pack_method is None else {"pack_method": pack_method})
    return {
        "quant_method": "quark",
        "export": export,
        "global_quant_config": {"weight": {**scheme, **weight}, "input_tensors": None},
        "layer_quant_config": {},
        "layer_type_quant_config": {},
        "exclude": [],
    }


@pytest.mark.parametrize(
    ("pack_method", "layout"), [("reorder", "quark"), ("order", "quark-order")]
)
def test_quark_exports_read_by_their_pack_method(pack_method: str, layout: str) -> None:
    spec = source_spec(_quark(pack_method))
    assert (spec.layout, spec.bits, spec.group_size, spec.symmetric) == (layout, 4, 64, True)
    asym = source_spec(_quark(pack_method, dtype="uint4", symmetric=False))
    assert not asym.symmetric
    # vLLM's stacked parameters of either export are its loader's N-first bytes.
    assert source_spec(_quark(pack_method), stacked=True).layout == "quark-loaded"


def test_quark_experts_only_export_reads_the_experts_pattern() -> None:
    config = _quark()
    config["global_quant_config"] = {"weight": None}
    config["layer_quant_config"] = {
        "*mlp.experts*": {"weight": {"dtype": "uint4", "group_size": 32, "symmetric": False}}
    }
    spec = source_spec(config)
    assert (spec.group_size, spec.symmetric) == (32, False)


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (_quark(pack_method=None), "export.pack_method"),
        (_quark(dtype="fp8_e4m3"), "global_quant_config.weight.dtype"),
        (_quark(group_size=None), "global_quant_config.weight.group_size"),
    ],
)
def test_quark_configs_that_do_not_convert_name_the_field(config: Any, field: str) -> None:
    with pytest.raises(ConvertInputError) as raised:
        source_spec(config)
    assert raised.value.field == f"hf_quantization_config.{field}"


@pytest.mark.parametrize("layout", ["quark", "quark-order"])
def test_a_quark_checkpoint_converts_like_its_canonical_layer(layout: str) -> None:
    layer = random_layer(
        2, 128, 64, bits=4, group_size=32, symmetric=False, generator=torch.Generator()
    )
    quant = SourceQuantization(4, 32, symmetric=False)
    tensors = write_checkpoint(LAYOUTS[layout], layer, quant)
    assert tensors["0.gate_proj.weight"].dtype == torch.int32
    assert tensors["0.gate_proj.weight"].shape == (128, 64 // 8)  # [K, N/8]
    read = read_layer(layout, tensors, quant, num_experts=2)
    ours = convert(read, "TRITON", source=layout).tensors
    reference = convert(layer, "TRITON", source=layout).tensors
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(ours[name], tensor), name
