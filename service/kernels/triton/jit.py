"""Device functions both Triton kernel families share (prefill.py, decode.py).

Rounding to the 16-bit activation type the way compiled code rounds (the interpreter does
not), the activations of activation.py as float32 formulas (same codes), and the zero point
of a packed int4/int8 zero-point tensor. Kept here so each kernel module imports only this
and the configuration, never the other kernel module.
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
