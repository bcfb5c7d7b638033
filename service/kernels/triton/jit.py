"""Device functions the Triton kernel modules share (prefill.py, prefill_rs.py, decode.py).

Rounding to the 16-bit activation type the way compiled code rounds (the interpreter does
not), the activations of activation.py as float32 formulas (same codes), the zero point of a
packed int4/int8 zero-point tensor, and the pieces every block-of-routes GEMM kernel runs the
same way: its expert and routes, its tile's masks and columns, w13's gate and up rows, the
expert's weight pointers and w2's store into the top-k sum. Kept here so each kernel module
imports only this and the configuration, never another kernel module.
"""

# Triton idiom: compile-time parameters are UPPER_CASE;
# @triton.jit device functions are untyped (triton has no type information).
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# ruff: noqa: N803, PLR0917

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round16(v, OUT: tl.constexpr, DOT_F32: tl.constexpr):
    """`v` rounded to the 16-bit type OUT (to nearest, ties to even).

    Compiled, that is a plain cast. The interpreter truncates float32 -> bfloat16 (and its
    rounding mode drops the carry into the exponent), so there the rounding is done on the
    bits and the value stays float32 (exactly representable in OUT): interpreted kernels
    then round like compiled ones and the tests can hold them to GPU tolerances.
    """
    if DOT_F32:
        if tl.bfloat16 == OUT:
            bits = v.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            r = bits.to(tl.float32, bitcast=True)
        else:
            r = v.to(OUT).to(tl.float32)
    else:
        r = v.to(OUT)
    return r


@triton.jit
def gated_activation(g, u, limit, alpha, beta, ACT: tl.constexpr):
    """The gated formulas of activation.py, same codes, float32."""
    if ACT == 0:
        out = g * tl.sigmoid(g) * u
    elif ACT == 1:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        out = g * tl.sigmoid(alpha * g) * (u + beta)
    elif ACT == 2:
        out = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476)) * u
    elif ACT == 3:
        out = gelu_tanh(g) * u
    else:
        out = tl.minimum(g * tl.sigmoid(g), limit) * tl.minimum(tl.maximum(u, -limit), limit)
    return out


@triton.jit
def plain_activation(h, ACT: tl.constexpr):
    """The `_no_mul` formulas of activation.py, float32."""
    if ACT == 5:
        out = h * tl.sigmoid(h)
    elif ACT == 6:
        out = 0.5 * h * (1.0 + tl.erf(h * 0.7071067811865476))
    elif ACT == 7:
        out = gelu_tanh(h)
    else:
        r = tl.maximum(h, 0.0)
        out = r * r
    return out


@triton.jit
def gelu_tanh(x):
    # 0.5·x·(1 + tanh(y)) == x·sigmoid(2y), y = sqrt(2/pi)·(x + 0.044715·x³)
    y = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return x * tl.sigmoid(2.0 * y)


@triton.jit
def zero_point(z_ptr, rows, row_mask, g, stride_zn, BITS: tl.constexpr, HAS_ZP: tl.constexpr):
    """int32 zero points of `rows` in group(s) `g` (broadcastable); 2^(bits-1) if symmetric."""
    if HAS_ZP:
        if BITS == 4:
            packed = tl.load(z_ptr + (rows // 2) * stride_zn + g, mask=row_mask, other=0)
            z = (packed.to(tl.int32) >> ((rows % 2) * 4)) & 0xF
        else:
            z = tl.load(z_ptr + rows * stride_zn + g, mask=row_mask, other=0).to(tl.int32)
    else:
        z = tl.full(g.shape, 1 << (BITS - 1), tl.int32)
    return z


@triton.jit
def block_routes(expert_ids_ptr, sorted_ptr, max_padded, num_routes, BLOCK_M: tl.constexpr):
    """This program's expert (-1: a block past the end) and its BLOCK_M routes. Both loads
    are independent, so they are in flight together (the GEMM preamble is latency-bound)."""
    pid_m = tl.program_id(0)
    expert = tl.load(expert_ids_ptr + pid_m)
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    route = tl.load(sorted_ptr + slots, mask=slots < max_padded, other=num_routes)
    return expert.to(tl.int64), route


@triton.jit
def route_tile(route, pid_n, num_routes, n, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Of a block of routes and the `pid_n`-th BLOCK_N output columns (of `n`): which routes
    are real, their tokens, the columns and which of them are in range."""
    m_mask = route < num_routes
    token = (route // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < n
    return m_mask, token, cols, n_mask


@triton.jit
def w13_rows(cols, inter, GATED: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The w13 rows of intermediate columns `cols`: (gate, up). Interleaved checkpoints
    alternate gate and up rows, the others stack gate over up; ungated, both are `cols`."""
    if GATED:
        if INTERLEAVED:
            gate_rows = 2 * cols
            up_rows = 2 * cols + 1
        else:
            gate_rows = cols
            up_rows = cols + inter
    else:
        up_rows = cols
        gate_rows = cols
    return gate_rows, up_rows


@triton.jit
def expert_weights(q_ptr, s_ptr, z_ptr, expert, stride_qe, stride_se, stride_ze):
    """The expert's codes, scales and zero points."""
    q_e = q_ptr + expert * stride_qe
    s_e = s_ptr + expert * stride_se
    z_e = z_ptr + expert * stride_ze
    return q_e, s_e, z_e


@triton.jit
def store_topk_sum(out_ptr, out_ptrs, acc, mask, ATOMIC: tl.constexpr, DOT_F32: tl.constexpr):
    """w2's float32 tile into the output rows: added atomically where several programs write
    a row (top-k > 1 or split-K, into a float32 output), else rounded to the output's
    16-bit type and stored (the row's one writer)."""
    if ATOMIC:
        tl.atomic_add(out_ptrs, acc, mask=mask, sem="relaxed")
    else:
        out_dtype = out_ptr.dtype.element_ty
        tl.store(out_ptrs, round16(acc, out_dtype, DOT_F32).to(out_dtype), mask=mask)
