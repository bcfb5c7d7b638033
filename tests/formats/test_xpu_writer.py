"""The XPU writer against the layouts it is stated in (no vLLM needed).

The references are other modules' statements of the same layouts: TRITON's tensors (the
N-first, K-packed int4 bytes the XPU kernel reads) and AutoAWQ's stacked parameters as the
readers' layout module writes them (`write_stacked`). The per-release bytes themselves are
held to each release's record by `test_conversion_records.py`.
"""

from __future__ import annotations

import pytest
import torch

from service.formats.canonical import QuantizedMoELayer
from service.formats.errors import ConversionUnsupported
from service.formats.readers import LAYOUTS, SourceQuantization, write_stacked
from service.formats.registry import convert
from service.formats.synthetic.quantize import random_layer
from service.formats.writers import ConversionOptions

E, H, INTER = 2, 256, 128
OLD, NEW = "vllm-0.30", "vllm-0.31"


def _layer(bits: int = 4, sym: bool = True, act: bool = False) -> QuantizedMoELayer:
    return random_layer(
        E,
        H,
        INTER,
        bits=bits,
        group_size=64,
        symmetric=sym,
        generator=torch.Generator().manual_seed(7),
        act_order=act,
        bias=True,
    )


def _xpu(layer: QuantizedMoELayer, source: str, ruleset: str, **kw: str) -> dict[str, torch.Tensor]:
    options = ConversionOptions(ruleset=ruleset, **kw)  # type: ignore[arg-type]
    return convert(layer, "XPU", source=source, options=options).tensors


@pytest.mark.parametrize("source", ["gptq", "compressed-tensors"])
@pytest.mark.parametrize("ruleset", [OLD, NEW])
def test_gptq_and_compressed_tensors_are_the_kernels_layout_in_every_release(
    source: str, ruleset: str
) -> None:
    layer = _layer()
    triton = convert(layer, "TRITON", source=source).tensors
    out = _xpu(layer, source, ruleset)
    assert list(out) == [
        "w13_qweight",
        "w2_qweight",
        "w13_scales",
        "w2_scales",
        "w13_bias",
        "w2_bias",
    ]
    for name, tensor in out.items():
        assert torch.equal(tensor, triton[name]), name


def test_moe_wna16_is_transposed_up_to_0_30() -> None:
    layer = _layer()
    triton = convert(layer, "TRITON", source="gptq").tensors
    new = _xpu(layer, "gptq", NEW, integration="moe_wna16")
    old = _xpu(layer, "gptq", OLD, integration="moe_wna16")
    for name in ("w13_qweight", "w2_qweight", "w13_scales", "w2_scales"):
        assert torch.equal(new[name], triton[name]), name
        assert torch.equal(old[name], triton[name].transpose(1, 2)), name
    assert torch.equal(_xpu(layer, "moe_wna16", OLD)["w13_qweight"], old["w13_qweight"])


def test_awq_is_its_words_as_bytes_transposed_first_up_to_0_30() -> None:
    layer = _layer()
    stacked = write_stacked(LAYOUTS["awq"], layer, SourceQuantization(4, 64, True))
    new, old = _xpu(layer, "awq", NEW), _xpu(layer, "awq", OLD)
    for name in ("w13", "w2"):
        words, scales = stacked[f"{name}_qweight"], stacked[f"{name}_scales"]
        assert words.dtype == torch.int32
        assert torch.equal(new[f"{name}_qweight"], words.view(torch.uint8))
        assert torch.equal(new[f"{name}_scales"], scales)
        flipped = words.transpose(1, 2).contiguous().view(torch.uint8)
        assert torch.equal(old[f"{name}_qweight"], flipped)
        assert torch.equal(old[f"{name}_scales"], scales.transpose(1, 2))


@pytest.mark.parametrize(
    ("layer", "match"),
    [
        (_layer(sym=False), "symmetric int4"),
        (_layer(bits=8), "symmetric int4"),
        (_layer(act=True), "act-order"),
    ],
    ids=["zero-points", "int8", "act-order"],
)
def test_refuses_what_the_xpu_experts_cannot_take(layer: QuantizedMoELayer, match: str) -> None:
    with pytest.raises(ConversionUnsupported, match=match):
        _xpu(layer, "gptq", NEW)


def test_descriptor_names_the_backend_and_dtypes() -> None:
    layer = _layer()
    descriptor = convert(layer, "XPU", source="gptq").descriptor
    assert descriptor.backend == "XPU"
    assert descriptor.weight_type == "uint4b8"
    assert descriptor.dtypes["w13_qweight"] == "uint8"
