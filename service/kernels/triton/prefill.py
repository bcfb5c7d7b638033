"""The prefill kernels of our Triton WNA16 MoE forward (TRITON weight layout).

Two GEMM kernels and an alignment, with nothing between them that a CUDA graph cannot hold
(no host synchronisation; grids sized for the worst case, surplus programs return early):

1. `align_block_size`: routes grouped by expert in blocks of BLOCK_M (align.py).
2. `_moe_w13_kernel`: for one block of routes (one expert) and BLOCK_N intermediate
   columns, the gate tile and the up tile of x·w13ᵀ in two float32 accumulators, then bias
   and the activation in the epilogue, stored once as the [M·k, I] intermediate. No
   pre-activation [M·k, 2I] tensor is written or read back.
3. `_moe_w2_kernel`: intermediate·w2ᵀ, bias, times the router weight, and the sum over the
   k experts of each token fused in: float32 atomic adds into the [M, H] output (split-K
   partials add the same way), cast to the activation dtype at the end. With top-1 routing
   and no split-K each output row has one writer and is stored directly.

Why this shape of kernel (bench/KERNEL_NOTES.md has the measurements of each choice):

* weights are dequantized once per tile, not per element: the packed [BLOCK_N, BLOCK_K/2]
  bytes are loaded row-contiguous (wide loads), the nibbles split with two integer ops and
  a join, and turned into exact floats with the 2^23 magic-number trick (an OR and a
  subtract, no int->float conversion instruction);
* scales and zero points are loaded once per (row, group) in the tile: a [BLOCK_N] vector
  when the group spans the K tile, a [BLOCK_N, BLOCK_K/group] tile broadcast over the group
  otherwise, never one load per element;
* `tl.dot` on 16-bit operands (wgmma where the tile allows it), float32 accumulation; swap-AB
  tiles (weights as the MMA's 64-row left operand) where few routes share an expert;
* split-K in the down projection where there are too few (block, N-tile) programs to fill
  the GPU, whose partials the fused top-k reduction absorbs for free.

Tiles come from `KernelConfig` (the tuned table or `config.choose_config`).
"""

# Triton idiom: compile-time parameters are UPPER_CASE, kernels take many arguments and
# constexpr branches stay statements (not conditional expressions);
# @triton.jit device functions are untyped (triton has no type information).
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# ruff: noqa: N803, PLR0917, SIM108

from __future__ import annotations

import torch
import triton
import triton.language as tl

from service.kernels.activation import ResolvedActivation
from service.kernels.align import align_block_size
from service.kernels.interface import LayerSpec
from service.kernels.triton.config import KernelConfig, launch_k_tile
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


def fused_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    t: dict[str, torch.Tensor],
    spec: LayerSpec,
    act: ResolvedActivation,
    config: KernelConfig,
    poison: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The whole forward (launches only; no host synchronisation), into `out` if given."""
    m, top_k = topk_ids.shape
    h, i = spec.hidden_size, spec.intermediate_size
    aligned = align_block_size(topk_ids, config.block_m, spec.num_experts)
    max_blocks = aligned.expert_ids.numel()
    num_routes = m * top_k
    inter = torch.empty((num_routes, i), dtype=x.dtype, device=x.device)
    if poison:
        inter.fill_(float("nan"))
    has_zp, has_bias = spec.has_zero_points, spec.has_bias
    dummy = t["w13_scales"]  # a valid pointer for absent optional tensors (never read)
    q13, s13 = t["w13_qweight"], t["w13_scales"]
    z13 = t.get("w13_qzeros", dummy)
    b13 = t.get("w13_bias", dummy)
    c1 = config.w13
    g13 = h if spec.group_size == -1 else spec.group_size
    k1 = launch_k_tile(c1.block_k, h, g13)
    _moe_w13_kernel[(max_blocks, triton.cdiv(i, c1.block_n))](
        x,
        q13,
        s13,
        z13,
        b13,
        inter,
        aligned.sorted_ids,
        aligned.expert_ids,
        aligned.sorted_ids.numel(),
        num_routes,
        i,
        x.stride(0),
        q13.stride(0),
        q13.stride(1),
        s13.stride(0),
        s13.stride(1),
        z13.stride(0),
        z13.stride(1),
        b13.stride(0),
        inter.stride(0),
        act.limit,
        act.alpha,
        act.beta,
        K=h,
        TOP_K=top_k,
        BITS=spec.bits,
        GROUP=g13,
        HAS_ZP=has_zp,
        HAS_BIAS=has_bias,
        ACT=act.code,
        GATED=act.gated,
        INTERLEAVED=act.interleaved,
        BLOCK_M=config.block_m,
        BLOCK_N=c1.block_n,
        BLOCK_K=k1.block_k,
        SWAP_AB=c1.swap_ab,
        DOT_F32=k1.dot_f32,
        num_warps=c1.num_warps,
        num_stages=c1.num_stages,
    )
    c2 = config.w2
    g2 = i if spec.group_size == -1 else spec.group_size
    k2 = launch_k_tile(c2.block_k, i, g2)
    atomic = top_k > 1 or c2.split_k > 1
    result = torch.empty_like(x) if out is None else out
    # The top-k sum (and split-K partials) accumulate in float32; one writer needs none.
    acc = torch.zeros((m, h), dtype=torch.float32, device=x.device) if atomic else result
    q2, s2 = t["w2_qweight"], t["w2_scales"]
    z2 = t.get("w2_qzeros", dummy)
    b2 = t.get("w2_bias", dummy)
    _moe_w2_kernel[(max_blocks, triton.cdiv(h, c2.block_n), c2.split_k)](
        inter,
        q2,
        s2,
        z2,
        b2,
        topk_weights,
        acc,
        aligned.sorted_ids,
        aligned.expert_ids,
        aligned.sorted_ids.numel(),
        num_routes,
        h,
        inter.stride(0),
        q2.stride(0),
        q2.stride(1),
        s2.stride(0),
        s2.stride(1),
        z2.stride(0),
        z2.stride(1),
        b2.stride(0),
        acc.stride(0),
        K=i,
        TOP_K=top_k,
        BITS=spec.bits,
        GROUP=g2,
        HAS_ZP=has_zp,
        HAS_BIAS=has_bias,
        BLOCK_M=config.block_m,
        BLOCK_N=c2.block_n,
        BLOCK_K=k2.block_k,
        K_SPAN=triton.cdiv(i, c2.split_k * k2.block_k) * k2.block_k,
        ATOMIC=atomic,
        SWAP_AB=c2.swap_ab,
        DOT_F32=k2.dot_f32,
        num_warps=c2.num_warps,
        num_stages=c2.num_stages,
    )
    if atomic:
        result.copy_(acc)
    return result


# --- device code ------------------------------------------------------------------------------


@triton.jit
def _zero_points(
    z_ptr, rows, row_mask, groups, stride_zn, BITS: tl.constexpr, HAS_ZP: tl.constexpr
):
    """2^23 + zero point, float32, for `rows` [BN] x `groups` (any broadcastable shape)."""
    if HAS_ZP:
        if BITS == 4:
            packed = tl.load(z_ptr + (rows // 2) * stride_zn + groups, mask=row_mask, other=0)
            zp = (packed.to(tl.int32) >> ((rows % 2) * 4)) & 0xF
        else:
            zp = tl.load(z_ptr + rows * stride_zn + groups, mask=row_mask, other=0).to(tl.int32)
        z = zp.to(tl.float32) + 8388608.0
    else:
        z = tl.full(groups.shape, 8388608.0 + (1 << (BITS - 1)), tl.float32)
    return z


@triton.jit
def _dequant_tile(
    q_ptr,
    s_ptr,
    z_ptr,
    rows,
    row_mask,
    k0,
    stride_qn,
    stride_sn,
    stride_zn,
    K: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    OUT: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """[BLOCK_N, BLOCK_K] weights (q - zp)·scale of `rows`, inputs k0 .. k0+BLOCK_K.

    Where BLOCK_K does not divide K the last tile runs past it: codes, scales and zero points
    past K are not read; the weights there are finite (zero codes, or zero scales) and meet
    zero activations.

    The pointers are already offset to the expert. Codes become exact float32 values as
    2^23 + q (OR the code into the mantissa of 2^23) and the zero point is folded into the
    subtracted constant, so no int->float conversion instruction runs.
    """
    if BITS == 4:
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        q_mask = row_mask[:, None]
        if K % BLOCK_K != 0:
            q_mask = q_mask & (kb[None, :] < K // 2)
        packed = tl.load(q_ptr + rows[:, None] * stride_qn + kb[None, :], mask=q_mask, other=0)
        q = tl.join(packed & 0xF, packed >> 4).reshape(BLOCK_N, BLOCK_K)
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        q_mask = row_mask[:, None]
        if K % BLOCK_K != 0:
            q_mask = q_mask & (kk[None, :] < K)
        q = tl.load(q_ptr + rows[:, None] * stride_qn + kk[None, :], mask=q_mask, other=0)
    qf = (q.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True)
    if GROUP >= BLOCK_K:
        g = k0 // GROUP + tl.zeros([BLOCK_N], dtype=tl.int32)
        s = tl.load(s_ptr + rows * stride_sn + g, mask=row_mask, other=0).to(tl.float32)
        z = _zero_points(z_ptr, rows, row_mask, g, stride_zn, BITS, HAS_ZP)
        w = (qf - z[:, None]) * s[:, None]
    else:
        g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        g2 = g[None, :] + tl.zeros([BLOCK_N, BLOCK_K // GROUP], dtype=tl.int32)
        rows2 = rows[:, None] + tl.zeros([BLOCK_N, BLOCK_K // GROUP], dtype=tl.int32)
        mask2 = row_mask[:, None] & (g2 >= 0)
        if K % BLOCK_K != 0:
            mask2 = mask2 & (g2 < K // GROUP)
        s = tl.load(s_ptr + rows2 * stride_sn + g2, mask=mask2, other=0).to(tl.float32)
        z = _zero_points(z_ptr, rows2, mask2, g2, stride_zn, BITS, HAS_ZP)
        w3 = qf.reshape(BLOCK_N, BLOCK_K // GROUP, GROUP)
        w = ((w3 - z[:, :, None]) * s[:, :, None]).reshape(BLOCK_N, BLOCK_K)
    return round16(w, OUT, DOT_F32)


@triton.jit
def _mma(a, w, acc, SWAP_AB: tl.constexpr, DOT_F32: tl.constexpr):
    """acc + a·wᵀ ([BLOCK_M, BLOCK_N]), or with SWAP_AB acc + w·a (`a` loaded as
    [BLOCK_K, BLOCK_M]; result [BLOCK_N, BLOCK_M]). The interpreter multiplies bfloat16 dot
    operands as raw integers, so there the operands go in as float32 (`w` is already
    float32, rounded by `round16`)."""
    if DOT_F32:
        a = a.to(tl.float32)
    if SWAP_AB:
        if DOT_F32:
            acc = tl.dot(w, a, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, a, acc)
    elif DOT_F32:
        acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, tl.trans(w), acc)
    return acc


@triton.jit
def _moe_w13_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    bias_ptr,
    out_ptr,
    sorted_ptr,
    expert_ids_ptr,
    max_padded,
    num_routes,
    inter,
    stride_xm,
    stride_qe,
    stride_qn,
    stride_se,
    stride_sn,
    stride_ze,
    stride_zn,
    stride_be,
    stride_om,
    limit,
    alpha,
    beta,
    K: tl.constexpr,
    TOP_K: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """act(x·w13ᵀ + b) for one block of routes (one expert) and BLOCK_N columns of I.

    SWAP_AB computes the transposed tile (w13·xᵀ, [BLOCK_N, BLOCK_M]): the dequantized
    weights are then the MMA's left operand, which Hopper's wgmma reads from registers (no
    shared-memory round trip for the big operand) and whose 64-row minimum the weight tile
    fills while a decode block holds only a few tokens.
    """
    expert, route = block_routes(expert_ids_ptr, sorted_ptr, max_padded, num_routes, BLOCK_M)
    if expert < 0:
        return
    pid_n = tl.program_id(1)
    m_mask, token, cols, n_mask = route_tile(route, pid_n, num_routes, inter, TOP_K, BLOCK_N)
    gate_rows, up_rows = w13_rows(cols, inter, GATED, INTERLEAVED)
    q_e, s_e, z_e = expert_weights(q_ptr, s_ptr, z_ptr, expert, stride_qe, stride_se, stride_ze)
    out_dtype = out_ptr.dtype.element_ty
    offs_k = tl.arange(0, BLOCK_K)
    if SWAP_AB:
        a_ptrs = x_ptr + token[None, :] * stride_xm + offs_k[:, None]  # [BLOCK_K, BLOCK_M]
        a_mask = m_mask[None, :]
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        a_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        a_mask = m_mask[:, None]
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if GATED:
        acc_g = tl.zeros_like(acc_u)
    for k0 in range(0, K, BLOCK_K):
        a = _load_a(a_ptrs, a_mask, offs_k, k0, K, BLOCK_K, SWAP_AB)
        w_u = _dequant_tile(
            q_e, s_e, z_e, up_rows, n_mask, k0, stride_qn, stride_sn, stride_zn,
            K, BITS, GROUP, HAS_ZP, BLOCK_N, BLOCK_K, out_dtype, DOT_F32,
        )  # fmt: skip
        acc_u = _mma(a, w_u, acc_u, SWAP_AB, DOT_F32)
        if GATED:
            w_g = _dequant_tile(
                q_e, s_e, z_e, gate_rows, n_mask, k0, stride_qn, stride_sn, stride_zn,
                K, BITS, GROUP, HAS_ZP, BLOCK_N, BLOCK_K, out_dtype, DOT_F32,
            )  # fmt: skip
            acc_g = _mma(a, w_g, acc_g, SWAP_AB, DOT_F32)
    if HAS_BIAS:
        b_e = bias_ptr + expert * stride_be
        b_u = tl.load(b_e + up_rows, mask=n_mask, other=0.0).to(tl.float32)
        acc_u += _along_n(b_u, SWAP_AB)
        if GATED:
            b_g = tl.load(b_e + gate_rows, mask=n_mask, other=0.0).to(tl.float32)
            acc_g += _along_n(b_g, SWAP_AB)
    if GATED:
        h = gated_activation(acc_g, acc_u, limit, alpha, beta, ACT)
    else:
        h = plain_activation(acc_u, ACT)
    h = round16(h, out_dtype, DOT_F32)
    row = route.to(tl.int64) * stride_om
    if SWAP_AB:
        out_ptrs = out_ptr + row[None, :] + cols[:, None]
        mask = n_mask[:, None] & m_mask[None, :]
    else:
        out_ptrs = out_ptr + row[:, None] + cols[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
    tl.store(out_ptrs, h.to(out_dtype), mask=mask)


@triton.jit
def _load_a(
    a_ptrs, a_mask, offs_k, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr
):
    """The activation tile at k0 ([BLOCK_M, BLOCK_K], SWAP_AB [BLOCK_K, BLOCK_M]), zero past
    K where the last tile runs over (BLOCK_K does not divide K)."""
    mask = a_mask
    if K % BLOCK_K != 0:
        if SWAP_AB:
            mask = mask & (k0 + offs_k[:, None] < K)
        else:
            mask = mask & (k0 + offs_k[None, :] < K)
    return tl.load(a_ptrs + k0, mask=mask, other=0.0)


@triton.jit
def _along_n(v, SWAP_AB: tl.constexpr):
    """A per-column [BLOCK_N] vector broadcast over the accumulator's route axis."""
    if SWAP_AB:
        r = v[:, None]
    else:
        r = v[None, :]
    return r


@triton.jit
def _along_m(v, SWAP_AB: tl.constexpr):
    """A per-route [BLOCK_M] vector broadcast over the accumulator's column axis."""
    if SWAP_AB:
        r = v[None, :]
    else:
        r = v[:, None]
    return r


@triton.jit
def _moe_w2_kernel(
    a_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    bias_ptr,
    topk_w_ptr,
    out_ptr,
    sorted_ptr,
    expert_ids_ptr,
    max_padded,
    num_routes,
    hidden,
    stride_am,
    stride_qe,
    stride_qn,
    stride_se,
    stride_sn,
    stride_ze,
    stride_zn,
    stride_be,
    stride_om,
    K: tl.constexpr,
    TOP_K: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_SPAN: tl.constexpr,
    ATOMIC: tl.constexpr,
    SWAP_AB: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """weight·(inter·w2ᵀ + b) for one block of routes, BLOCK_N columns of H and one K split,
    added into the token's output row (the top-k sum). SWAP_AB as in `_moe_w13_kernel`."""
    expert, route = block_routes(expert_ids_ptr, sorted_ptr, max_padded, num_routes, BLOCK_M)
    if expert < 0:
        return
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    m_mask, token, cols, n_mask = route_tile(route, pid_n, num_routes, hidden, TOP_K, BLOCK_N)
    q_e, s_e, z_e = expert_weights(q_ptr, s_ptr, z_ptr, expert, stride_qe, stride_se, stride_ze)
    a_dtype = a_ptr.dtype.element_ty
    offs_k = tl.arange(0, BLOCK_K)
    row = route.to(tl.int64) * stride_am
    if SWAP_AB:
        a_ptrs = a_ptr + row[None, :] + offs_k[:, None]
        a_mask = m_mask[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        a_ptrs = a_ptr + row[:, None] + offs_k[None, :]
        a_mask = m_mask[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = pid_k * K_SPAN
    for k0 in range(k_lo, tl.minimum(k_lo + K_SPAN, K), BLOCK_K):
        a = _load_a(a_ptrs, a_mask, offs_k, k0, K, BLOCK_K, SWAP_AB)
        w = _dequant_tile(
            q_e, s_e, z_e, cols, n_mask, k0, stride_qn, stride_sn, stride_zn,
            K, BITS, GROUP, HAS_ZP, BLOCK_N, BLOCK_K, a_dtype, DOT_F32,
        )  # fmt: skip
        acc = _mma(a, w, acc, SWAP_AB, DOT_F32)
    if HAS_BIAS:
        # Only the first K split adds the bias.
        bias = tl.load(bias_ptr + expert * stride_be + cols, mask=n_mask & (pid_k == 0), other=0.0)
        acc += _along_n(bias.to(tl.float32), SWAP_AB)
    acc *= _along_m(tl.load(topk_w_ptr + route, mask=m_mask, other=0.0), SWAP_AB)
    out_row = token * stride_om
    if SWAP_AB:
        out_ptrs = out_ptr + out_row[None, :] + cols[:, None]
        mask = n_mask[:, None] & m_mask[None, :]
    else:
        out_ptrs = out_ptr + out_row[:, None] + cols[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
    store_topk_sum(out_ptr, out_ptrs, acc, mask, ATOMIC, DOT_F32)
