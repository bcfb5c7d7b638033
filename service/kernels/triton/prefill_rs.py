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
  the weights are in our re-paired layout (relayout.py): the low nibbles of a byte tile are
  the first half of each 32-input chunk, the high nibbles the second, each half a contiguous
  run of activations. So each K sub-step is two dots, `w_lo·x_lo + w_hi·x_hi`, and the
  chain from the byte load to the dot is elementwise: Triton copies the *codes* (4 bits
  per weight) to shared memory asynchronously and dequantizes them in the dot-operand
  registers (its dot-operand hoisting, triton-lang/triton#5003).
* **Bit-operation dequantization** (`USE_ASM`, compiled only): four bytes at a time, two
  `prmt`, a shift and four `lop3` make the eight codes 16-bit floats 128 + q (bf16, magic
  exponent 0x4300) or 1024 + q (fp16, 0x6400) with no conversion instruction, then one
  packed subtract of (magic + zero point) and one packed multiply by the group scale per two
  weights. (q - z) is exact in 16 bits and its product with the scale is rounded once, so
  the weights equal `prefill.py`'s (float32 arithmetic, rounded to 16 bits).
* **Group-wise steps.** A K step of BLOCK_K inputs is unrolled into sub-steps of
  SUB = min(BLOCK_K, group) inputs, so each sub-step needs one scale and one zero point per
  weight row ([BLOCK_N] vectors, broadcast along K in registers).

int8 codes keep TRITON's layout (no nibbles) and one tile per sub-step, dequantized by
ordinary integer and float operations (also elementwise). Requirements beyond the TRITON
layout's: K of both GEMMs and the group a multiple of 32 (`supports`); other layers stay on
`prefill.py`.
"""

# Triton idiom: compile-time parameters are UPPER_CASE, kernels take many arguments and
# constexpr branches stay statements (not conditional expressions);
# @triton.jit device functions are untyped (triton has no type information).
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# ruff: noqa: N803, N806, PLR0917

from __future__ import annotations

import torch
import triton
import triton.language as tl

from service.kernels.activation import ResolvedActivation
from service.kernels.align import align_block_size
from service.kernels.interface import LayerSpec
from service.kernels.triton.config import KernelConfig
from service.kernels.triton.jit import gated_activation, plain_activation, round16
from service.kernels.triton.relayout import CHUNK, repair_int4
from service.triton_runtime import interpreting

#: Smallest K step: one re-paired chunk (two 16-input dots, wgmma's K for 16-bit operands).
MIN_SUB = CHUNK


def supports(spec: LayerSpec) -> bool:
    """Whether these kernels take the layer: both K a multiple of the chunk, the group too."""
    group_ok = spec.group_size == -1 or spec.group_size % CHUNK == 0
    return group_ok and spec.hidden_size % CHUNK == 0 and spec.intermediate_size % CHUNK == 0


def relayout(t: dict[str, torch.Tensor], spec: LayerSpec) -> dict[str, torch.Tensor]:
    """The tensors these kernels read, made from TRITON's on their device: int4 codes
    re-paired (relayout.py); scales [E, N, G] transposed to [E, G, N] and zero points
    unpacked to one byte per row, [E, G, N], so that a K step's per-row scales and zero
    points are one contiguous vector (an asynchronous copy, pipelined with the codes)."""
    out = dict(t)
    for name in ("w13", "w2"):
        if spec.bits == 4:
            out[f"{name}_qweight"] = repair_int4(t[f"{name}_qweight"])
        out[f"{name}_scales"] = t[f"{name}_scales"].transpose(1, 2).contiguous()
        zeros = t.get(f"{name}_qzeros")
        if zeros is not None:
            if spec.bits == 4:
                zeros = torch.stack((zeros & 0xF, zeros >> 4), dim=2).flatten(1, 2)
            out[f"{name}_qzeros"] = zeros.transpose(1, 2).contiguous()
    return out


def fit_k_step(block_k: int, k: int, group: int) -> int:
    """The K step for a configured K tile: the largest power of two <= block_k and <= the
    group that divides K and is at least `MIN_SUB` (each step then reads one scale and one
    zero point per weight row)."""
    bk = 1 << (min(block_k, group).bit_length() - 1)
    while bk > MIN_SUB and (k % bk or group % bk):
        bk //= 2
    if bk < MIN_SUB or k % bk or group % bk:
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
    bk1 = fit_k_step(c1.block_k, h, g13)
    _moe_w13_rs_kernel[(max_blocks, triton.cdiv(i, c1.block_n))](
        x, q13, s13, z13, b13, inter, aligned.sorted_ids, aligned.expert_ids,
        aligned.sorted_ids.numel(), num_routes, i,
        x.stride(0), q13.stride(0), q13.stride(1), s13.stride(0), s13.stride(1),
        z13.stride(0), z13.stride(1), b13.stride(0), inter.stride(0),
        act.limit, act.alpha, act.beta,
        K=h, TOP_K=top_k, BITS=spec.bits, GROUP=g13, HAS_ZP=has_zp, HAS_BIAS=has_bias,
        ACT=act.code, GATED=act.gated, INTERLEAVED=act.interleaved,
        BLOCK_M=config.block_m, BLOCK_N=c1.block_n, BLOCK_K=bk1,
        SCALE_AFTER=c1.scale_after, USE_ASM=asm, DOT_F32=interpreted,
        num_warps=c1.num_warps, num_stages=c1.num_stages,
    )  # fmt: skip
    c2 = config.w2
    g2 = i if spec.group_size == -1 else spec.group_size
    bk2 = fit_k_step(c2.block_k, i, g2)
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
        SCALE_AFTER=c2.scale_after, USE_ASM=asm, DOT_F32=interpreted,
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
def _k_step(
    acc, q_e, rows, row_mask, x_base, x_mask, kk, s, z, stride_qn,
    BITS: tl.constexpr, BLOCK_K: tl.constexpr, OUT: tl.constexpr, SCALE_AFTER: tl.constexpr,
    USE_ASM: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """acc [BN, BM] + w[rows, kk:kk+BLOCK_K] · x[kk:kk+BLOCK_K, tokens] with this step's
    per-row scale `s` and zero point `z` ([BN, 1]); `x_base` [1, BM] pointers to each
    token's row, `x_mask` [1, BM]. SCALE_AFTER multiplies the step's float32 partial
    product by the scale (one multiply-add per accumulator element and step) instead of
    every weight."""
    if SCALE_AFTER:
        part = tl.zeros(acc.shape, dtype=tl.float32)
    else:
        part = acc
    if BITS == 4:
        j = tl.arange(0, BLOCK_K // 2)
        packed = tl.load(
            q_e + rows[:, None] * stride_qn + (kk // 2 + j)[None, :], mask=row_mask[:, None],
            other=0,
        )
        # Low nibbles: inputs kk + c·CHUNK + b (b < CHUNK/2) of chunk c; high: + CHUNK/2.
        k_lo = kk + (j // _HALF) * _CHUNK + j % _HALF
        x_lo = tl.load(x_base + k_lo[:, None], mask=x_mask, other=0.0)
        x_hi = tl.load(x_base + (k_lo + _HALF)[:, None], mask=x_mask, other=0.0)
        w_lo, w_hi = _int4_halves(packed, z, s, OUT, SCALE_AFTER, USE_ASM, DOT_F32)
        part = _dot(w_lo, x_lo, part, DOT_F32)
        part = _dot(w_hi, x_hi, part, DOT_F32)
    else:
        j = tl.arange(0, BLOCK_K)
        codes = tl.load(
            q_e + rows[:, None] * stride_qn + (kk + j)[None, :], mask=row_mask[:, None], other=0
        )
        xs = tl.load(x_base + (kk + j)[:, None], mask=x_mask, other=0.0)
        w = _scaled(codes.to(tl.int32) - z, s, OUT, SCALE_AFTER, DOT_F32)
        part = _dot(w, xs, part, DOT_F32)
    if SCALE_AFTER:
        acc += part * s
    else:
        acc = part
    return acc


@triton.jit
def _next_group(kk, K: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """The group of the K step after `kk` (the last one's at the end: a harmless re-load)."""
    return tl.minimum(kk + BLOCK_K, K - 1) // GROUP


@triton.jit
def _block_routes(expert_ids_ptr, sorted_ptr, max_padded, num_routes, BLOCK_M: tl.constexpr):
    """This program's expert (-1: a block past the end) and its BLOCK_M routes."""
    pid_m = tl.program_id(0)
    expert = tl.load(expert_ids_ptr + pid_m)
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    route = tl.load(sorted_ptr + slots, mask=slots < max_padded, other=num_routes)
    return expert.to(tl.int64), route


@triton.jit
def _moe_w13_rs_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, sorted_ptr, expert_ids_ptr,
    max_padded, num_routes, inter,
    stride_xm, stride_qe, stride_qn, stride_se, stride_sg, stride_ze, stride_zg, stride_be,
    stride_om, limit, alpha, beta,
    K: tl.constexpr, TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
    HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SCALE_AFTER: tl.constexpr, USE_ASM: tl.constexpr,
    DOT_F32: tl.constexpr,
):  # fmt: skip
    """act(w13·xᵀ + b)ᵀ for one block of routes (one expert) and BLOCK_N columns of I."""
    expert, route = _block_routes(expert_ids_ptr, sorted_ptr, max_padded, num_routes, BLOCK_M)
    if expert < 0:
        return
    pid_n = tl.program_id(1)
    m_mask = route < num_routes
    token = (route // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < inter
    if GATED:
        if INTERLEAVED:
            gate_rows = 2 * cols
            up_rows = 2 * cols + 1
        else:
            gate_rows = cols
            up_rows = cols + inter
    else:
        up_rows = cols
    q_e = q_ptr + expert * stride_qe
    s_e = s_ptr + expert * stride_se
    z_e = z_ptr + expert * stride_ze
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
    for kk in range(0, K, BLOCK_K):
        g_next = _next_group(kk, K, BLOCK_K, GROUP)
        s_un, z_un = _row_consts(
            s_e, z_e, up_rows, n_mask, g_next, stride_sg, stride_zg, BITS, HAS_ZP
        )
        acc_u = _k_step(
            acc_u, q_e, up_rows, n_mask, x_base, x_mask, kk, s_u, z_u, stride_qn,
            BITS, BLOCK_K, OUT, SCALE_AFTER, USE_ASM, DOT_F32,
        )  # fmt: skip
        s_u, z_u = s_un, z_un
        if GATED:
            s_gn, z_gn = _row_consts(
                s_e, z_e, gate_rows, n_mask, g_next, stride_sg, stride_zg, BITS, HAS_ZP
            )
            acc_g = _k_step(
                acc_g, q_e, gate_rows, n_mask, x_base, x_mask, kk, s_g, z_g, stride_qn,
                BITS, BLOCK_K, OUT, SCALE_AFTER, USE_ASM, DOT_F32,
            )  # fmt: skip
            s_g, z_g = s_gn, z_gn
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


@triton.jit
def _moe_w2_rs_kernel(
    a_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, topk_w_ptr, out_ptr, sorted_ptr, expert_ids_ptr,
    max_padded, num_routes, hidden,
    stride_am, stride_qe, stride_qn, stride_se, stride_sg, stride_ze, stride_zg, stride_be,
    stride_om,
    K: tl.constexpr, TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
    HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_SPAN: tl.constexpr,
    ATOMIC: tl.constexpr, SCALE_AFTER: tl.constexpr, USE_ASM: tl.constexpr,
    DOT_F32: tl.constexpr,
):  # fmt: skip
    """weight·(w2·interᵀ + b)ᵀ for one block of routes, BLOCK_N columns of H and one K
    split, added into each token's output row (the top-k sum)."""
    expert, route = _block_routes(expert_ids_ptr, sorted_ptr, max_padded, num_routes, BLOCK_M)
    if expert < 0:
        return
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    m_mask = route < num_routes
    token = (route // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < hidden
    q_e = q_ptr + expert * stride_qe
    s_e = s_ptr + expert * stride_se
    z_e = z_ptr + expert * stride_ze
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
        acc = _k_step(
            acc, q_e, cols, n_mask, a_base, a_mask, kk, s, z, stride_qn,
            BITS, BLOCK_K, OUT, SCALE_AFTER, USE_ASM, DOT_F32,
        )  # fmt: skip
        s, z = s_n, z_n
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_be + cols, mask=n_mask & (pid_k == 0), other=0.0)
        acc += bias.to(tl.float32)[:, None]
    acc *= tl.load(topk_w_ptr + route, mask=m_mask, other=0.0)[None, :]
    out_ptrs = out_ptr + (token * stride_om)[None, :] + cols[:, None]
    mask = n_mask[:, None] & m_mask[None, :]
    if ATOMIC:
        tl.atomic_add(out_ptrs, acc, mask=mask, sem="relaxed")
    else:
        out_dtype = out_ptr.dtype.element_ty
        tl.store(out_ptrs, round16(acc, out_dtype, DOT_F32).to(out_dtype), mask=mask)
