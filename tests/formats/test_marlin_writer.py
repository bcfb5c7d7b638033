"""MARLIN / BATCHED_MARLIN writers against the canonical form (no vLLM needed).

The reference here is an element-wise decode of the Marlin weight layout written from the
repack kernel's lane arithmetic (which int32 word and nibble holds code (n, k)), independent
of the whole-tensor permutations the writer uses, plus exact round trips through
`unpack_marlin`. `test_marlin_parity.py` compares the same writers bit for bit with vLLM.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from service.formats.canonical import QuantizedMoELayer
from service.formats.errors import ConversionUnsupported, FormatError
from service.formats.synthetic.quantize import random_layer
from service.formats.writers import ConversionOptions
from service.formats.writers import marlin_layout as layout
from service.formats.writers.marlin import (
    marlin_tensors,
    padded_intermediate,
    unpack_marlin,
    write_batched_marlin,
    write_marlin,
)

E, H = 2, 256


def _layer(
    bits: int = 4,
    group: int = 128,
    sym: bool = True,
    *,
    inter: int = 128,
    hidden: int = H,
    gated: bool = True,
    act: bool = False,
    bias: bool = False,
    seed: int = 0,
    scale_dtype: torch.dtype = torch.float16,
) -> QuantizedMoELayer:
    return random_layer(
        E,
        hidden,
        inter,
        bits=bits,
        group_size=group,
        symmetric=sym,
        generator=torch.Generator().manual_seed(seed),
        gated=gated,
        act_order=act,
        bias=bias,
        scale_dtype=scale_dtype,
    )


def _present(tensors: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    return {name: t for name, t in tensors.items() if t is not None}


# (bits, 8-bit activations) -> (k digits, n digits) as (name, extent) and how a code's word
# and nibble follow from them, read from gptq_marlin_repack_kernel: lane (r, q) of warp j
# writes word (r*4 + q)*4 + j of its 16x64 tile (8-bit codes: two words, c = 0 / 1), packing
# the values of rows {2q, 2q+1, 2q+8, 2q+9} (a, b) in columns r and r+8 (c).
def _decode_reference(qweight: torch.Tensor, bits: int, a8: bool, n: int, k: int) -> torch.Tensor:
    """uint8 [E, N, K] codes read element by element from a Marlin int32 weight."""
    nn = torch.arange(n).view(n, 1)
    kk = torch.arange(k).view(1, k)
    if not a8:
        tile_k, tile_n = 16, 64
        a, q, b = (kk % 16) // 8, (kk % 8) // 2, kk % 2
        j, c, r = (nn % 64) // 16, (nn % 16) // 8, nn % 8
        if bits == 4:
            word = (r * 4 + q) * 4 + j
            slot = b * 4 + c * 2 + a
        else:
            word = ((r * 4 + q) * 4 + j) * 2 + c
            slot = b * 2 + a
    else:
        tile_k, tile_n = 32, 32
        a, q, b = (kk % 32) // 16, (kk % 16) // 4, kk % 4
        j, c, r = (nn % 32) // 16, (nn % 16) // 8, nn % 8
        if bits == 4:
            word = (r * 4 + q) * 4 + j * 2 + c
            slot = b * 2 + a
        else:
            word = (((r * 4 + q) * 2 + j) * 2 + c) * 2 + a
            slot = b
    words_per_tile = tile_k * tile_n * bits // 32
    flat_tile = (kk // tile_k) * (n // tile_n) + nn // tile_n
    flat = (flat_tile * words_per_tile + word).expand(n, k)
    rows = qweight.reshape(qweight.shape[0], -1).to(torch.int64) & 0xFFFFFFFF
    values = rows[:, flat.reshape(-1)].view(-1, n, k)
    shift = (slot * bits).expand(n, k)
    return ((values >> shift) & ((1 << bits) - 1)).to(torch.uint8)


@pytest.mark.parametrize(("bits", "a8"), list(itertools.product((4, 8), (False, True))))
def test_repack_puts_each_code_where_the_kernel_reads_it(bits: int, a8: bool) -> None:
    generator = torch.Generator().manual_seed(bits + a8)
    codes = torch.randint(0, 1 << bits, (E, 192, 96), dtype=torch.uint8, generator=generator)
    qweight = layout.repack_weights(codes, bits, a8)
    assert qweight.dtype == torch.int32
    assert tuple(qweight.shape) == (E, 96 // 16, 192 * 16 * bits // 32)
    assert torch.equal(_decode_reference(qweight, bits, a8, 192, 96), codes)
    assert torch.equal(layout.unpack_weights(qweight, bits, 192, 96, a8), codes)


def test_repack_refuses_shapes_that_do_not_tile() -> None:
    with pytest.raises(ValueError, match="N % 64"):
        layout.repack_weights(torch.zeros(1, 96, 64, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="K % 32"):
        layout.repack_weights(torch.zeros(1, 64, 48, dtype=torch.uint8), 4, a8=True)


def test_small_permutations_invert() -> None:
    generator = torch.Generator().manual_seed(1)
    scales = torch.rand(E, 3, 128, generator=generator).half()
    for grouped in (True, False):
        permuted = layout.permute_scales(scales, grouped)
        assert not torch.equal(permuted, scales)
        assert torch.equal(layout.unpermute_scales(permuted, grouped), scales)
    bias = torch.rand(E, 128, generator=generator)
    assert torch.equal(layout.unpermute_bias(layout.permute_bias(bias)), bias)
    for bits, a8 in itertools.product((4, 8), (False, True)):
        zeros = torch.randint(0, 1 << bits, (E, 3, 128), dtype=torch.uint8, generator=generator)
        words = layout.pack_zero_points(zeros, bits, a8)
        assert tuple(words.shape) == (E, 3, 128 * bits // 32)
        assert torch.equal(layout.unpack_zero_points(words, bits, a8), zeros)


def test_grouped_scale_order_is_the_8x8_transpose() -> None:
    # Channels 0..63 in one group: Marlin wants each lane's eight columns (i, i+8, ...) together.
    scales = torch.arange(64, dtype=torch.float32).view(1, 1, 64)
    permuted = layout.permute_scales(scales, grouped=True).view(8, 8)
    assert permuted[0].tolist() == [0, 8, 16, 24, 32, 40, 48, 56]
    single = layout.permute_scales(scales, grouped=False).view(-1)
    assert single[:8].tolist() == [0, 1, 8, 9, 16, 17, 24, 25]


ROUND_TRIP = [  # (bits, group, sym, inter, gated, bias)
    (bits, group, sym, inter, gated, bias)
    for bits, group, sym in itertools.product((4, 8), (32, 64, 128, -1), (True, False))
    for inter, gated, bias in ((128, True, True), (96 if group in (32, -1) else 128, False, False))
]


@pytest.mark.parametrize("config", ROUND_TRIP, ids=str)
def test_round_trip_is_exact(config: tuple[int, int, bool, int, bool, bool]) -> None:
    bits, group, sym, inter, gated, bias = config
    layer = _layer(bits, group, sym, inter=inter, gated=gated, bias=bias)
    tensors = _present(marlin_tensors(layer))
    back = unpack_marlin(tensors, bits=bits, group_size=group, intermediate_size=inter)
    assert _same(back, layer)
    assert torch.equal(back.w13.dequantize(), layer.w13.dequantize())
    assert torch.equal(back.w2.dequantize(), layer.w2.dequantize())


def _same(a: QuantizedMoELayer, b: QuantizedMoELayer) -> bool:
    for name in ("w13", "w2"):
        x, y = getattr(a, name), getattr(b, name)
        for part in ("codes", "scales", "zeros", "g_idx", "bias"):
            p, q = getattr(x, part), getattr(y, part)
            assert (p is None) == (q is None), f"{name}.{part}"
            if p is not None:
                assert p.dtype == q.dtype and torch.equal(p, q), f"{name}.{part}"
        assert (x.bits, x.group_size) == (y.bits, y.group_size)
    return True


def test_padding_is_zero_where_vllm_pads() -> None:
    layer = _layer(4, 32, False, inter=96, bias=True)
    padded = padded_intermediate(96, 32)
    assert padded == 128
    out = _present(marlin_tensors(layer))
    assert tuple(out["w13_qweight"].shape) == (E, H // 16, 2 * padded * 16 * 4 // 32)
    assert tuple(out["w2_qweight"].shape) == (E, padded // 16, H * 16 * 4 // 32)
    assert tuple(out["w2_scales"].shape) == (E, padded // 32, H)
    codes13 = layout.unpack_weights(out["w13_qweight"], 4, 2 * padded, H).view(E, 2, padded, H)
    assert not codes13[:, :, 96:].any()
    scales13 = layout.unpermute_scales(out["w13_scales"], grouped=True).view(E, -1, 2, padded)
    assert not scales13[..., 96:].any()
    bias13 = layout.unpermute_bias(out["w13_bias"]).view(E, 2, padded)
    assert not bias13[..., 96:].any()
    zeros13 = layout.unpack_zero_points(out["w13_qzeros"], 4).view(E, -1, 2, padded)
    assert not zeros13[..., 96:].any()
    codes2 = layout.unpack_weights(out["w2_qweight"], 4, H, padded)
    assert not codes2[:, :, 96:].any()
    assert padded_intermediate(80, -1) == 128 and padded_intermediate(128, 128) == 128


def test_channelwise_scales_use_the_single_order() -> None:
    layer = _layer(4, -1, True)
    out = _present(marlin_tensors(layer))
    expected = layout.permute_scales(layer.w13.scales.transpose(1, 2), grouped=False)
    assert torch.equal(out["w13_scales"], expected)


def test_act_order_is_refused_by_default_and_sorted_on_request() -> None:
    layer = _layer(4, 32, True, act=True, bias=True)
    assert layer.w13.g_idx is not None
    with pytest.raises(ConversionUnsupported, match="act-order"):
        marlin_tensors(layer)
    out = _present(marlin_tensors(layer, act_order=True))
    for name in ("w13", "w2"):
        g_idx, sort = out[f"{name}_g_idx"], out[f"{name}_g_idx_sort_indices"]
        assert g_idx.dtype == sort.dtype == torch.int32
        assert bool((g_idx[:, 1:] >= g_idx[:, :-1]).all())  # groups now contiguous
        assert torch.equal(torch.gather(getattr(layer, name).g_idx, 1, sort.long()), g_idx)
    back = unpack_marlin(out, bits=4, group_size=32, intermediate_size=128)
    assert _same(back, layer)
    options = ConversionOptions(extra={"act_order": "sort"})
    assert "w2_g_idx" in write_marlin(layer, source="gptq", options=options).tensors


def test_the_ruleset_decides_act_order() -> None:
    """A ruleset whose release accepts act-order gets its sorted form; a newer one refuses
    and names the rulesets that convert it; extra act_order overrides either way."""
    layer = _layer(4, 64, True, act=True)
    older = write_marlin(layer, source="gptq", options=ConversionOptions(ruleset="vllm-0.29"))
    requested = write_marlin(
        layer, source="gptq", options=ConversionOptions(extra={"act_order": "sort"})
    )
    assert set(older.tensors) == set(requested.tensors) >= {"w13_g_idx", "w2_g_idx_sort_indices"}
    for name, tensor in older.tensors.items():
        assert torch.equal(tensor, requested.tensors[name]), name
    with pytest.raises(ConversionUnsupported, match=r"vllm-0\.33's .*vllm-0\.27.*vllm-0\.29"):
        write_marlin(layer, source="gptq", options=ConversionOptions(ruleset="vllm-0.33"))
    refused = ConversionOptions(ruleset="vllm-0.28", extra={"act_order": "reject"})
    with pytest.raises(ConversionUnsupported, match="act-order"):
        write_marlin(layer, source="gptq", options=refused)


def test_the_sort_is_each_experts_argsort_and_covers_every_projection() -> None:
    """As the older releases sort: `torch.argsort` of each expert's g_idx, and a projection
    without act-order (one group here) sorted too."""
    layer = _layer(4, 128, True, act=True)  # w2's K is one group of 128
    assert layer.w13.g_idx is not None
    out = _present(marlin_tensors(layer, act_order=True))
    for expert in range(E):
        expected = torch.argsort(layer.w13.g_idx[expert].to(torch.int32)).to(torch.int32)
        assert torch.equal(out["w13_g_idx_sort_indices"][expert], expected)
    plain = torch.zeros(E, 128, dtype=torch.int32)
    assert torch.equal(out["w2_g_idx"], plain)
    assert torch.equal(out["w2_g_idx_sort_indices"], torch.stack([torch.argsort(p) for p in plain]))
    back = unpack_marlin(out, bits=4, group_size=128, intermediate_size=128)
    assert _same(back, dataclasses.replace(layer, w2=dataclasses.replace(layer.w2, g_idx=plain)))


def test_act_order_limits() -> None:
    layer = _layer(4, 32, True, act=True)
    assert layer.w2.g_idx is not None
    uneven = layer.w2.g_idx.clone()
    for expert in range(E):  # move one channel of group 1 into group 0: 33 and 31 members
        uneven[expert, int((uneven[expert] == 1).nonzero()[0])] = 0
    bad = dataclasses.replace(layer, w2=dataclasses.replace(layer.w2, g_idx=uneven))
    with pytest.raises(FormatError, match=r"w2\.g_idx"):
        marlin_tensors(bad, act_order=True)
    padded = _layer(4, 32, True, act=True, inter=96)
    with pytest.raises(ConversionUnsupported, match="padded"):
        marlin_tensors(padded, act_order=True)
    with pytest.raises(FormatError, match="act_order"):
        write_marlin(layer, source="gptq", options=ConversionOptions(extra={"act_order": "x"}))


def test_plain_g_idx_is_no_act_order() -> None:
    layer = _layer(4, 64, True)
    plain = (torch.arange(H) // 64).to(torch.int32).expand(E, H).contiguous()
    with_g_idx = dataclasses.replace(layer, w13=dataclasses.replace(layer.w13, g_idx=plain))
    out = marlin_tensors(with_g_idx)
    assert "w13_g_idx" not in out
    assert torch.equal(_present(out)["w13_qweight"], _present(marlin_tensors(layer))["w13_qweight"])


def test_int8_activations() -> None:
    layer = _layer(4, 64, False, inter=128)
    out = _present(marlin_tensors(layer, activation_dtype=torch.int8))
    for name in ("w13", "w2"):
        scale = out[f"{name}_input_global_scale"]
        assert scale.dtype == torch.float32 and scale.dim() == 0
        relative = out[f"{name}_scales"].view(torch.int16)
        assert int(relative.max()) == 4096 and int(relative.min()) >= 0
    back = unpack_marlin(
        out, bits=4, group_size=64, intermediate_size=128, activation_dtype=torch.int8
    )
    assert torch.equal(back.w13.codes, layer.w13.codes)
    assert torch.equal(back.w2.zeros, layer.w2.zeros)  # type: ignore[arg-type]
    error = (back.w13.scales.float() - layer.w13.scales.float()).abs().max()
    # vLLM divides in the 16-bit scale dtype (11 significant bits) before rounding to int16.
    assert float(error) <= float(layer.w13.scales.float().max()) / 512
    # Channelwise scales stay as they are (32-wide order), with no global scale.
    channelwise = _present(marlin_tensors(_layer(4, -1, True), activation_dtype=torch.int8))
    assert "w13_input_global_scale" not in channelwise
    with pytest.raises(FormatError, match="16-bit scales"):
        marlin_tensors(_layer(4, 64, True, scale_dtype=torch.float32), activation_dtype=torch.int8)


@pytest.mark.parametrize(
    ("group", "sym", "inter", "act"),
    [
        (128, True, 128, False),
        (32, False, 96, False),
        (-1, False, 128, False),
        (64, True, 128, True),
    ],
)
def test_fp8_activations_round_trip(group: int, sym: bool, inter: int, act: bool) -> None:
    layer = _layer(4, group, sym, inter=inter, act=act, bias=True)
    fp8 = torch.float8_e4m3fn
    out = _present(marlin_tensors(layer, activation_dtype=fp8, act_order=act))
    assert "w13_input_global_scale" not in out
    back = unpack_marlin(
        out, bits=4, group_size=group, intermediate_size=inter, activation_dtype=fp8
    )
    assert _same(back, layer)
    # Symmetric codes become q - 8 (q >= 8) or 15 - q: the 8-bit-activation layout of those.
    if sym and not act and inter == 128:
        codes = layer.w13.codes
        remapped = torch.where(codes >= 8, codes - 8, 15 - codes)
        assert torch.equal(out["w13_qweight"], layout.repack_weights(remapped, 4, a8=True))
        scales = layer.w13.scales * 512
        expected = layout.permute_scales(scales.transpose(1, 2), grouped=False)
        assert torch.equal(out["w13_scales"], expected)


def test_unsupported_targets_say_why() -> None:
    with pytest.raises(ConversionUnsupported, match="int4 weights only"):
        marlin_tensors(_layer(8, 64, True), activation_dtype=torch.float8_e4m3fn)
    with pytest.raises(ConversionUnsupported, match="no Marlin path"):
        marlin_tensors(_layer(), activation_dtype=torch.float32)
    with pytest.raises(ConversionUnsupported, match="hidden size 192"):
        marlin_tensors(_layer(4, 64, True, hidden=192))
    with pytest.raises(ConversionUnsupported, match="group size 16"):
        marlin_tensors(_layer(4, 16, True))


def test_writers_describe_their_output() -> None:
    layer = _layer(4, 128, False, bias=True)
    marlin = write_marlin(layer, source="compressed-tensors", options=ConversionOptions())
    batched = write_batched_marlin(layer, source="compressed-tensors", options=ConversionOptions())
    assert marlin.descriptor.backend == "MARLIN" and batched.descriptor.backend == "BATCHED_MARLIN"
    assert marlin.descriptor.weight_type == "uint4" and marlin.descriptor.has_zero_points
    assert list(marlin.tensors) == [
        "w13_qweight",
        "w2_qweight",
        "w13_scales",
        "w2_scales",
        "w13_qzeros",
        "w2_qzeros",
        "w13_bias",
        "w2_bias",
    ]
    assert marlin.descriptor.dtypes["w13_qweight"] == "int32"
    for name, tensor in marlin.tensors.items():
        assert torch.equal(tensor, batched.tensors[name])
    sym = write_marlin(_layer(8, 64, True), source="gptq", options=ConversionOptions())
    assert sym.descriptor.weight_type == "uint8b128" and "w13_qzeros" not in sym.tensors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("bits", "group", "sym"), [(4, 128, True), (4, 32, False), (8, -1, False)])
def test_gpu_output_equals_cpu_output(bits: int, group: int, sym: bool) -> None:
    layer = _layer(bits, group, sym, inter=96 if group in (32, -1) else 128, bias=True)
    cpu = _present(marlin_tensors(layer))
    on_gpu = QuantizedMoELayer(
        *(
            dataclasses.replace(
                e,
                codes=e.codes.cuda(),
                scales=e.scales.cuda(),
                zeros=None if e.zeros is None else e.zeros.cuda(),
                bias=None if e.bias is None else e.bias.cuda(),
            )
            for e in (layer.w13, layer.w2)
        )
    )
    gpu = _present(marlin_tensors(on_gpu))
    assert set(cpu) == set(gpu)
    for name, tensor in cpu.items():
        assert gpu[name].is_cuda and torch.equal(gpu[name].cpu(), tensor), name
    back = unpack_marlin(
        gpu, bits=bits, group_size=group, intermediate_size=layer.intermediate_size
    )
    assert torch.equal(back.w13.codes.cpu(), layer.w13.codes)
