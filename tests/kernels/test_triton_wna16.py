"""Our Triton WNA16 kernel, interpreted on CPU (TRITON_INTERPRET=1), against EMULATION.

Fresh random weights, zero points and inputs for every case (never zeros); the output and
the intermediate are filled with NaN first, so anything left unwritten fails the check.
Tolerances: the kernel rounds the dequantized weights and the intermediate to the
activation dtype (as every 16-bit kernel does) and the reference does not, so relative
error is about 4e-3 with bfloat16 (8 bits of mantissa) and 5e-4 with float16.
"""

from __future__ import annotations

import pytest
import torch

from service.formats.canonical import QuantizedMoELayer
from service.kernels.activation import ACTIVATIONS, ActivationSpec
from service.kernels.emulation import EmulationExperts
from service.kernels.errors import KernelInputError, KernelUnavailableError
from service.kernels.interface import LayerSpec
from service.kernels.triton_wna16 import (
    GemmTile,
    KernelConfig,
    TritonWNA16Experts,
    choose_config,
    fit_block_k,
)
from tests.kernels.helpers import (
    KERNEL_DEVICE,
    pack_triton,
    random_layer,
    random_routing,
    rel_err,
    triton_spec,
)

TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3}


def _check(
    layer: QuantizedMoELayer,
    m: int,
    top_k: int,
    dtype: torch.dtype,
    *,
    activation: str | ActivationSpec = "silu",
    config: KernelConfig | None = None,
    seed: int = 0,
) -> float:
    gen = torch.Generator().manual_seed(seed)
    h = layer.hidden_size
    x = (torch.randn(m, h, generator=gen) * 2).to(dtype)
    ids, weights = random_routing(gen, m, layer.w13.num_experts, top_k)
    triton_backend = TritonWNA16Experts(config, poison_workspace=True)
    tensors = {name: t.to(KERNEL_DEVICE) for name, t in pack_triton(layer).items()}
    triton_backend.prepare(tensors, triton_spec(layer))
    out = torch.full((m, h), float("nan"), dtype=dtype, device=KERNEL_DEVICE)
    dev = KERNEL_DEVICE
    got = triton_backend.forward(x.to(dev), ids.to(dev), weights.to(dev), activation, out=out)
    assert got is out
    assert not got.isnan().any(), "an output element was left unwritten"
    reference = EmulationExperts()
    reference.prepare(layer, LayerSpec.from_canonical(layer))
    err = rel_err(got, reference.forward_fp32(x, ids, weights, activation))
    assert err < TOL[dtype], err
    return err


@pytest.mark.parametrize(
    ("bits", "group", "zp", "dtype"),
    [
        (4, 32, False, torch.bfloat16),
        (4, 64, True, torch.float16),
        (4, 128, False, torch.bfloat16),
        (4, -1, True, torch.bfloat16),
        (8, 32, True, torch.bfloat16),
        (8, 64, False, torch.float16),
        (8, 128, True, torch.bfloat16),
        (8, -1, False, torch.float16),
    ],
)
def test_quantization_variants(bits: int, group: int, zp: bool, dtype: torch.dtype) -> None:
    layer = random_layer(bits + group, 4, 128, 128, bits=bits, group_size=group, zero_points=zp)
    _check(layer, 7, 2, dtype, seed=group)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activations(name: str) -> None:
    layer = random_layer(
        len(name), 4, 64, 48, bits=4, group_size=16, zero_points=True,
        gated=ACTIVATIONS[name].gated,
    )  # fmt: skip
    spec = (
        ActivationSpec(name, limit=1.5, alpha=1.3, beta=0.5)
        if name == "swigluoai_uninterleave"
        else ActivationSpec(name)
    )
    _check(layer, 5, 2, torch.bfloat16, activation=spec, seed=len(name))


def test_clamped_silu() -> None:
    layer = random_layer(8, 4, 64, 32, bits=8, group_size=32)
    _check(layer, 4, 2, torch.float16, activation=ActivationSpec("silu", limit=0.5))


# Tiles chosen to reach each code path: K tile smaller than the group (one scale vector per
# tile) or larger (a scale tile), split-K in w2, several routes per block, partial N tiles.
PATHS = {
    "group_spans_tiles_split_k": KernelConfig(32, GemmTile(32, 32), GemmTile(64, 32, split_k=2)),
    "tile_spans_groups": KernelConfig(16, GemmTile(32, 128), GemmTile(32, 96 // 3, split_k=1)),
    "split_k_4_partial_n": KernelConfig(16, GemmTile(64, 64), GemmTile(32, 16, split_k=4)),
    "swap_ab_split_k": KernelConfig(
        16, GemmTile(64, 32, swap_ab=True), GemmTile(32, 32, split_k=2, swap_ab=True)
    ),
    "swap_ab_tile_spans_groups": KernelConfig(
        32, GemmTile(32, 128, swap_ab=True), GemmTile(64, 32, swap_ab=True)
    ),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_code_paths(path: str) -> None:
    layer = random_layer(21, 4, 128, 96, bits=4, group_size=32, zero_points=True, bias=True)
    _check(layer, 24, 2, torch.bfloat16, config=PATHS[path], seed=3)


def test_top1_stores_directly_and_decode_shape() -> None:
    layer = random_layer(5, 8, 128, 64, bits=4, group_size=32, bias=True)
    _check(layer, 9, 1, torch.bfloat16, config=KernelConfig(16, GemmTile(32, 64), GemmTile(32, 64)))
    swapped = KernelConfig(16, GemmTile(32, 64, swap_ab=True), GemmTile(32, 64, swap_ab=True))
    _check(layer, 9, 1, torch.float16, config=swapped, seed=1)
    _check(layer, 1, 4, torch.float16, seed=2)


# --- configuration -----------------------------------------------------------------------------

SHAPES = {
    "Mixtral-8x7B": (8, 4096, 14336, 2),
    "Qwen1.5-MoE-A2.7B": (60, 2048, 1408, 4),
    "Qwen3-30B-A3B": (128, 2048, 768, 8),
    "DeepSeek-V3": (256, 7168, 2048, 8),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize(("bits", "group"), [(4, 128), (4, 32), (8, -1), (8, 64)])
def test_choose_config_fits_every_shape(shape: str, bits: int, group: int) -> None:
    e, h, i, k = SHAPES[shape]
    spec = LayerSpec(e, h, i, bits, group)
    for m in (1, 4, 16, 64, 256, 1024, 4096):
        config = choose_config(m, k, spec, 132)
        for tile, kdim in ((config.w13, h), (config.w2, i)):
            g = kdim if group == -1 else group
            assert kdim % tile.block_k == 0
            assert g % tile.block_k == 0 or tile.block_k % g == 0
            assert 1 <= tile.split_k <= kdim // tile.block_k
        assert config.block_m in (16, 32, 64, 128)


def test_fit_block_k() -> None:
    assert fit_block_k(256, 2048, 128) == 256
    assert fit_block_k(256, 768, 128) == 256
    assert fit_block_k(128, 1408, 128) == 128
    assert fit_block_k(256, 1408, 32) == 128
    assert fit_block_k(64, 48, 16) == 16
    with pytest.raises(KernelUnavailableError):
        fit_block_k(64, 40, 40)


def test_writer_layout_is_the_documented_one() -> None:
    """The TRITON writer's bytes equal a packer written from the layout description."""
    from tests.kernels.helpers import pack_triton_by_hand

    for bits, zp in ((4, True), (8, True), (4, False)):
        layer = random_layer(bits, 3, 64, 32, bits=bits, group_size=32, zero_points=zp, bias=True)
        written, by_hand = pack_triton(layer), pack_triton_by_hand(layer)
        assert written.keys() == by_hand.keys()
        for name, tensor in written.items():
            assert torch.equal(tensor, by_hand[name]), name


# --- bad layers --------------------------------------------------------------------------------


def test_prepare_rejects_bad_tensors() -> None:
    layer = random_layer(1, 4, 64, 32, bits=4, group_size=32, zero_points=True)
    spec = triton_spec(layer)
    tensors = {name: t.to(KERNEL_DEVICE) for name, t in pack_triton(layer).items()}
    with pytest.raises(KernelInputError) as info:
        TritonWNA16Experts().prepare({**tensors, "w2_scales": tensors["w2_scales"][:, :, :0]}, spec)
    assert info.value.field == "w2_scales"
    missing = {k: v for k, v in tensors.items() if k != "w13_qzeros"}
    with pytest.raises(KernelInputError) as info:
        TritonWNA16Experts().prepare(missing, spec)
    assert info.value.field == "w13_qzeros"
    with pytest.raises(KernelInputError):
        TritonWNA16Experts().prepare(layer, spec)
    act_order = LayerSpec(
        **{**{f: getattr(spec, f) for f in LayerSpec.__dataclass_fields__}, "act_order": True}
    )
    with pytest.raises(KernelUnavailableError):
        TritonWNA16Experts().prepare(tensors, act_order)


def test_bad_forward_input_is_rejected_before_launch() -> None:
    layer = random_layer(1, 4, 64, 32, bits=4, group_size=32)
    backend = TritonWNA16Experts()
    dev = KERNEL_DEVICE
    backend.prepare({n: t.to(dev) for n, t in pack_triton(layer).items()}, triton_spec(layer))
    ids, weights = random_routing(torch.Generator().manual_seed(0), 2, 4, 2)
    ids, weights = ids.to(dev), weights.to(dev)
    with pytest.raises(KernelInputError) as info:
        backend.forward(torch.randn(2, 32, device=dev).bfloat16(), ids, weights)
    assert info.value.field == "hidden_states"
    with pytest.raises(KernelInputError):
        backend.forward(torch.randn(2, 64, device=dev).bfloat16(), ids, weights, "relu2_no_mul")
    with pytest.raises(KernelInputError) as info:
        backend.forward(torch.randn(2, 64, device=dev).bfloat16(), ids, weights.double())
    assert info.value.field == "topk_weights"
