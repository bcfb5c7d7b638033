"""TRITON and EMULATION writers and the registry, against the canonical form.

Here the reference is our canonical dequantization and an independent element-wise decode of
the kernel layout written from its contract (fact sheet section 9); `test_exactness.py`
compares the same writers bit for bit with vLLM 0.33.0.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from service.formats.canonical import QuantizedExperts, QuantizedMoELayer
from service.formats.errors import ConversionUnsupported, FormatError
from service.formats.readers import SourceQuantization
from service.formats.registry import (
    ALL_BACKENDS,
    TARGET_BACKENDS,
    UNSUPPORTED_BACKENDS,
    ConversionOptions,
    convert,
    read_stacked_layer,
    writer_for,
)
from service.formats.synthetic.quantize import random_layer


def _layer(
    bits: int, group: int, sym: bool, *, act: bool = False, bias: bool = False, seed: int = 0
) -> QuantizedMoELayer:
    return random_layer(
        2,
        128,
        64,
        bits=bits,
        group_size=group,
        symmetric=sym,
        generator=torch.Generator().manual_seed(seed),
        act_order=act,
        bias=bias,
    )


def _triton_dequant(
    weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int
) -> torch.Tensor:
    """Decode the Triton WNA16 layout element by element, as the kernel does (section 9)."""
    n, packed_k = weight.shape[1:]
    k = packed_k * 8 // bits
    kk = torch.arange(k)
    nn = torch.arange(n)
    q = weight
    if bits == 4:
        q = (weight[:, :, kk // 2] >> (4 * (kk % 2)).to(torch.uint8)) & 0xF
    group_size = k // scales.shape[2]
    s = scales[:, :, kk // group_size].float()
    if zeros is None:
        z = torch.full_like(s, 1 << (bits - 1))
    elif bits == 4:
        z = (zeros[:, nn // 2, :] >> (4 * (nn % 2)).to(torch.uint8).view(1, n, 1)) & 0xF
        z = z[:, :, kk // group_size].float()
    else:
        z = zeros[:, :, kk // group_size].float()
    return (q.float() - z) * s


CASES = list(itertools.product((4, 8), (32, 64, -1), (True, False)))


@pytest.mark.parametrize(("bits", "group", "sym"), CASES)
def test_triton_layout_decodes_to_the_canonical_weights(bits: int, group: int, sym: bool) -> None:
    layer = _layer(bits, group, sym, bias=True)
    out = convert(layer, "TRITON", source="gptq")
    t = out.tensors
    p8 = 8 // bits
    assert t["w13_qweight"].dtype == torch.uint8
    assert t["w13_qweight"].shape == (2, 128, 128 // p8)
    assert t["w2_qweight"].shape == (2, 128, 64 // p8)
    assert ("w13_qzeros" in t) == (not sym)
    if not sym:
        assert t["w13_qzeros"].shape == (2, 128 // p8, layer.w13.num_groups)
    for name, experts in (("w13", layer.w13), ("w2", layer.w2)):
        got = _triton_dequant(
            t[f"{name}_qweight"], t[f"{name}_scales"], t.get(f"{name}_qzeros"), bits
        )
        assert torch.equal(got, experts.dequantize())
    assert torch.equal(t["w13_bias"], layer.w13.bias)
    d = out.descriptor
    assert (d.backend, d.bits, d.group_size, d.has_zero_points) == ("TRITON", bits, group, not sym)
    assert d.weight_type == (f"uint{bits}b{1 << (bits - 1)}" if sym else f"uint{bits}")
    assert list(d.dtypes) == list(t)


def test_triton_refuses_act_order() -> None:
    with pytest.raises(ConversionUnsupported) as caught:
        convert(_layer(4, 32, True, act=True), "TRITON", source="gptq")
    assert caught.value.backend == "TRITON" and "g_idx" in caught.value.reason


@pytest.mark.parametrize(("bits", "group", "sym"), CASES)
def test_emulation_is_the_canonical_dequantization(bits: int, group: int, sym: bool) -> None:
    layer = _layer(bits, group, sym, act=True, bias=True)
    out = convert(layer, "EMULATION", source="gptq")
    assert list(out.tensors) == ["w13_weight", "w2_weight", "w13_bias", "w2_bias"]
    assert out.tensors["w13_weight"].dtype == torch.bfloat16
    assert torch.equal(out.tensors["w13_weight"], layer.w13.dequantize(torch.bfloat16))
    assert torch.equal(out.tensors["w2_weight"], layer.w2.dequantize(torch.bfloat16))
    assert out.descriptor.weight_type == "bfloat16"
    half = convert(
        layer, "EMULATION", source="gptq", options=ConversionOptions(dense_dtype=torch.float16)
    )
    assert half.tensors["w2_weight"].dtype == torch.float16


def test_registry_covers_every_vllm_backend_once() -> None:
    assert set(TARGET_BACKENDS) | set(UNSUPPORTED_BACKENDS) >= set(ALL_BACKENDS) - {
        "MARLIN",
        "BATCHED_MARLIN",
    }
    for backend in ALL_BACKENDS:
        if backend in TARGET_BACKENDS:
            assert callable(writer_for(backend))
            continue
        with pytest.raises(ConversionUnsupported) as caught:
            writer_for(backend)
        assert caught.value.reason == UNSUPPORTED_BACKENDS[backend]
    with pytest.raises(ConversionUnsupported) as caught:
        writer_for("TRITON2")
    assert "not a vLLM WNA16 MoE backend" in caught.value.reason


def test_convert_checks_source_and_uniformity() -> None:
    layer = _layer(4, 32, True)
    with pytest.raises(FormatError) as caught:
        convert(layer, "TRITON", source="exl2")
    assert caught.value.field == "layout"
    asym = _layer(4, 32, False)
    mixed = QuantizedMoELayer(w13=layer.w13, w2=asym.w2)
    with pytest.raises(FormatError) as caught:
        convert(mixed, "TRITON", source="gptq")
    assert caught.value.field == "w2.zeros"
    regrouped = QuantizedMoELayer(
        w13=layer.w13,
        w2=QuantizedExperts(
            codes=layer.w2.codes,
            scales=layer.w2.scales[:, :, :1].contiguous(),
            bits=4,
            group_size=-1,
        ),
    )
    with pytest.raises(FormatError):
        convert(regrouped, "EMULATION", source="gptq")


@pytest.mark.parametrize(("bits", "group", "sym"), CASES)
def test_triton_output_is_the_moe_wna16_layout_and_reads_back(
    bits: int, group: int, sym: bool
) -> None:
    """TRITON writes vLLM's MoeWNA16 parameter layout; reading it back gives the layer."""
    layer = _layer(bits, group, sym, bias=True)
    out = convert(layer, "TRITON", source="awq").tensors
    back = read_stacked_layer("moe_wna16", out, SourceQuantization(bits, group, sym))
    for name in ("w13", "w2"):
        a, b = getattr(layer, name), getattr(back, name)
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
        assert torch.equal(a.dequantize(), b.dequantize())
        assert b.bias is not None and a.bias is not None and torch.equal(a.bias, b.bias)
