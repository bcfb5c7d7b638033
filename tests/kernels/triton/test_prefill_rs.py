"""The register-operand prefill kernels against EMULATION, and their re-layout's index math.

Interpreted on CPU (integer and float32 dequantization: the bit-operation sequence is PTX),
compiled on a GPU (`pytest -m gpu`, scripts/gpu_test.sh), where both dequantizations run.
Fresh random weights, zero points and inputs per case; output and intermediate NaN-poisoned.
"""

from __future__ import annotations

import pytest
import torch

from service.formats.canonical import QuantizedMoELayer
from service.kernels.activation import resolve
from service.kernels.emulation import EmulationExperts
from service.kernels.errors import KernelUnavailableError
from service.kernels.interface import LayerSpec
from service.kernels.triton import prefill_rs
from service.kernels.triton import relayout as relayout_module
from service.kernels.triton.config import (
    PREFILL_RS,
    GemmTile,
    KernelConfig,
    choose_config_rs,
)
from service.kernels.triton.experts import TritonWNA16Experts
from service.kernels.triton.relayout import (
    CHUNK,
    WORD_CHUNK,
    WORDS,
    pack_words_int4,
    repair_int4,
    unpack_words_int4,
    unpair_int4,
)
from tests.kernels.helpers import (
    KERNEL_DEVICE,
    pack_triton,
    random_layer,
    random_routing,
    rel_err,
    triton_spec,
)

GPU = torch.cuda.is_available()
TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3}


def _check(
    layer: QuantizedMoELayer,
    m: int,
    top_k: int,
    dtype: torch.dtype,
    config: KernelConfig,
    *,
    activation: str = "silu",
    seed: int = 0,
    use_asm: bool = True,
    words: bool | None = None,
) -> float:
    gen = torch.Generator().manual_seed(seed)
    h = layer.hidden_size
    x = (torch.randn(m, h, generator=gen) * 2).to(dtype)
    ids, weights = random_routing(gen, m, layer.w13.num_experts, top_k)
    tensors = {name: t.to(KERNEL_DEVICE) for name, t in pack_triton(layer).items()}
    spec = triton_spec(layer)
    dev = KERNEL_DEVICE
    out = torch.full((m, h), float("nan"), dtype=dtype, device=dev)
    if use_asm and words is None:
        backend = TritonWNA16Experts(config, poison_workspace=True)
        backend.prepare(tensors, spec)
        got = backend.forward(x.to(dev), ids.to(dev), weights.to(dev), activation, out=out)
    else:
        got = prefill_rs.fused_moe_rs(
            x.to(dev), ids.to(dev), weights.to(dev), prefill_rs.relayout(tensors, spec, words),
            spec, resolve(activation), config, True, out, use_asm=use_asm,
        )  # fmt: skip
    assert got is out
    assert not got.isnan().any(), "an output element was left unwritten"
    reference = EmulationExperts()
    reference.prepare(layer, LayerSpec.from_canonical(layer))
    err = rel_err(got, reference.forward_fp32(x, ids, weights, activation))
    assert err < TOL[dtype], err
    return err


def _rs(bm: int, bn1: int, bk1: int, bn2: int, bk2: int, *, split: int = 1) -> KernelConfig:
    return KernelConfig(
        bm, GemmTile(bn1, bk1), GemmTile(bn2, bk2, split_k=split), kernel=PREFILL_RS
    )


@pytest.mark.parametrize(
    ("bits", "group", "zp", "dtype"),
    [
        (4, 32, False, torch.bfloat16),
        (4, 64, True, torch.float16),
        (4, 128, False, torch.bfloat16),
        (4, 128, True, torch.bfloat16),
        (4, 128, True, torch.float16),
        (4, -1, True, torch.bfloat16),
        (8, 32, True, torch.bfloat16),
        (8, 64, False, torch.float16),
        (8, 128, True, torch.bfloat16),
        (8, -1, False, torch.float16),
    ],
)
def test_quantization_variants(bits: int, group: int, zp: bool, dtype: torch.dtype) -> None:
    layer = random_layer(bits + group, 4, 256, 128, bits=bits, group_size=group, zero_points=zp)
    _check(layer, 7, 2, dtype, _rs(16, 64, 128, 64, 64, split=2), seed=group)


@pytest.mark.parametrize(
    "config",
    [
        _rs(16, 64, 64, 64, 128),  # K step below the layer's group
        _rs(32, 64, 256, 128, 64, split=3),  # K step over the group (clamped to it), split 3
        _rs(64, 128, 128, 64, 32, split=4),  # 64-token blocks, smallest K step, split 4
    ],
    ids=["bm16", "bm32_split3", "bm64_split4"],
)
def test_tiles(config: KernelConfig) -> None:
    layer = random_layer(3, 8, 256, 192, bits=4, group_size=64, zero_points=True)
    _check(layer, 40, 2, torch.bfloat16, config, seed=config.block_m)


@pytest.mark.parametrize(
    "config",
    [
        _rs(16, 64, 128, 64, 128, split=2),  # word layout, one chunk per step, split 2
        _rs(32, 128, 256, 64, 256),  # two chunks per step (channelwise group)
        _rs(64, 64, 128, 128, 128, split=3),
        KernelConfig(
            32,
            GemmTile(64, 128, scale_after=False),
            GemmTile(64, 128, scale_after=False),
            kernel=PREFILL_RS,
        ),  # the scale folded into the weights
    ],
    ids=["bm16_split2", "bm32_two_chunks", "bm64_split3", "folded_scale"],
)
def test_word_layout_tiles(config: KernelConfig) -> None:
    layer = random_layer(6, 8, 256, 384, bits=4, group_size=-1, zero_points=True)
    assert prefill_rs.word_layout(triton_spec(layer))
    _check(layer, 40, 2, torch.bfloat16, config, seed=config.block_m)


def test_byte_layout_where_words_also_fit() -> None:
    """The re-paired bytes serve a g128 layer too (the bench compares the two layouts)."""
    layer = random_layer(7, 4, 256, 128, bits=4, group_size=128, zero_points=True)
    _check(layer, 12, 2, torch.bfloat16, _rs(16, 64, 128, 64, 128), words=False)


def test_top1_direct_store_and_activation() -> None:
    layer = random_layer(5, 4, 128, 96, bits=4, group_size=32, zero_points=False)
    _check(layer, 9, 1, torch.bfloat16, _rs(16, 64, 128, 64, 32), activation="gelu")


@pytest.mark.skipif(not GPU, reason="the integer path is what the interpreter always runs")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_plain_dequantization_compiled(dtype: torch.dtype) -> None:
    """The compiled non-PTX dequantization (the variant the bench compares with)."""
    layer = random_layer(11, 4, 256, 128, bits=4, group_size=128, zero_points=True)
    _check(layer, 33, 2, dtype, _rs(32, 64, 128, 64, 128), use_asm=False)


if GPU:
    pytestmark = [pytest.mark.gpu]


def test_repair_puts_chunk_halves_in_the_nibbles() -> None:
    """Byte b of chunk c holds code c·CHUNK + b (low) and c·CHUNK + CHUNK/2 + b (high)."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 256, (3, 5, 96), generator=gen, dtype=torch.uint8)
    codes = torch.stack((q & 0xF, q >> 4), dim=-1).reshape(3, 5, 192)  # k = 2j, 2j + 1
    paired = repair_int4(q)
    half = CHUNK // 2
    for byte in range(paired.shape[-1]):
        chunk, b = divmod(byte, half)
        assert torch.equal(paired[..., byte] & 0xF, codes[..., chunk * CHUNK + b])
        assert torch.equal(paired[..., byte] >> 4, codes[..., chunk * CHUNK + half + b])
    assert torch.equal(unpair_int4(paired), q)


def test_word_layout_puts_chunk_slices_in_the_nibbles() -> None:
    """Word w of chunk c holds code c·WORD_CHUNK + t·WORDS + w in nibble t."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(0, 256, (2, 3, 128), generator=gen, dtype=torch.uint8)
    codes = torch.stack((q & 0xF, q >> 4), dim=-1).reshape(2, 3, 256)
    words = pack_words_int4(q)
    assert words.dtype == torch.int32
    assert words.shape == (2, 3, 32)
    as_u32 = words.to(torch.int64) & 0xFFFFFFFF
    for index in range(words.shape[-1]):
        chunk, w = divmod(index, WORDS)
        for t in range(8):
            nibble = (as_u32[..., index] >> (4 * t)) & 0xF
            assert torch.equal(
                nibble.to(torch.uint8), codes[..., chunk * WORD_CHUNK + t * WORDS + w]
            )
    assert torch.equal(unpack_words_int4(words), q)
    sliced = relayout_module.pack_words_int4  # the same, a few experts at a time
    old = relayout_module._SLICE_CODES
    relayout_module._SLICE_CODES = 256
    try:
        assert torch.equal(sliced(q), words)
        assert torch.equal(repair_int4(q), relayout_module._repair(q))
    finally:
        relayout_module._SLICE_CODES = old
    with pytest.raises(ValueError, match="word chunk"):
        pack_words_int4(torch.zeros(1, 2, 32, dtype=torch.uint8))


def test_repair_rejects_k_off_the_chunk() -> None:
    with pytest.raises(ValueError, match="chunk"):
        repair_int4(torch.zeros(2, 3, CHUNK // 2 + 8, dtype=torch.uint8))


def test_relayout_transposes_scales_and_unpacks_zero_points() -> None:
    layer = random_layer(2, 3, 128, 128, bits=4, group_size=32, zero_points=True)
    tensors = pack_triton(layer)
    spec = triton_spec(layer)
    out = prefill_rs.relayout(tensors, spec)
    for name in ("w13", "w2"):
        assert torch.equal(out[f"{name}_scales"], tensors[f"{name}_scales"].transpose(1, 2))
        packed = tensors[f"{name}_qzeros"]  # [E, N/2, G]: row 2r low nibble, 2r + 1 high
        zeros = out[f"{name}_qzeros"]  # [E, G, N]
        assert torch.equal(zeros[:, :, 0::2], (packed & 0xF).transpose(1, 2))
        assert torch.equal(zeros[:, :, 1::2], (packed >> 4).transpose(1, 2))
        assert torch.equal(unpair_int4(out[f"{name}_qweight"]), tensors[f"{name}_qweight"])
    words = prefill_rs.relayout(tensors, spec, words=True)  # H, I multiples of the word chunk
    assert torch.equal(unpack_words_int4(words["w2_qweight"]), tensors["w2_qweight"])


def test_k_step_fits_group_and_layer() -> None:
    assert prefill_rs.fit_k_step(128, 2048, 128) == 128
    assert prefill_rs.fit_k_step(128, 2048, 32) == 32
    assert prefill_rs.fit_k_step(256, 768, 768) == 256
    assert prefill_rs.fit_k_step(128, 96, 96) == 32
    with pytest.raises(ValueError, match="no K step"):
        prefill_rs.fit_k_step(128, 80, 80)


def test_supports_and_untuned_choice() -> None:
    ok = LayerSpec(8, 4096, 14336, 4, 128)
    assert prefill_rs.supports(ok)
    assert not prefill_rs.supports(LayerSpec(8, 64, 48, 4, 16))
    assert not prefill_rs.supports(LayerSpec(8, 96, 80, 4, -1))
    small = choose_config_rs(1, 2, ok, 132)
    large = choose_config_rs(4096, 2, ok, 132)
    assert small.kernel == large.kernel == PREFILL_RS
    assert (small.block_m, large.block_m) == (16, 128)
    assert small.w2.split_k > 1


def test_unsupported_layer_refuses_the_register_operand_config() -> None:
    layer = random_layer(4, 4, 64, 48, bits=4, group_size=16)
    backend = TritonWNA16Experts(_rs(16, 64, 128, 64, 128))
    backend.prepare(
        {name: t.to(KERNEL_DEVICE) for name, t in pack_triton(layer).items()}, triton_spec(layer)
    )
    x = torch.randn(2, 64).to(torch.bfloat16).to(KERNEL_DEVICE)
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=KERNEL_DEVICE)
    weights = torch.full((2, 2), 0.5, device=KERNEL_DEVICE)
    with pytest.raises(KernelUnavailableError, match="multiples of 32"):
        backend.forward(x, ids, weights, "silu")
