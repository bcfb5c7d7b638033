"""The prefill kernels of our Triton WNA16 forward, interpreted on CPU, against EMULATION.

Fresh random weights, zero points and inputs for every case (never zeros); the output and
the intermediate are filled with NaN first, so anything left unwritten fails the check.
Tolerances: the kernel rounds the dequantized weights and the intermediate to the
activation dtype (as every 16-bit kernel does) and the reference does not, so relative
error is about 4e-3 with bfloat16 (8 bits of mantissa) and 5e-4 with float16.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from service.formats.canonical import QuantizedMoELayer
from service.kernels.activation import ACTIVATIONS, ActivationSpec
from service.kernels.emulation import EmulationExperts
from service.kernels.errors import KernelInputError, KernelUnavailableError
from service.kernels.interface import LayerSpec
from service.kernels.triton.config import GemmTile, KernelConfig, choose_config, launch_k_tile
from service.kernels.triton.experts import TritonWNA16Experts
from tests.kernels.helpers import (
    KERNEL_DEVICE,
    pack_triton,
    random_layer,
    random_routing,
    rel_err,
    triton_spec,
)
from tests.kernels.triton._ttgir import compiled_dots, wrapped

# On a GPU these tests run compiled: `pytest -m gpu tests/kernels/triton/test_prefill.py`
# there (scripts/gpu_test.sh); on CPU they are unmarked and interpreted.
pytestmark = [pytest.mark.gpu] if torch.cuda.is_available() else []

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


# --- K tiles below 32: Triton 3.6's wrapped MMAv2 layout (triton-lang/triton#11691) -----------

#: Layers whose H or I is an odd multiple of 16, where `choose_config` fits a K tile of 16
#: (before the launcher widened it, int4 compiled to a wrapped kWidth-8 dot: wrong on the
#: H200, right here): (H, I, bits, group, zero points). Group 48 at H 96 nests with no 32-wide
#: tile, so w13 keeps K 16 and the float32 dot; at I 48 it is channelwise-like (one group).
ODD_K_LAYERS = {
    "int4_g16_zp": (80, 48, 4, 16, True),
    "int4_channelwise": (48, 80, 4, -1, True),
    "int8_g16": (80, 48, 8, 16, False),
    "int4_g48_fp32_dot": (96, 48, 4, 48, False),
}


#: A caller's explicit K-16 tiles in the other orientations than the heuristic's (w13
#: swap-AB, w2 plain with split-K), so every masked load runs in both.
_ODD_K_SWAPPED = KernelConfig(16, GemmTile(64, 16, swap_ab=True), GemmTile(32, 16, split_k=2))


@pytest.mark.parametrize("layer", sorted(ODD_K_LAYERS))
def test_odd_k_layers_interpreted(layer: str) -> None:
    """Correctness at those shapes with the masked 32-wide tiles (and the float32 fallback)."""
    h, i, bits, group, zp = ODD_K_LAYERS[layer]
    built = random_layer(
        h + i + bits, 4, h, i, bits=bits, group_size=group, zero_points=zp, bias=True
    )
    _check(built, 5, 2, torch.bfloat16, seed=h)
    _check(built, 6, 2, torch.float16, config=_ODD_K_SWAPPED, seed=i)


def _launch_consts(
    spec: LayerSpec, config: KernelConfig, top_k: int
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The constexprs and options `fused_moe` passes to each kernel when compiled (silu,
    top-k sum by atomics), for the compile test."""
    h, i = spec.hidden_size, spec.intermediate_size
    g13 = h if spec.group_size == -1 else spec.group_size
    g2 = i if spec.group_size == -1 else spec.group_size
    k1 = launch_k_tile(config.w13.block_k, h, g13, interpreted=False)
    k2 = launch_k_tile(config.w2.block_k, i, g2, interpreted=False)
    c1, c2 = config.w13, config.w2
    layer = {"TOP_K": top_k, "BITS": spec.bits, "HAS_ZP": spec.has_zero_points,
             "HAS_BIAS": spec.has_bias, "BLOCK_M": config.block_m}  # fmt: skip
    w13 = {**layer, "K": h, "GROUP": g13, "ACT": 0, "GATED": True, "INTERLEAVED": False,
           "BLOCK_N": c1.block_n, "BLOCK_K": k1.block_k, "SWAP_AB": c1.swap_ab,
           "DOT_F32": k1.dot_f32}  # fmt: skip
    w2 = {**layer, "K": i, "GROUP": g2, "BLOCK_N": c2.block_n, "BLOCK_K": k2.block_k,
          "K_SPAN": -(-i // (c2.split_k * k2.block_k)) * k2.block_k,
          "ATOMIC": True, "SWAP_AB": c2.swap_ab, "DOT_F32": k2.dot_f32}  # fmt: skip
    o1 = {"num_warps": c1.num_warps, "num_stages": c1.num_stages}
    o2 = {"num_warps": c2.num_warps, "num_stages": c2.num_stages}
    return w13, o1, w2, o2


def test_compiled_odd_k_tiles_stay_off_the_wrapped_mma_layout() -> None:
    """What the interpreter cannot show: compiled for sm_90a (in a subprocess, no GPU), every
    dot operand of what the launcher passes at the odd-K layers has 4·kWidth <= its K tile,
    and the tensor cores are still used (MMAv2 for small plain tiles, wgmma for swap-AB and
    128-row ones; int4 and int8; the heuristic's tiles and a caller's K-16 ones). The same
    small plain tiles unwidened (K 16, 16-bit dot) show the wrapped layout this guards."""
    int4 = LayerSpec(8, *ODD_K_LAYERS["int4_g16_zp"][:4], has_zero_points=True)
    int8 = LayerSpec(8, *ODD_K_LAYERS["int8_g16"][:4])
    g48 = LayerSpec(8, *ODD_K_LAYERS["int4_g48_fp32_dot"][:4])
    launches = [
        (int4, choose_config(1, 2, int4, 132)),
        (int4, choose_config(1024, 2, int4, 132)),
        (int4, _ODD_K_SWAPPED),
        (int8, choose_config(1, 2, int8, 132)),
        (g48, choose_config(1, 2, g48, 132)),
    ]
    variants = [_launch_consts(spec, config, 2) for spec, config in launches]
    # The unwidened K-16 launch of int4's small plain tiles (w13 decode, w2 of the caller's).
    unwidened = {"BLOCK_K": 16, "DOT_F32": False}
    assert not variants[0][0]["SWAP_AB"] and not variants[2][2]["SWAP_AB"]
    bug13 = {**variants[0][0], **unwidened}
    bug2 = {**variants[2][2], **unwidened, "K_SPAN": 32}
    w13 = compiled_dots(
        "service.kernels.triton.prefill", "_moe_w13_kernel",
        [v[0] for v in variants] + [bug13], types={"q_ptr": "*u8"},
        options=[v[1] for v in variants] + [variants[0][1]],
    )  # fmt: skip
    w2 = compiled_dots(
        "service.kernels.triton.prefill", "_moe_w2_kernel",
        [v[2] for v in variants] + [bug2], types={"q_ptr": "*u8", "out_ptr": "*fp32"},
        options=[v[3] for v in variants] + [variants[2][3]],
    )  # fmt: skip
    launched = [v[0] for v in variants] + [v[2] for v in variants]
    for dots, consts in zip(w13[:-1] + w2[:-1], launched, strict=True):
        assert not wrapped(dots["mma"]), (consts, dots)
        tensor_cores = bool(dots["mma"]) or dots["wgmma"]
        assert tensor_cores != consts["DOT_F32"], (consts, dots)  # tensor cores unless f32
    # What this guards against: the compiler's 16-bit MMAv2 dot at K 16 wraps.
    assert wrapped(w13[-1]["mma"]), w13[-1]
    assert wrapped(w2[-1]["mma"]), w2[-1]
