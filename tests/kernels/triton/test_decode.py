"""TRITON decode variant (one program per route, split-K GEMVs), interpreted on CPU, against
EMULATION's float32 forward.

Same method as test_prefill.py (`_check`: fresh random weights, zero points and inputs,
NaN-poisoned output and intermediate, relative error under 1e-2 for bfloat16 and 3e-3 for
float16 activations). The variant computes in float32 without rounding the dequantized
weights, so its error is that of the 16-bit intermediate and output alone. Its own paths:
w13 split or not (the last-arriver epilogue vs a direct store), w2's reduction (atomic sum
with a last-arriver flush, or top-1 storing directly), K tiles spanning several groups or
lying inside one, int4/int8, zero points, bias, every activation, the workspaces left
zeroed for the next forward, and the dispatcher switch. Then what the interpreter cannot
show: both kernels compile for sm_90a (tests/kernels/triton/_ttgir.py) with no tensor-core dot.
"""

from __future__ import annotations

import re

import pytest
import torch

from service.kernels.activation import ACTIVATIONS, ActivationSpec
from service.kernels.interface import KernelOptions, LayerSpec
from service.kernels.triton.config import (
    DECODE,
    DECODE_MAX_ROUTES,
    GemmTile,
    KernelConfig,
    choose_config_decode,
    use_decode,
)
from service.kernels.triton.decode import _span
from service.kernels.triton.experts import TritonWNA16Experts
from tests.kernels.helpers import KERNEL_DEVICE, pack_triton, random_layer, random_routing
from tests.kernels.triton._ttgir import compiled_asm
from tests.kernels.triton.test_config import SHAPES
from tests.kernels.triton.test_prefill import _check

# On a GPU these tests run compiled: `pytest -m gpu tests/kernels/triton/test_decode.py`
# there; on CPU they are unmarked and interpreted.
pytestmark = [pytest.mark.gpu] if torch.cuda.is_available() else []


def _decode(w13: GemmTile, w2: GemmTile) -> KernelConfig:
    return KernelConfig(1, w13, w2, kernel=DECODE)


#: w13 split 4 (last-arriver epilogue), w2 split 2; K tiles of 32 inside 32-groups.
SPLIT = _decode(GemmTile(32, 32, split_k=4), GemmTile(32, 32, split_k=2))
#: No split anywhere; K tiles of 64 spanning two 32-groups (or inside 64/128/channelwise).
WHOLE = _decode(GemmTile(16, 64, split_k=1), GemmTile(64, 64, split_k=1))


@pytest.mark.parametrize(
    ("bits", "group", "zp", "dtype", "config"),
    [
        (4, 32, True, torch.bfloat16, SPLIT),
        (8, -1, True, torch.bfloat16, SPLIT),
        (4, 128, False, torch.float16, WHOLE),
        (8, 32, True, torch.float16, WHOLE),
    ],
    ids=["int4-g32-zp-split", "int8-chan-zp-split", "int4-g128-fp16-whole", "int8-g32-zp-whole"],
)
def test_quantization_variants(
    bits: int, group: int, zp: bool, dtype: torch.dtype, config: KernelConfig
) -> None:
    layer = random_layer(bits + group + 7, 4, 128, 128, bits=bits, group_size=group, zero_points=zp)
    _check(layer, 2, 2, dtype, config=config, seed=group + 11)


# Each reduction path: splits that leave a partial last span (K 96 = 3 tiles of 32 in 2
# splits), bias (added once: by the epilogue in w13, by split 0 in w2), a w13 K tile over
# two groups; more tokens than one flush block of 16 (top-1, w2 split); top-1 without any
# reduction.
PATHS = {
    "uneven_splits_bias": (
        _decode(GemmTile(32, 64, split_k=2), GemmTile(32, 32, split_k=2)),
        (128, 96),
        3,
        2,
    ),
    "many_tokens_flush": (_decode(GemmTile(32, 32), GemmTile(32, 32, split_k=2)), (32, 32), 17, 1),
    "top1_direct_store": (_decode(GemmTile(32, 32), GemmTile(32, 32)), (64, 32), 3, 1),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_code_paths(path: str) -> None:
    config, (h, i), m, top_k = PATHS[path]
    layer = random_layer(23, 4, h, i, bits=4, group_size=32, zero_points=True, bias=True)
    _check(layer, m, top_k, torch.bfloat16, config=config, seed=5)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activations(name: str) -> None:
    layer = random_layer(
        len(name) + 3, 4, 64, 32, bits=4, group_size=32, zero_points=True,
        gated=ACTIVATIONS[name].gated,
    )  # fmt: skip
    spec = (
        ActivationSpec(name, limit=1.5, alpha=1.3, beta=0.5)
        if name == "swigluoai_uninterleave"
        else ActivationSpec(name)
    )
    config = _decode(GemmTile(32, 32, split_k=2), GemmTile(32, 32))
    _check(layer, 1, 2, torch.bfloat16, activation=spec, config=config, seed=len(name) + 1)


def test_workspaces_are_left_zeroed_for_the_next_forward() -> None:
    """Forwards of different sizes in a row on one backend (all tokens on one expert in
    one of them), each equal to a fresh backend's output: the split sums and counters of
    both GEMMs were reset by their last arrivers."""
    layer = random_layer(29, 4, 64, 32, bits=4, group_size=32)
    tensors = {name: t.to(KERNEL_DEVICE) for name, t in pack_triton(layer).items()}
    spec = LayerSpec(4, 64, 32, 4, 32)
    reused = TritonWNA16Experts(SPLIT)
    reused.prepare(tensors, spec)
    gen = torch.Generator().manual_seed(13)
    for m, skew in ((4, True), (1, False)):
        x = torch.randn(m, 64, generator=gen).bfloat16().to(KERNEL_DEVICE)
        ids, weights = random_routing(gen, m, 4, 2)
        if skew:
            ids[:, 0] = 1
        ids, weights = ids.to(KERNEL_DEVICE), weights.to(KERNEL_DEVICE)
        fresh = TritonWNA16Experts(SPLIT)
        fresh.prepare(tensors, spec)
        expected = fresh.forward(x, ids, weights)
        got = reused.forward(x, ids, weights)
        torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-3)
        assert not torch.isnan(got).any()


# --- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_default_decode_config_fits_every_shape(shape: str) -> None:
    e, h, i, k = SHAPES[shape]
    for bits, group in ((4, 128), (8, -1), (4, 32)):
        spec = LayerSpec(e, h, i, bits, group)
        for m in (1, 4, 8):
            config = choose_config_decode(m, k, spec, 132)
            assert config.kernel == DECODE
            for tile, kdim in ((config.w13, h), (config.w2, i)):
                g = kdim if group == -1 else group
                assert kdim % tile.block_k == 0 and tile.block_k >= 32
                assert g % tile.block_k == 0 or tile.block_k % g == 0
                span, splits = _span(kdim, tile.block_k, tile.split_k)
                assert splits == tile.split_k and span * (splits - 1) < kdim <= span * splits


def test_qwen3_decode_programs() -> None:
    """The measured design point (KERNEL_NOTES v5: in the H200 sweep at Qwen3 M=1, halving
    w13's splits took it from 12.0 to 10.2 µs): ~4 programs per SM, w13 in 4 splits of two
    256-wide K steps, w2 in 3 splits of one step."""
    spec = LayerSpec(128, 2048, 768, 4, 128)
    config = choose_config_decode(1, 8, spec, 132)
    assert (config.w13.block_n, config.w13.block_k, config.w13.split_k) == (32, 256, 4)
    assert (config.w2.block_n, config.w2.block_k, config.w2.split_k) == (64, 256, 3)


def test_dispatcher_switch() -> None:
    """Off when the backend is made with decode off (the worker's MOE_CONTROL_TRITON_DECODE=0);
    by default taken for few routes per expert and up to DECODE_MAX_ROUTES routes (before
    the tuned table), and the forward then runs the decode kernels."""
    layer = random_layer(31, 4, 64, 64, bits=4, group_size=32)
    tensors = {name: t.to(KERNEL_DEVICE) for name, t in pack_triton(layer).items()}
    spec = LayerSpec(4, 64, 64, 4, 32)
    off = TritonWNA16Experts.configured(KernelOptions(triton_decode=False))
    off.prepare(tensors, spec)
    assert off.config_for(1, 2, KERNEL_DEVICE).kernel != DECODE
    assert use_decode(1, 8, 128) and use_decode(4, 8, 128)  # Qwen3: 1.0, 1.09 per expert
    assert use_decode(4, 2, 8) and not use_decode(8, 2, 8)  # Mixtral: 1.46, 2.2
    assert not use_decode(16, 4, 60)  # Qwen1.5-MoE M=16: 1.6 per expert
    assert not use_decode(DECODE_MAX_ROUTES // 8 + 1, 8, 4096)  # past the route bound
    backend = TritonWNA16Experts.configured(KernelOptions())
    backend.prepare(tensors, spec)
    assert backend.config_for(1, 2, KERNEL_DEVICE).kernel == DECODE
    assert backend.config_for(16, 2, KERNEL_DEVICE).kernel != DECODE
    _check(layer, 1, 2, torch.bfloat16, seed=17)  # the default-constructed backend: decode


# --- what the interpreter cannot show: the compiled kernels -----------------------------------

_W13 = {
    "K": 2048, "TOP_K": 8, "BITS": 4, "GROUP": 128, "SUB": 128, "HAS_ZP": False,
    "HAS_BIAS": False, "ACT": 0, "GATED": True, "INTERLEAVED": False, "BLOCK_N": 32,
    "BLOCK_K": 256, "K_SPAN": 256, "SPLIT_K": 8, "NUM_STAGES": 2, "INTERP": False,
}  # fmt: skip
_W2 = {
    "K": 768, "TOP_K": 8, "BITS": 4, "GROUP": 128, "SUB": 128, "HAS_ZP": False,
    "HAS_BIAS": False, "BLOCK_N": 64, "BLOCK_K": 256, "K_SPAN": 256, "SPLIT_K": 3,
    "REDUCE": True, "FLUSH_M": 16, "NUM_STAGES": 2, "INTERP": False,
}  # fmt: skip
_TYPES = {"q_ptr": "*i32", "ws_ptr": "*fp32", "ids_ptr": "*i64", "inter": "i32"}
_ALIGNED = ("x_ptr", "q_ptr", "s_ptr", "a_ptr", "stride_xm", "stride_qe", "stride_qn",
            "stride_se", "stride_am", "stride_om", "inter", "hidden")  # fmt: skip


def test_kernels_compile_for_sm90a() -> None:
    """The Qwen3 M=1 launches (and an int8 asymmetric, bias, unsplit one) compile for
    sm_90a; no tensor-core instruction (the MMAv2 K-16 wrap cannot apply), 16-byte weight
    loads, and the split reductions' acquire-release counter and atomic exchanges."""
    module = "service.kernels.triton.decode"
    int8 = {"BITS": 8, "BLOCK_K": 128, "K_SPAN": 2048, "SUB": 128, "HAS_ZP": True,
            "HAS_BIAS": True, "SPLIT_K": 1}  # fmt: skip
    w13 = compiled_asm(module, "_decode_w13_kernel", [_W13], types=_TYPES, aligned=_ALIGNED)
    w13 += compiled_asm(
        module, "_decode_w13_kernel", [{**_W13, **int8}], types={**_TYPES, "q_ptr": "*u8"},
        aligned=_ALIGNED,
    )  # fmt: skip
    w2 = compiled_asm(
        module,
        "_decode_w2_kernel",
        [_W2, {**_W2, "TOP_K": 1, "SPLIT_K": 1, "K_SPAN": 768, "REDUCE": False}],
        types={**_TYPES, "topk_w_ptr": "*fp32"},
        aligned=_ALIGNED,
    )
    for asm in (*w13, *w2):
        ptx = asm["ptx"]
        assert "mma" not in ptx
        # Weights: 16-byte copies (pipelined cp.async, or plain vector loads).
        assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx) or (
            "ld.global.v4" in ptx
        ), "no 16-byte weight loads"
        # Codes become floats by the 2^23 OR, not on the int->float conversion unit (which
        # only the zero points, one per row and group, may use): 64+ codes per thread.
        assert len(re.findall(r"cvt\.rn\.f32\.[us](8|16|32)", ptx)) <= 8
    for split in (w13[0]["ptx"], w2[0]["ptx"]):
        assert re.search(r"atom\.global\.gpu\.acq_rel\.add\.u32", split)
        assert "atom.global.gpu.relaxed.exch.b32" in split
    for whole in (w13[1]["ptx"], w2[1]["ptx"]):
        assert "atom." not in whole  # unsplit w13, top-1 w2: stored directly
