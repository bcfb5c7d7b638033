"""The register-operand prefill kernels: dequantized weights as wgmma's register operand.

Same forward as `prefill.py` (an alignment of routes by expert, then the w13 GEMM with the
activation in its epilogue and the w2 GEMM with the router-weighted top-k sum fused in), but
every tile is the transposed product w·xᵀ ([BLOCK_N weight rows, BLOCK_M tokens]) and the
dequantization is written so that Triton keeps it in registers:

* **Swap-AB.** Only the left operand of a Hopper `wgmma` can come from registers, so the
  weights are the left operand (64 rows per warpgroup) and the tokens the right one (N from
  16 up), read from shared memory where the pipeliner's asynchronous copies put them.
* **An elementwise chain from load to dot.** `prefill.py` unpacks int4 with a join and a
  reshape, which forces the dequantized bf16 tile through shared memory every K step. Here
  the codes are in one of our layouts (relayout.py), in which each nibble position of a
  loaded tile is a contiguous run of inputs, so the chain from the code load to the dot is
  elementwise: Triton copies the *codes* (4 bits per weight) to shared memory
  asynchronously and dequantizes them in the dot-operand registers (its dot-operand
  hoisting, triton-lang/triton#5003). Word layout (every 128-input chunk of a row within
  one group: K and the group multiples of 128, or channelwise): int32 words, nibble t of
  a chunk's 16 words is inputs 16t .. 16t + 15, so a chunk is eight dots of K 16 and each
  thread's two consecutive words are one `ld.shared.v2`. Re-paired bytes (groups of 32 and
  64): the low nibbles of a byte tile are the first half of each 32-input chunk, the high
  nibbles the second, two dots per K step (Triton then gathers the thread's bytes from two
  rows with extra `prmt`s: about twice the instructions per weight of the word layout).
* **Bit-operation dequantization** (`USE_ASM`, compiled only): `prmt` puts a byte of two
  words (or two bytes) into the two half-words, one `lop3` keeps a nibble and ORs in the
  magic number (16-bit floats 128 + q in bf16, exponent 0x4300; 1024 + q in fp16, 0x6400),
  with no conversion instruction, then one packed subtract of (magic + zero point) per two
  weights gives q - z exactly.
* **The scale after the MMA** (`scale_after`, the default): each K step lies in one group,
  so its float32 partial product is multiplied by the per-row scale, one multiply-add per
  accumulator element and step instead of one multiply per weight (and no rounding of the
  scale). Folded (`scale_after` False, for 128-token blocks, whose two partials would not fit
  the registers): one packed multiply per two weights, the scale rounded to the activation
  dtype first (exact when the scales are stored in it, as our writers store them).
* **Group-wise steps.** A K step never spans two groups, so its scales and zero points are
  [BLOCK_N] vectors, loaded one step ahead (the pipeliner does not copy these 2-byte gathers
  ahead by itself).
* **Gate and up together.** w13's two projections share each activation tile and their
  dots interleave, so a wait for one accumulator leaves the other's MMA in flight.

int8 codes keep TRITON's layout (no nibbles) and one tile per sub-step, dequantized by
ordinary integer and float operations (also elementwise). Requirements beyond the TRITON
layout's: K of both GEMMs and the group a multiple of 32 (`supports`); other layers stay on
`prefill.py`. Scales are read transposed ([E, G, N]) and zero points one byte per row
([E, G, N]), made at prepare by `relayout` with the codes.
"""

# Triton idiom: compile-time parameters are UPPER_CASE, kernels take many arguments and
# constexpr branches stay statements (not conditional expressions);
# @triton.jit device functions are untyped (triton has no type information).
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# ruff: noqa: N803, N806, PLR0917, SIM108

from __future__ import annotations

import torch
import triton
import triton.language as tl

from service.kernels.activation import ResolvedActivation
from service.kernels.align import align_block_size
from service.kernels.interface import LayerSpec
from service.kernels.triton.config import KernelConfig
from service.kernels.triton.jit import (
    block_routes,
    expert_weights,
    gated_activation,
    plain_activation,
    round16,
    route_tile,
    store_topk_sum,
    w13_rows,
)
from service.kernels.triton.relayout import (
    CHUNK,
    WORD_CHUNK,
    WORDS,
    pack_words_int4,
    repair_int4,
)
from service.triton_runtime import interpreting

#: Smallest K step: one re-paired chunk (two 16-input dots, wgmma's K for 16-bit operands).
MIN_SUB = CHUNK


def supports(spec: LayerSpec) -> bool:
    """Whether these kernels take the layer: both K a multiple of the chunk, the group too."""
    group_ok = spec.group_size == -1 or spec.group_size % CHUNK == 0
    return group_ok and spec.hidden_size % CHUNK == 0 and spec.intermediate_size % CHUNK == 0


def word_layout(spec: LayerSpec) -> bool:
    """Whether the layer's int4 codes take the word layout (relayout.py): each 128-input
    chunk of a row within one quantization group. Otherwise the re-paired bytes."""
    group_ok = spec.group_size == -1 or spec.group_size % WORD_CHUNK == 0
    dims_ok = spec.hidden_size % WORD_CHUNK == 0 and spec.intermediate_size % WORD_CHUNK == 0
    return spec.bits == 4 and group_ok and dims_ok


def relayout(
    t: dict[str, torch.Tensor], spec: LayerSpec, words: bool | None = None
) -> dict[str, torch.Tensor]:
    """The tensors these kernels read, made from TRITON's on their device: int4 codes in the
    word layout (`words`, default `word_layout(spec)`) or re-paired bytes (relayout.py);
    scales [E, N, G] transposed to [E, G, N] and zero points unpacked to one byte per row,
    [E, G, N], so that a K step's per-row scales and zero points are one contiguous vector."""
    if words is None:
        words = word_layout(spec)
    out = dict(t)
    for name in ("w13", "w2"):
        if spec.bits == 4:
            q = t[f"{name}_qweight"]
            out[f"{name}_qweight"] = pack_words_int4(q) if words else repair_int4(q)
        out[f"{name}_scales"] = t[f"{name}_scales"].transpose(1, 2).contiguous()
        zeros = t.get(f"{name}_qzeros")
        if zeros is not None:
            if spec.bits == 4:
                zeros = torch.stack((zeros & 0xF, zeros >> 4), dim=2).flatten(1, 2)
            out[f"{name}_qzeros"] = zeros.transpose(1, 2).contiguous()
    return out


def fit_k_step(block_k: int, k: int, group: int, smallest: int = MIN_SUB) -> int:
    """The K step for a configured K tile: the largest power of two <= block_k and <= the
    group that divides K and is at least `smallest` (the layout's chunk; each step then
    reads one scale and one zero point per weight row)."""
    bk = 1 << (max(smallest, min(block_k, group)).bit_length() - 1)
    while bk > smallest and (k % bk or group % bk):
        bk //= 2
    if bk < smallest or k % bk or group % bk:
        raise ValueError(f"K {k} with group {group} has no K step for tile {block_k}")
    return bk


def fused_moe_rs(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    t: dict[str, torch.Tensor],
    spec: LayerSpec,
    act: ResolvedActivation,
    config: KernelConfig,
    poison: bool = False,
    out: torch.Tensor | None = None,
    use_asm: bool = True,
) -> torch.Tensor:
    """The whole forward on re-laid-out tensors (`relayout`), into `out` if given."""
    m, top_k = topk_ids.shape
    h, i = spec.hidden_size, spec.intermediate_size
    aligned = align_block_size(topk_ids, config.block_m, spec.num_experts)
    max_blocks = aligned.expert_ids.numel()
    num_routes = m * top_k
    inter = torch.empty((num_routes, i), dtype=x.dtype, device=x.device)
    if poison:
        inter.fill_(float("nan"))
    interpreted = interpreting()
    asm = use_asm and not interpreted
    has_zp, has_bias = spec.has_zero_points, spec.has_bias
    dummy = t["w13_scales"]
    q13, s13 = t["w13_qweight"], t["w13_scales"]
    z13 = t.get("w13_qzeros", dummy)
    b13 = t.get("w13_bias", dummy)
    c1 = config.w13
    g13 = h if spec.group_size == -1 else spec.group_size
    words = q13.dtype == torch.int32  # the word layout (else re-paired bytes, or int8)
    smallest = WORD_CHUNK if words else MIN_SUB
    bk1 = fit_k_step(c1.block_k, h, g13, smallest)
    _moe_w13_rs_kernel[(max_blocks, triton.cdiv(i, c1.block_n))](
        x, q13, s13, z13, b13, inter, aligned.sorted_ids, aligned.expert_ids,
        aligned.sorted_ids.numel(), num_routes, i,
        x.stride(0), q13.stride(0), q13.stride(1), s13.stride(0), s13.stride(1),
        z13.stride(0), z13.stride(1), b13.stride(0), inter.stride(0),
        act.limit, act.alpha, act.beta,
        K=h, TOP_K=top_k, BITS=spec.bits, GROUP=g13, HAS_ZP=has_zp, HAS_BIAS=has_bias,
        ACT=act.code, GATED=act.gated, INTERLEAVED=act.interleaved,
        BLOCK_M=config.block_m, BLOCK_N=c1.block_n, BLOCK_K=bk1,
        SCALE_AFTER=c1.scale_after, WORD_LAYOUT=words, USE_ASM=asm, DOT_F32=interpreted,
        num_warps=c1.num_warps, num_stages=c1.num_stages,
    )  # fmt: skip
    c2 = config.w2
    g2 = i if spec.group_size == -1 else spec.group_size
    bk2 = fit_k_step(c2.block_k, i, g2, smallest)
    split = max(1, min(c2.split_k, i // bk2))
    atomic = top_k > 1 or split > 1
    result = torch.empty_like(x) if out is None else out
    acc = torch.zeros((m, h), dtype=torch.float32, device=x.device) if atomic else result
    q2, s2 = t["w2_qweight"], t["w2_scales"]
    z2 = t.get("w2_qzeros", dummy)
    b2 = t.get("w2_bias", dummy)
    _moe_w2_rs_kernel[(max_blocks, triton.cdiv(h, c2.block_n), split)](
        inter, q2, s2, z2, b2, topk_weights, acc, aligned.sorted_ids, aligned.expert_ids,
        aligned.sorted_ids.numel(), num_routes, h,
        inter.stride(0), q2.stride(0), q2.stride(1), s2.stride(0), s2.stride(1),
        z2.stride(0), z2.stride(1), b2.stride(0), acc.stride(0),
        K=i, TOP_K=top_k, BITS=spec.bits, GROUP=g2, HAS_ZP=has_zp, HAS_BIAS=has_bias,
        BLOCK_M=config.block_m, BLOCK_N=c2.block_n, BLOCK_K=bk2,
        K_SPAN=triton.cdiv(i // bk2, split) * bk2, ATOMIC=atomic,
        SCALE_AFTER=c2.scale_after, WORD_LAYOUT=words, USE_ASM=asm, DOT_F32=interpreted,
        num_warps=c2.num_warps, num_stages=c2.num_stages,
    )  # fmt: skip
    if atomic:
        result.copy_(acc)
    return result


# --- device code ------------------------------------------------------------------------------

# Four re-paired bytes ($4) -> the four low-nibble weights ($0, $1) and the four high-nibble
# weights ($2, $3), two 16-bit floats per register: bytes spread to half-words (prmt), the
# nibble ORed into the magic number's mantissa (lop3 (a & b) | c = 0xEA: magic + q exactly),
# then one packed subtract of magic + zero point ($5, $6) gives q - z exactly; the folded
# variant multiplies by the scale ($7, $8) too, rounding once.
_INT4_BITS = """
{
.reg .b32 t0, t1, t2, t3, zero;
mov.b32 zero, 0;
shr.u32 t3, $4, 4;
prmt.b32 t0, $4, zero, 0x4140;
prmt.b32 t1, $4, zero, 0x4342;
prmt.b32 t2, t3, zero, 0x4140;
prmt.b32 t3, t3, zero, 0x4342;
lop3.b32 t0, t0, 0x000F000F, MAGIC, 0xEA;
lop3.b32 t1, t1, 0x000F000F, MAGIC, 0xEA;
lop3.b32 t2, t2, 0x000F000F, MAGIC, 0xEA;
lop3.b32 t3, t3, 0x000F000F, MAGIC, 0xEA;
"""
_SUB = """sub.rn.TY $0, t0, $5;
sub.rn.TY $1, t1, $6;
sub.rn.TY $2, t2, $5;
sub.rn.TY $3, t3, $6;
}
"""
_SUB_MUL = """sub.rn.TY t0, t0, $5;
sub.rn.TY t1, t1, $6;
sub.rn.TY t2, t2, $5;
sub.rn.TY t3, t3, $6;
mul.rn.TY $0, t0, $7;
mul.rn.TY $1, t1, $8;
mul.rn.TY $2, t2, $7;
mul.rn.TY $3, t3, $8;
}
"""


def _asm(tail: str, magic: str, ty: str) -> tl.constexpr:
    return tl.constexpr((_INT4_BITS + tail).replace("MAGIC", magic).replace("TY", ty))


_INT4_SUB_BF16 = _asm(_SUB, "0x43004300", "bf16x2")
_INT4_SUB_F16 = _asm(_SUB, "0x64006400", "f16x2")
_INT4_SUB_MUL_BF16 = _asm(_SUB_MUL, "0x43004300", "bf16x2")
_INT4_SUB_MUL_F16 = _asm(_SUB_MUL, "0x64006400", "f16x2")
# Two consecutive words of the word layout ($8, $9) -> eight 16-bit float pairs ($0..$7): pair
# t holds nibble t of each word (inputs t·WORDS + w and + w + 1 of the chunk). One prmt puts
# byte i of both words into the two half-words, one lop3 keeps the low nibble and ORs in the
# magic number, a shift and a lop3 do the same for the high nibble; then magic + z ($10) is
# subtracted (and, folded, the scale $11 multiplied) on the packed pairs.
_WORD_BITS = """
{
.reg .b32 p0, p1, p2, p3, h0, h1, h2, h3;
prmt.b32 p0, $8, $9, 0x4400;
prmt.b32 p1, $8, $9, 0x5511;
prmt.b32 p2, $8, $9, 0x6622;
prmt.b32 p3, $8, $9, 0x7733;
shr.u32 h0, p0, 4;
shr.u32 h1, p1, 4;
shr.u32 h2, p2, 4;
shr.u32 h3, p3, 4;
lop3.b32 p0, p0, 0x000F000F, MAGIC, 0xEA;
lop3.b32 h0, h0, 0x000F000F, MAGIC, 0xEA;
lop3.b32 p1, p1, 0x000F000F, MAGIC, 0xEA;
lop3.b32 h1, h1, 0x000F000F, MAGIC, 0xEA;
lop3.b32 p2, p2, 0x000F000F, MAGIC, 0xEA;
lop3.b32 h2, h2, 0x000F000F, MAGIC, 0xEA;
lop3.b32 p3, p3, 0x000F000F, MAGIC, 0xEA;
lop3.b32 h3, h3, 0x000F000F, MAGIC, 0xEA;
"""
_WORD_SUB = """sub.rn.TY $0, p0, $10;
sub.rn.TY $1, h0, $10;
sub.rn.TY $2, p1, $10;
sub.rn.TY $3, h1, $10;
sub.rn.TY $4, p2, $10;
sub.rn.TY $5, h2, $10;
sub.rn.TY $6, p3, $10;
sub.rn.TY $7, h3, $10;
}
"""
_WORD_SUB_MUL = (
    "".join(
        f"sub.rn.TY {r}, {r}, $10;\nmul.rn.TY ${n}, {r}, $11;\n"
        for n, r in enumerate(("p0", "h0", "p1", "h1", "p2", "h2", "p3", "h3"))
    )
    + "}\n"
)


def _word_asm(tail: str, magic: str, ty: str) -> tl.constexpr:
    return tl.constexpr((_WORD_BITS + tail).replace("MAGIC", magic).replace("TY", ty))


_WORD_SUB_BF16 = _word_asm(_WORD_SUB, "0x43004300", "bf16x2")
_WORD_SUB_F16 = _word_asm(_WORD_SUB, "0x64006400", "f16x2")
_WORD_SUB_MUL_BF16 = _word_asm(_WORD_SUB_MUL, "0x43004300", "bf16x2")
_WORD_SUB_MUL_F16 = _word_asm(_WORD_SUB_MUL, "0x64006400", "f16x2")
_WORDS = tl.constexpr(WORDS)
_WORD_CHUNK = tl.constexpr(WORD_CHUNK)
#: The re-paired chunk and its half, as the kernels see them.
_CHUNK = tl.constexpr(CHUNK)
_HALF = tl.constexpr(CHUNK // 2)


@triton.jit
def _int4_halves(
    packed, z, s, OUT: tl.constexpr, SCALE_AFTER: tl.constexpr, USE_ASM: tl.constexpr,
    DOT_F32: tl.constexpr,
):  # fmt: skip
    """Re-paired bytes [BN, H] -> (low-nibble, high-nibble) weights, [BN, H] each: q - z
    (exact in 16 bits) with SCALE_AFTER, else (q - z)·s rounded to OUT.

    `z` (int32) and `s` (float32) are per-row [BN, 1]. With USE_ASM the bit-operation
    sequence above (where the scale is folded in, it is first rounded to OUT: exact when the
    scales are stored in the activation dtype); otherwise integer ops and float32 (the
    interpreter's path; with DOT_F32 the values stay float32, rounded to OUT)."""
    if USE_ASM:
        # (inline_asm_elementwise broadcasts the per-row [BN, 1] operands to the tile)
        if tl.float16 == OUT:
            zb = (z.to(tl.float32) + 1024.0).to(tl.float16)
            if SCALE_AFTER:
                lo, hi = tl.inline_asm_elementwise(
                    _INT4_SUB_F16, "=r,=r,=r,=r,r,r,r", [packed, zb],
                    dtype=(tl.float16, tl.float16), is_pure=True, pack=4,
                )  # fmt: skip
            else:
                lo, hi = tl.inline_asm_elementwise(
                    _INT4_SUB_MUL_F16, "=r,=r,=r,=r,r,r,r,r,r", [packed, zb, s.to(tl.float16)],
                    dtype=(tl.float16, tl.float16), is_pure=True, pack=4,
                )  # fmt: skip
        else:
            zb = (z.to(tl.float32) + 128.0).to(tl.bfloat16)
            if SCALE_AFTER:
                lo, hi = tl.inline_asm_elementwise(
                    _INT4_SUB_BF16, "=r,=r,=r,=r,r,r,r", [packed, zb],
                    dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
                )  # fmt: skip
            else:
                lo, hi = tl.inline_asm_elementwise(
                    _INT4_SUB_MUL_BF16, "=r,=r,=r,=r,r,r,r,r,r",
                    [packed, zb, s.to(tl.bfloat16)],
                    dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
                )  # fmt: skip
    else:
        q = packed.to(tl.int32)
        lo = _scaled((q & 0xF) - z, s, OUT, SCALE_AFTER, DOT_F32)
        hi = _scaled((q >> 4) - z, s, OUT, SCALE_AFTER, DOT_F32)
    return lo, hi


@triton.jit
def _word_pairs(
    words, z, s, OUT: tl.constexpr, SCALE_AFTER: tl.constexpr, USE_ASM: tl.constexpr,
    DOT_F32: tl.constexpr,
):  # fmt: skip
    """Word-layout codes [BN, WORDS] (int32) -> the chunk's eight weight tiles [BN, WORDS]
    (nibble t: inputs t·WORDS .. t·WORDS + WORDS - 1), as `_int4_halves` computes them."""
    if USE_ASM:
        if tl.float16 == OUT:
            zb = (z.to(tl.float32) + 1024.0).to(tl.float16)
            if SCALE_AFTER:
                w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
                    _WORD_SUB_F16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [words, zb],
                    dtype=(tl.float16,) * 8, is_pure=True, pack=2,
                )  # fmt: skip
            else:
                w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
                    _WORD_SUB_MUL_F16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r",
                    [words, zb, s.to(tl.float16)],
                    dtype=(tl.float16,) * 8, is_pure=True, pack=2,
                )  # fmt: skip
        else:
            zb = (z.to(tl.float32) + 128.0).to(tl.bfloat16)
            if SCALE_AFTER:
                w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
                    _WORD_SUB_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [words, zb],
                    dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2,
                )  # fmt: skip
            else:
                w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
                    _WORD_SUB_MUL_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r",
                    [words, zb, s.to(tl.bfloat16)],
                    dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2,
                )  # fmt: skip
    else:
        w0 = _scaled((words & 0xF) - z, s, OUT, SCALE_AFTER, DOT_F32)
        w1 = _scaled(((words >> 4) & 0xF) - z, s, OUT, SCALE_AFTER, DOT_F32)
        w2 = _scaled(((words >> 8) & 0xF) - z, s, OUT, SCALE_AFTER, DOT_F32)
        w3 = _scaled(((words >> 12) & 0xF) - z, s, OUT, SCALE_AFTER, DOT_F32)
        w4 = _scaled(((words >> 16) & 0xF) - z, s, OUT, SCALE_AFTER, DOT_F32)
        w5 = _scaled(((words >> 20) & 0xF) - z, s, OUT, SCALE_AFTER, DOT_F32)
        w6 = _scaled(((words >> 24) & 0xF) - z, s, OUT, SCALE_AFTER, DOT_F32)
        w7 = _scaled(((words >> 28) & 0xF) - z, s, OUT, SCALE_AFTER, DOT_F32)
    return w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _x_tile(x_base, x_mask, k, WIDTH: tl.constexpr):
    """The activations x[k .. k + WIDTH, tokens] ([WIDTH, BM])."""
    return tl.load(x_base + (k + tl.arange(0, WIDTH))[:, None], mask=x_mask, other=0.0)


@triton.jit
def _dot2(part_u, part_g, w_u, w_g, x, GATED: tl.constexpr, DOT_F32: tl.constexpr):
    """Both projections' products with one activation tile (gate and up interleaved, so a
    wait for one accumulator leaves the other's MMA in flight)."""
    part_u = _dot(w_u, x, part_u, DOT_F32)
    if GATED:
        part_g = _dot(w_g, x, part_g, DOT_F32)
    return part_u, part_g


@triton.jit
def _scaled(centered, s, OUT: tl.constexpr, SCALE_AFTER: tl.constexpr, DOT_F32: tl.constexpr):
    """int32 q - z -> the dot operand: q - z (SCALE_AFTER) or (q - z)·s, in OUT."""
    if SCALE_AFTER:
        w = round16(centered.to(tl.float32), OUT, DOT_F32)
    else:
        w = round16(centered.to(tl.float32) * s, OUT, DOT_F32)
    return w


@triton.jit
def _row_consts(s_e, z_e, rows, row_mask, g, stride_sg, stride_zg, BITS: tl.constexpr,
                HAS_ZP: tl.constexpr):  # fmt: skip
    """Per-row scale (float32) and zero point (int32) of group `g`, as [BN, 1] (the
    transposed [G, N] scales and one-byte zero points of `relayout`)."""
    s = tl.load(s_e + g * stride_sg + rows, mask=row_mask, other=0.0).to(tl.float32)
    if HAS_ZP:
        z = tl.load(z_e + g * stride_zg + rows, mask=row_mask, other=0).to(tl.int32)
    else:
        z = tl.full(rows.shape, 1 << (BITS - 1), tl.int32)
    return s[:, None], z[:, None]


@triton.jit
def _dot(w, x, acc, DOT_F32: tl.constexpr):
    if DOT_F32:
        acc = tl.dot(w, x.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(w, x, acc)
    return acc


@triton.jit
def _load_codes(q_e, rows, row_mask, offs, stride_qn):
    return tl.load(q_e + rows[:, None] * stride_qn + offs[None, :], mask=row_mask[:, None], other=0)


@triton.jit
def _k_step(
    acc_u, acc_g, q_e, rows_u, rows_g, row_mask, x_base, x_mask, kk, s_u, z_u, s_g, z_g,
    stride_qn,
    GATED: tl.constexpr, BITS: tl.constexpr, BLOCK_K: tl.constexpr, OUT: tl.constexpr,
    SCALE_AFTER: tl.constexpr, WORD_LAYOUT: tl.constexpr, USE_ASM: tl.constexpr,
    DOT_F32: tl.constexpr,
):  # fmt: skip
    """One K step of one or (GATED) two projections: acc [BN, BM] + w[rows, kk:kk+BLOCK_K]
    · x[kk:kk+BLOCK_K, tokens], with the step's per-row scales `s` and zero points `z`
    ([BN, 1]); `x_base` [1, BM] pointers to each token's row, `x_mask` [1, BM]. The
    activation tiles are loaded once for both projections. SCALE_AFTER multiplies the
    step's float32 partial products by the scales (one multiply-add per accumulator element
    and step) instead of every weight."""
    if SCALE_AFTER:
        part_u = tl.zeros(acc_u.shape, dtype=tl.float32)
        part_g = tl.zeros(acc_g.shape, dtype=tl.float32)
    else:
        part_u = acc_u
        part_g = acc_g
    if WORD_LAYOUT:
        wv = tl.arange(0, _WORDS)
        for c in tl.static_range(BLOCK_K // _WORD_CHUNK):
            offs = kk // 8 + c * _WORDS + wv
            u0, u1, u2, u3, u4, u5, u6, u7 = _word_pairs(
                _load_codes(q_e, rows_u, row_mask, offs, stride_qn), z_u, s_u, OUT,
                SCALE_AFTER, USE_ASM, DOT_F32,
            )  # fmt: skip
            if GATED:
                g0, g1, g2, g3, g4, g5, g6, g7 = _word_pairs(
                    _load_codes(q_e, rows_g, row_mask, offs, stride_qn), z_g, s_g, OUT,
                    SCALE_AFTER, USE_ASM, DOT_F32,
                )  # fmt: skip
            else:
                g0, g1, g2, g3, g4, g5, g6, g7 = u0, u1, u2, u3, u4, u5, u6, u7
            k = kk + c * _WORD_CHUNK
            part_u, part_g = _dot2(
                part_u, part_g, u0, g0, _x_tile(x_base, x_mask, k, _WORDS), GATED, DOT_F32
            )
            part_u, part_g = _dot2(
                part_u, part_g, u1, g1, _x_tile(x_base, x_mask, k + _WORDS, _WORDS), GATED,
                DOT_F32,
            )  # fmt: skip
            part_u, part_g = _dot2(
                part_u, part_g, u2, g2, _x_tile(x_base, x_mask, k + 2 * _WORDS, _WORDS), GATED,
                DOT_F32,
            )  # fmt: skip
            part_u, part_g = _dot2(
                part_u, part_g, u3, g3, _x_tile(x_base, x_mask, k + 3 * _WORDS, _WORDS), GATED,
                DOT_F32,
            )  # fmt: skip
            part_u, part_g = _dot2(
                part_u, part_g, u4, g4, _x_tile(x_base, x_mask, k + 4 * _WORDS, _WORDS), GATED,
                DOT_F32,
            )  # fmt: skip
            part_u, part_g = _dot2(
                part_u, part_g, u5, g5, _x_tile(x_base, x_mask, k + 5 * _WORDS, _WORDS), GATED,
                DOT_F32,
            )  # fmt: skip
            part_u, part_g = _dot2(
                part_u, part_g, u6, g6, _x_tile(x_base, x_mask, k + 6 * _WORDS, _WORDS), GATED,
                DOT_F32,
            )  # fmt: skip
            part_u, part_g = _dot2(
                part_u, part_g, u7, g7, _x_tile(x_base, x_mask, k + 7 * _WORDS, _WORDS), GATED,
                DOT_F32,
            )  # fmt: skip
    elif BITS == 4:
        j = tl.arange(0, BLOCK_K // 2)
        offs = kk // 2 + j
        u_lo, u_hi = _int4_halves(
            _load_codes(q_e, rows_u, row_mask, offs, stride_qn), z_u, s_u, OUT, SCALE_AFTER,
            USE_ASM, DOT_F32,
        )  # fmt: skip
        if GATED:
            g_lo, g_hi = _int4_halves(
                _load_codes(q_e, rows_g, row_mask, offs, stride_qn), z_g, s_g, OUT,
                SCALE_AFTER, USE_ASM, DOT_F32,
            )  # fmt: skip
        else:
            g_lo, g_hi = u_lo, u_hi
        # Low nibbles: inputs kk + c·CHUNK + b (b < CHUNK/2) of chunk c; high: + CHUNK/2.
        k_lo = kk + (j // _HALF) * _CHUNK + j % _HALF
        x_lo = tl.load(x_base + k_lo[:, None], mask=x_mask, other=0.0)
        x_hi = tl.load(x_base + (k_lo + _HALF)[:, None], mask=x_mask, other=0.0)
        part_u, part_g = _dot2(part_u, part_g, u_lo, g_lo, x_lo, GATED, DOT_F32)
        part_u, part_g = _dot2(part_u, part_g, u_hi, g_hi, x_hi, GATED, DOT_F32)
    else:
        offs = kk + tl.arange(0, BLOCK_K)
        w_u = _scaled(
            _load_codes(q_e, rows_u, row_mask, offs, stride_qn).to(tl.int32) - z_u, s_u, OUT,
            SCALE_AFTER, DOT_F32,
        )  # fmt: skip
        if GATED:
            w_g = _scaled(
                _load_codes(q_e, rows_g, row_mask, offs, stride_qn).to(tl.int32) - z_g, s_g,
                OUT, SCALE_AFTER, DOT_F32,
            )  # fmt: skip
        else:
            w_g = w_u
        x = _x_tile(x_base, x_mask, kk, BLOCK_K)
        part_u, part_g = _dot2(part_u, part_g, w_u, w_g, x, GATED, DOT_F32)
    if SCALE_AFTER:
        acc_u += part_u * s_u
        if GATED:
            acc_g += part_g * s_g
    else:
        acc_u = part_u
        acc_g = part_g
    return acc_u, acc_g


@triton.jit
def _next_group(kk, K: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """The group of the K step after `kk` (the last one's at the end: a harmless re-load)."""
    return tl.minimum(kk + BLOCK_K, K - 1) // GROUP


# The route counts vary with the batch: not specialized, so one compiled kernel serves every
# batch size of a layer and tile.
@triton.jit(do_not_specialize=["max_padded", "num_routes"])
def _moe_w13_rs_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, sorted_ptr, expert_ids_ptr,
    max_padded, num_routes, inter,
    stride_xm, stride_qe, stride_qn, stride_se, stride_sg, stride_ze, stride_zg, stride_be,
    stride_om, limit, alpha, beta,
    K: tl.constexpr, TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
    HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SCALE_AFTER: tl.constexpr, WORD_LAYOUT: tl.constexpr,
    USE_ASM: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """act(w13·xᵀ + b)ᵀ for one block of routes (one expert) and BLOCK_N columns of I."""
    expert, route = block_routes(expert_ids_ptr, sorted_ptr, max_padded, num_routes, BLOCK_M)
    if expert < 0:
        return
    pid_n = tl.program_id(1)
    m_mask, token, cols, n_mask = route_tile(route, pid_n, num_routes, inter, TOP_K, BLOCK_N)
    gate_rows, up_rows = w13_rows(cols, inter, GATED, INTERLEAVED)
    q_e, s_e, z_e = expert_weights(q_ptr, s_ptr, z_ptr, expert, stride_qe, stride_se, stride_ze)
    OUT = out_ptr.dtype.element_ty
    x_base = x_ptr + (token * stride_xm)[None, :]
    x_mask = m_mask[None, :]
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if GATED:
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    # Scales and zero points are 2-byte vectors the pipeliner does not copy ahead: each
    # step loads the next step's, so their latency hides behind this step's work.
    s_u, z_u = _row_consts(s_e, z_e, up_rows, n_mask, 0, stride_sg, stride_zg, BITS, HAS_ZP)
    if GATED:
        s_g, z_g = _row_consts(s_e, z_e, gate_rows, n_mask, 0, stride_sg, stride_zg, BITS, HAS_ZP)
    else:
        gate_rows, acc_g, s_g, z_g = up_rows, acc_u, s_u, z_u
    for kk in range(0, K, BLOCK_K):
        g_next = _next_group(kk, K, BLOCK_K, GROUP)
        s_un, z_un = _row_consts(
            s_e, z_e, up_rows, n_mask, g_next, stride_sg, stride_zg, BITS, HAS_ZP
        )
        if GATED:
            s_gn, z_gn = _row_consts(
                s_e, z_e, gate_rows, n_mask, g_next, stride_sg, stride_zg, BITS, HAS_ZP
            )
        else:
            s_gn, z_gn = s_un, z_un
        acc_u, acc_g = _k_step(
            acc_u, acc_g, q_e, up_rows, gate_rows, n_mask, x_base, x_mask, kk, s_u, z_u, s_g,
            z_g, stride_qn, GATED, BITS, BLOCK_K, OUT, SCALE_AFTER, WORD_LAYOUT, USE_ASM,
            DOT_F32,
        )  # fmt: skip
        s_u, z_u, s_g, z_g = s_un, z_un, s_gn, z_gn
    if HAS_BIAS:
        b_e = bias_ptr + expert * stride_be
        acc_u += tl.load(b_e + up_rows, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        if GATED:
            acc_g += tl.load(b_e + gate_rows, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    if GATED:
        h = gated_activation(acc_g, acc_u, limit, alpha, beta, ACT)
    else:
        h = plain_activation(acc_u, ACT)
    h = round16(h, OUT, DOT_F32)
    out_ptrs = out_ptr + (route.to(tl.int64) * stride_om)[None, :] + cols[:, None]
    tl.store(out_ptrs, h.to(OUT), mask=n_mask[:, None] & m_mask[None, :])


@triton.jit(do_not_specialize=["max_padded", "num_routes"])
def _moe_w2_rs_kernel(
    a_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, topk_w_ptr, out_ptr, sorted_ptr, expert_ids_ptr,
    max_padded, num_routes, hidden,
    stride_am, stride_qe, stride_qn, stride_se, stride_sg, stride_ze, stride_zg, stride_be,
    stride_om,
    K: tl.constexpr, TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
    HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_SPAN: tl.constexpr,
    ATOMIC: tl.constexpr, SCALE_AFTER: tl.constexpr, WORD_LAYOUT: tl.constexpr,
    USE_ASM: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """weight·(w2·interᵀ + b)ᵀ for one block of routes, BLOCK_N columns of H and one K
    split, added into each token's output row (the top-k sum)."""
    expert, route = block_routes(expert_ids_ptr, sorted_ptr, max_padded, num_routes, BLOCK_M)
    if expert < 0:
        return
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    m_mask, token, cols, n_mask = route_tile(route, pid_n, num_routes, hidden, TOP_K, BLOCK_N)
    q_e, s_e, z_e = expert_weights(q_ptr, s_ptr, z_ptr, expert, stride_qe, stride_se, stride_ze)
    OUT = a_ptr.dtype.element_ty
    a_base = a_ptr + (route.to(tl.int64) * stride_am)[None, :]
    a_mask = m_mask[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_lo = pid_k * K_SPAN
    s, z = _row_consts(s_e, z_e, cols, n_mask, k_lo // GROUP, stride_sg, stride_zg, BITS, HAS_ZP)
    for kk in range(k_lo, tl.minimum(k_lo + K_SPAN, K), BLOCK_K):
        s_n, z_n = _row_consts(
            s_e, z_e, cols, n_mask, _next_group(kk, K, BLOCK_K, GROUP), stride_sg, stride_zg,
            BITS, HAS_ZP,
        )  # fmt: skip
        acc, _ = _k_step(
            acc, acc, q_e, cols, cols, n_mask, a_base, a_mask, kk, s, z, s, z, stride_qn,
            False, BITS, BLOCK_K, OUT, SCALE_AFTER, WORD_LAYOUT, USE_ASM, DOT_F32,
        )  # fmt: skip
        s, z = s_n, z_n
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_be + cols, mask=n_mask & (pid_k == 0), other=0.0)
        acc += bias.to(tl.float32)[:, None]
    acc *= tl.load(topk_w_ptr + route, mask=m_mask, other=0.0)[None, :]
    out_ptrs = out_ptr + (token * stride_om)[None, :] + cols[:, None]
    mask = n_mask[:, None] & m_mask[None, :]
    store_topk_sum(out_ptr, out_ptrs, acc, mask, ATOMIC, DOT_F32)
