"""The decode kernels of our Triton WNA16 MoE forward: one program per route, no alignment.

For few routes (M·k up to `config.DECODE_MAX_ROUTES`, few routes per expert) the forward is a
serial chain of dependent latencies rather than a byte stream, and the prefill kernels'
alignment pass, tensor-core tiles padded to 16 rows and one-column-tile-per-program grids
leave the GPU idle (bench/KERNEL_NOTES.md, "Version 5", has the measurements). This design
shortens the chain at every link:

* **No alignment.** Program (route, column tile, K split) loads `topk_ids[route]` (one
  dependent load) and then every weight address is known. Routes that share an expert
  re-read its tile; the route is the fastest grid axis, so such programs run side by side
  and the second read hits L2.
* **No tensor cores: a GEMV.** One route is one activation row; `tl.dot` would pad it to 16
  rows and stage the dequantized tile through shared memory every K step. Here the packed
  words are used as they load (no join/reshape, no layout conversion); the zero point leaves
  the inner loop (sum (q - z)·x = sum q·x - z·sum x) and the group scale multiplies each
  [rows, groups] partial once. Arithmetic is float32 (weights never rounded to 16 bits). The
  Triton 3.6 MMAv2 K-16 wrap cannot occur (no dot).
* **Split-K in both GEMMs**, so each program makes one or two K steps and several programs
  per SM are in flight. w13's partials (gate and up) go into a float32 workspace; the
  last-arriving split of a (route, column tile), found with one acquire-release counter,
  reads the sums back (atomic exchange with zero: read and reset in one operation), applies
  bias and activation and writes `inter`. w2 adds router-weighted partials into a float32
  [M, H] workspace; the last arriver of a column tile writes the 16-bit output. Every
  workspace and counter is left zeroed, so a forward is exactly two launches (graph nodes):
  no memset, no cast.

Taken where `KernelConfig.kernel == "decode"` (a caller's config, or the dispatcher's choice
by `config.use_decode`).
"""

# Triton idiom: compile-time parameters are UPPER_CASE, kernels take many arguments and
# constexpr branches stay statements (not conditional expressions);
# @triton.jit device functions are untyped (triton has no type information).
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# ruff: noqa: N803, N806, PLR0917

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from service.kernels.activation import ResolvedActivation
from service.kernels.interface import LayerSpec
from service.kernels.triton.config import KernelConfig, fit_block_k
from service.kernels.triton.jit import (
    expert_weights,
    gated_activation,
    plain_activation,
    round16,
    w13_rows,
    zero_point,
)
from service.triton_runtime import interpreting

#: Rows of the final [M, BLOCK_N] read-back of w2's last arriver per step.
_FLUSH_M = 16


class DecodeWorkspace:
    """The persistent float32 sums and int32 counters of both GEMMs' split reductions.

    Zero between forwards: each last arriver resets what it read and its counter. Grown (a
    fresh zeroed tensor) when a forward needs more; one forward at a time per workspace.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.device != device or buf.dtype != dtype or buf.numel() < numel:
            buf = torch.zeros(max(numel, 1024), dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf


def fused_moe_decode(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    t: dict[str, torch.Tensor],
    spec: LayerSpec,
    act: ResolvedActivation,
    config: KernelConfig,
    workspace: DecodeWorkspace,
    poison: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The whole decode forward: two launches, no host synchronisation, into `out` if given."""
    m, top_k = topk_ids.shape
    h, i, e = spec.hidden_size, spec.intermediate_size, spec.num_experts
    routes = m * top_k
    result = torch.empty_like(x) if out is None else out
    if routes == 0:
        return result
    device = x.device
    ids = topk_ids.reshape(-1)
    weights = topk_weights.reshape(-1)
    interp = interpreting()
    inter = torch.empty((routes, i), dtype=x.dtype, device=device)
    if poison:
        inter.fill_(float("nan"))
    dummy = t["w13_scales"]  # a valid pointer for absent optional tensors (never read)
    q13, s13 = _codes(t["w13_qweight"], spec.bits), t["w13_scales"]
    z13, b13 = t.get("w13_qzeros", dummy), t.get("w13_bias", dummy)
    g13 = h if spec.group_size == -1 else spec.group_size
    c1 = replace(config.w13, block_k=fit_block_k(config.w13.block_k, h, g13))
    span1, split1 = _span(h, c1.block_k, c1.split_k)
    tiles1 = triton.cdiv(i, c1.block_n)
    rows13 = 2 * i if act.gated else i
    ws1 = workspace.get("w13", routes * rows13 if split1 > 1 else 1, torch.float32, device)
    cnt1 = workspace.get("w13_count", routes * tiles1 if split1 > 1 else 1, torch.int32, device)
    _decode_w13_kernel[(routes, tiles1, split1)](
        x, q13, s13, z13, b13, ids, inter, ws1, cnt1, i, e,
        x.stride(0), q13.stride(0), q13.stride(1), s13.stride(0), s13.stride(1),
        z13.stride(0), z13.stride(1), b13.stride(0), inter.stride(0),
        act.limit, act.alpha, act.beta, ONE_BITS,
        K=h, TOP_K=top_k, BITS=spec.bits, GROUP=g13, SUB=min(g13, c1.block_k),
        HAS_ZP=spec.has_zero_points, HAS_BIAS=spec.has_bias,
        ACT=act.code, GATED=act.gated, INTERLEAVED=act.interleaved,
        BLOCK_N=c1.block_n, BLOCK_K=c1.block_k, K_SPAN=span1, SPLIT_K=split1,
        NUM_STAGES=c1.num_stages, INTERP=interp,
        num_warps=c1.num_warps,
    )  # fmt: skip
    g2 = i if spec.group_size == -1 else spec.group_size
    c2 = replace(config.w2, block_k=fit_block_k(config.w2.block_k, i, g2))
    span2, split2 = _span(i, c2.block_k, c2.split_k)
    tiles2 = triton.cdiv(h, c2.block_n)
    reduce = top_k > 1 or split2 > 1
    ws2 = workspace.get("w2", m * h if reduce else 1, torch.float32, device)
    cnt2 = workspace.get("w2_count", tiles2 if reduce else 1, torch.int32, device)
    q2, s2 = _codes(t["w2_qweight"], spec.bits), t["w2_scales"]
    z2, b2 = t.get("w2_qzeros", dummy), t.get("w2_bias", dummy)
    _decode_w2_kernel[(routes, tiles2, split2)](
        inter, q2, s2, z2, b2, ids, weights, result, ws2, cnt2, routes, m, h, e,
        inter.stride(0), q2.stride(0), q2.stride(1), s2.stride(0), s2.stride(1),
        z2.stride(0), z2.stride(1), b2.stride(0), result.stride(0), ONE_BITS,
        K=i, TOP_K=top_k, BITS=spec.bits, GROUP=g2, SUB=min(g2, c2.block_k),
        HAS_ZP=spec.has_zero_points, HAS_BIAS=spec.has_bias,
        BLOCK_N=c2.block_n, BLOCK_K=c2.block_k, K_SPAN=span2, SPLIT_K=split2,
        REDUCE=reduce, FLUSH_M=_FLUSH_M, NUM_STAGES=c2.num_stages, INTERP=interp,
        num_warps=c2.num_warps,
    )  # fmt: skip
    return result


def _codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int4 codes as 32-bit words of 8 (rows of K/2 bytes are multiples of 8: K is a
    multiple of 16; a copy only if the tensor does not start on a 4-byte boundary); int8
    codes as they are."""
    if bits == 8:
        return packed
    if packed.data_ptr() % 4:
        packed = packed.clone()
    return packed.view(torch.int32)


def _span(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(inputs per split, splits that have work): whole K tiles per split."""
    steps = k // block_k
    span = -(-steps // max(1, min(split_k, steps))) * block_k
    return span, -(-k // span)


# --- device code ------------------------------------------------------------------------------


#: int4 codes become floats 1 + q·2^-11 (field B: the code at bits 12-15 of a 32-bit word)
#: or 1 + q·2^-7 (field A: bits 16-19) by one LOP3, (word & field) | one, where `one`
#: (1.0f's bits) is a kernel argument: a register operand, so ptxas merges the AND and the
#: OR (with both as immediates it emitted two LOP3s per code). Each field has its own
#: accumulator, sum f·x = sum x + 2^-7 (or 2^-11)·sum q·x; the plain sums of x are
#: subtracted once per sub-block after the reduction.
ONE_BITS = 0x3F800000
_FIELD_B = tl.constexpr(0xF000)
_FIELD_A = tl.constexpr(0xF0000)


@triton.jit
def _x_tile(x_row, k0, BITS: tl.constexpr, SUB: tl.constexpr, NG: tl.constexpr):
    """The activations meeting one K tile, float32 [NG, words per sub-block] vectors.

    int4: x0..x7 meet nibble j of each 32-bit code word (input 8w + j), loaded as one
    16-byte vector per word and split in registers; c_a, c_b: per sub-block, the sums of
    the ones read in field A (nibbles 1, 4, 6, 7) and in field B (0, 2, 3, 5).
    int8: x0 the activations (x1..x7 unused), c_a = 0, c_b their sum."""
    g = tl.arange(0, NG)
    if BITS == 4:
        W: tl.constexpr = SUB // 8
        w = tl.arange(0, W)
        j = tl.arange(0, 8)
        base = k0 + g[:, None] * SUB + 8 * w[None, :]
        xv = tl.load(x_row + base[:, :, None] + j[None, None, :]).to(tl.float32)
        even, odd = tl.split(xv.reshape(NG, W, 4, 2))  # inputs 2i, 2i + 1
        e0, e2 = tl.split(even.reshape(NG, W, 2, 2))  # 4a, 4a + 2
        o1, o3 = tl.split(odd.reshape(NG, W, 2, 2))  # 4a + 1, 4a + 3
        x0, x4 = tl.split(e0)
        x2, x6 = tl.split(e2)
        x1, x5 = tl.split(o1)
        x3, x7 = tl.split(o3)
        c_a = tl.sum(x1 + x4 + x6 + x7, axis=1)
        c_b = tl.sum(x0 + x2 + x3 + x5, axis=1)
    else:
        w = tl.arange(0, SUB)
        x0 = tl.load(x_row + k0 + g[:, None] * SUB + w[None, :]).to(tl.float32)
        x1 = x0
        x2 = x0
        x3 = x0
        x4 = x0
        x5 = x0
        x6 = x0
        x7 = x0
        c_a = tl.zeros([NG], dtype=tl.float32)
        c_b = tl.sum(x0, axis=1)
    return x0, x1, x2, x3, x4, x5, x6, x7, c_a, c_b


@triton.jit
def _field(word, MASK: tl.constexpr, one):
    """The code under MASK (field A or B) as the float 1 + q·2^-7 or 1 + q·2^-11."""
    return ((word & MASK) | one).to(tl.float32, bitcast=True)


@triton.jit
def _gemv_tile(x0, x1, x2, x3, x4, x5, x6, x7, c_a, c_b, q_e, s_e, z_e, rows, row_mask, k0,
               stride_qn, stride_sn, stride_zn, one, BITS: tl.constexpr, GROUP: tl.constexpr,
               SUB: tl.constexpr, NG: tl.constexpr, HAS_ZP: tl.constexpr,
               BLOCK_N: tl.constexpr):  # fmt: skip
    """sum_k w[row, k]·x[k] over one K tile ([BLOCK_N] float32), w = (q - z)·s.

    The tile is loaded as [BLOCK_N, NG, words] (NG sub-blocks of one quantization group
    each; int4 as 32-bit words of 8 codes, int8 as bytes), so the group scale multiplies a
    [BLOCK_N, NG] partial once and the zero point enters as z·sum(x) per sub-block. Codes
    never pass the int->float conversion unit (16 per clock per SM on Hopper): int4, per
    8 codes, 4 shifts, 8 LOP3s and 8 FFMAs (the byte-wise first version compiled to ~3.4
    integer and 3 float instructions per code); int8 ORs the byte into 2^23's mantissa
    and subtracts 2^23."""
    g = tl.arange(0, NG)
    xs = c_a + c_b
    if BITS == 4:
        W: tl.constexpr = SUB // 8
        w = tl.arange(0, W)
        kw = k0 // 8 + g[:, None] * W + w[None, :]
        word = tl.load(
            q_e + rows[:, None, None] * stride_qn + kw[None, :, :],
            mask=row_mask[:, None, None],
            other=0,
        )
        up12 = word << 12
        down8 = word >> 8
        acc_a = _field(up12, _FIELD_A, one) * x1[None, :, :]
        acc_a += _field(word, _FIELD_A, one) * x4[None, :, :]
        acc_a += _field(down8, _FIELD_A, one) * x6[None, :, :]
        acc_a += _field(word >> 12, _FIELD_A, one) * x7[None, :, :]
        acc_b = _field(up12, _FIELD_B, one) * x0[None, :, :]
        acc_b += _field(word << 4, _FIELD_B, one) * x2[None, :, :]
        acc_b += _field(word, _FIELD_B, one) * x3[None, :, :]
        acc_b += _field(down8, _FIELD_B, one) * x5[None, :, :]
        dot_a = tl.sum(acc_a, axis=2) - c_a[None, :]
        dot_b = tl.sum(acc_b, axis=2) - c_b[None, :]
        dot = dot_a * 128.0 + dot_b * 2048.0
    else:
        j = tl.arange(0, SUB)
        kb = k0 + g[:, None] * SUB + j[None, :]
        p = tl.load(
            q_e + rows[:, None, None] * stride_qn + kb[None, :, :],
            mask=row_mask[:, None, None],
            other=0,
        ).to(tl.int32)
        q = (p | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        dot = tl.sum(q * x0[None, :, :], axis=2)
    grp = (k0 + g * SUB) // GROUP
    grp2 = grp[None, :] + tl.zeros([BLOCK_N, NG], dtype=tl.int32)
    rows2 = rows[:, None] + tl.zeros([BLOCK_N, NG], dtype=tl.int32)
    mask2 = row_mask[:, None] & (grp2 >= 0)
    s = tl.load(s_e + rows2 * stride_sn + grp2, mask=mask2, other=0).to(tl.float32)
    z = zero_point(z_e, rows2, mask2, grp2, stride_zn, BITS, HAS_ZP).to(tl.float32)
    return tl.sum((dot - z * xs[None, :]) * s, axis=1)


@triton.jit
def _take(ptrs, mask):
    """The float32 values at `ptrs`, read at L2 and replaced by zero in one atomic exchange
    (as 32-bit integers: the interpreter exchanges no floats; the same `atom.exch.b32`)."""
    bits = tl.atomic_xchg(ptrs.to(tl.pointer_type(tl.int32)), 0, mask=mask, sem="relaxed")
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _w13_epilogue(acc_u, acc_g, bias_e, up_rows, gate_rows, cols, n_mask, out_row, limit,
                  alpha, beta, ACT: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                  INTERP: tl.constexpr):  # fmt: skip
    """Bias, activation, 16-bit store of one route's BLOCK_N intermediate columns."""
    if HAS_BIAS:
        acc_u += tl.load(bias_e + up_rows, mask=n_mask, other=0.0).to(tl.float32)
        if GATED:
            acc_g += tl.load(bias_e + gate_rows, mask=n_mask, other=0.0).to(tl.float32)
    if GATED:
        hidden = gated_activation(acc_g, acc_u, limit, alpha, beta, ACT)
    else:
        hidden = plain_activation(acc_u, ACT)
    out_dtype = out_row.dtype.element_ty
    tl.store(out_row + cols, round16(hidden, out_dtype, INTERP).to(out_dtype), mask=n_mask)


@triton.jit
def _decode_w13_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, ids_ptr, out_ptr, ws_ptr, count_ptr,
    inter, num_experts,
    stride_xm, stride_qe, stride_qn, stride_se, stride_sn, stride_ze, stride_zn, stride_be,
    stride_om, limit, alpha, beta, one,
    K: tl.constexpr, TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
    SUB: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    GATED: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, K_SPAN: tl.constexpr, SPLIT_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """act(x[token]·w13[expert]ᵀ + b) for one route, BLOCK_N columns of I, one K split.

    With SPLIT_K > 1 the gate and up partials are added into the float32 workspace (row
    `route`: up at columns [0, I), gate at [I, 2I)) and the last split to arrive for this
    (route, column tile) finishes the tile; an expert id outside [0, E) reads no weights."""
    route = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    expert = tl.load(ids_ptr + route).to(tl.int64)
    valid = (expert >= 0) & (expert < num_experts)
    expert = tl.where(valid, expert, 0)
    token = (route // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < inter
    w_mask = n_mask & valid
    gate_rows, up_rows = w13_rows(cols, inter, GATED, INTERLEAVED)
    q_e, s_e, z_e = expert_weights(q_ptr, s_ptr, z_ptr, expert, stride_qe, stride_se, stride_ze)
    x_row = x_ptr + token * stride_xm
    NG: tl.constexpr = BLOCK_K // SUB
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    k_lo = pid_k * K_SPAN
    for k0 in tl.range(k_lo, tl.minimum(k_lo + K_SPAN, K), BLOCK_K, num_stages=NUM_STAGES):
        x0, x1, x2, x3, x4, x5, x6, x7, c_a, c_b = _x_tile(x_row, k0, BITS, SUB, NG)
        acc_u += _gemv_tile(
            x0, x1, x2, x3, x4, x5, x6, x7, c_a, c_b, q_e, s_e, z_e, up_rows, w_mask, k0,
            stride_qn, stride_sn, stride_zn, one, BITS, GROUP, SUB, NG, HAS_ZP, BLOCK_N,
        )  # fmt: skip
        if GATED:
            acc_g += _gemv_tile(
                x0, x1, x2, x3, x4, x5, x6, x7, c_a, c_b, q_e, s_e, z_e, gate_rows, w_mask, k0,
                stride_qn, stride_sn, stride_zn, one, BITS, GROUP, SUB, NG, HAS_ZP, BLOCK_N,
            )  # fmt: skip
    bias_e = bias_ptr + expert * stride_be
    out_row = out_ptr + route.to(tl.int64) * stride_om
    if SPLIT_K == 1:
        _w13_epilogue(acc_u, acc_g, bias_e, up_rows, gate_rows, cols, n_mask, out_row,
                      limit, alpha, beta, ACT, GATED, HAS_BIAS, INTERP)  # fmt: skip
    else:
        if GATED:
            ws_row = ws_ptr + route.to(tl.int64) * (2 * inter)
        else:
            ws_row = ws_ptr + route.to(tl.int64) * inter
        tl.atomic_add(ws_row + cols, acc_u, mask=n_mask, sem="relaxed")
        if GATED:
            tl.atomic_add(ws_row + inter + cols, acc_g, mask=n_mask, sem="relaxed")
        # Every thread's adds are issued before one thread's release-acquire count.
        tl.debug_barrier()
        tile = route * tl.num_programs(1) + pid_n
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            # Read at L2 and reset in one operation (the other splits are done with it).
            sum_u = _take(ws_row + cols, n_mask)
            sum_g = sum_u
            if GATED:
                sum_g = _take(ws_row + inter + cols, n_mask)
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed")
            _w13_epilogue(sum_u, sum_g, bias_e, up_rows, gate_rows, cols, n_mask, out_row,
                          limit, alpha, beta, ACT, GATED, HAS_BIAS, INTERP)  # fmt: skip


@triton.jit
def _decode_w2_kernel(
    a_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, ids_ptr, topk_w_ptr, out_ptr, ws_ptr, count_ptr,
    num_routes, num_tokens, hidden, num_experts,
    stride_am, stride_qe, stride_qn, stride_se, stride_sn, stride_ze, stride_zn, stride_be,
    stride_om, one,
    K: tl.constexpr, TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
    SUB: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, K_SPAN: tl.constexpr, SPLIT_K: tl.constexpr,
    REDUCE: tl.constexpr, FLUSH_M: tl.constexpr, NUM_STAGES: tl.constexpr,
    INTERP: tl.constexpr,
):  # fmt: skip
    """weight·(inter[route]·w2[expert]ᵀ + b) for one route, BLOCK_N columns of H, one K split.

    REDUCE False (top-1, one split): the token's row has one writer, stored in 16 bits.
    Otherwise float32 atomic adds into the [M, H] workspace; the last of the
    routes x splits programs of this column tile writes the 16-bit output and zeroes it."""
    route = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    expert = tl.load(ids_ptr + route).to(tl.int64)
    valid = (expert >= 0) & (expert < num_experts)
    expert = tl.where(valid, expert, 0)
    token = (route // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < hidden
    w_mask = n_mask & valid
    q_e, s_e, z_e = expert_weights(q_ptr, s_ptr, z_ptr, expert, stride_qe, stride_se, stride_ze)
    a_row = a_ptr + route.to(tl.int64) * stride_am
    NG: tl.constexpr = BLOCK_K // SUB
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    k_lo = pid_k * K_SPAN
    for k0 in tl.range(k_lo, tl.minimum(k_lo + K_SPAN, K), BLOCK_K, num_stages=NUM_STAGES):
        x0, x1, x2, x3, x4, x5, x6, x7, c_a, c_b = _x_tile(a_row, k0, BITS, SUB, NG)
        acc += _gemv_tile(
            x0, x1, x2, x3, x4, x5, x6, x7, c_a, c_b, q_e, s_e, z_e, cols, w_mask, k0,
            stride_qn, stride_sn, stride_zn, one, BITS, GROUP, SUB, NG, HAS_ZP, BLOCK_N,
        )  # fmt: skip
    if HAS_BIAS:
        # Only the first K split adds the bias.
        bias = tl.load(bias_ptr + expert * stride_be + cols, mask=w_mask & (pid_k == 0), other=0.0)
        acc += bias.to(tl.float32)
    acc *= tl.load(topk_w_ptr + route).to(tl.float32)
    out_dtype = out_ptr.dtype.element_ty
    if REDUCE:
        tl.atomic_add(ws_ptr + token * hidden + cols, acc, mask=n_mask, sem="relaxed")
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == num_routes * SPLIT_K - 1:
            for m0 in range(0, num_tokens, FLUSH_M):
                rows = (m0 + tl.arange(0, FLUSH_M)).to(tl.int64)
                mask = (rows[:, None] < num_tokens) & n_mask[None, :]
                total = _take(ws_ptr + rows[:, None] * hidden + cols[None, :], mask)
                o_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
                tl.store(o_ptrs, round16(total, out_dtype, INTERP).to(out_dtype), mask=mask)
            tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed")
    else:
        o_ptrs = out_ptr + token * stride_om + cols
        tl.store(o_ptrs, round16(acc, out_dtype, INTERP).to(out_dtype), mask=n_mask)
