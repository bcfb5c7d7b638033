"""The register-operand prefill kernels' weight layout: TRITON's int4 bytes, re-paired.

vLLM's TRITON layout packs codes k = 2j and 2j + 1 into byte j of a row (low nibble first).
Split into its two nibbles, such a byte tile gives the even and the odd inputs: the matching
activations are a stride-2 gather, which cannot be copied to shared memory in wide
asynchronous transfers. Our layout re-pairs the codes within every chunk of `CHUNK` inputs
of a row: byte b of chunk c holds code c·CHUNK + b (low nibble) and c·CHUNK + CHUNK/2 + b
(high nibble). Then a [rows, CHUNK/2]-byte tile gives, nibble by nibble, the two halves of
the chunk, each a contiguous run of inputs, and one mask or one shift per nibble turns the
byte tile into a tile the tensor cores take as their register operand (prefill_rs.py).

Only the order of the nibbles within a row changes: scales, zero points and every other
tensor keep TRITON's layout, the bytes per row are the same, and int8 codes are used as they
are. The re-layout runs on the device the weights are on, once per layer at prepare.
"""

from __future__ import annotations

import torch

#: Inputs per re-paired chunk: the high nibbles of a chunk's first CHUNK/2 bytes hold its
#: second half. 32 keeps both halves in one quantization group for every group size that is
#: a multiple of 32, and each half's activations a 32-byte run.
CHUNK = 32


def repair_int4(qweight: torch.Tensor) -> torch.Tensor:
    """TRITON int4 bytes [..., K/2] -> our re-paired bytes (same shape and dtype, new tensor).

    K must be a multiple of `CHUNK`.
    """
    half = qweight.shape[-1]
    if (2 * half) % CHUNK:
        raise ValueError(f"K = {2 * half} is not a multiple of the re-layout chunk {CHUNK}")
    # Codes in input order: [..., K] as [..., K/CHUNK, 2, CHUNK/2] (first half, second half).
    lo = qweight & 0xF
    hi = qweight >> 4
    codes = torch.stack((lo, hi), dim=-1).reshape(*qweight.shape[:-1], -1, 2, CHUNK // 2)
    paired = codes[..., 0, :] | (codes[..., 1, :] << 4)
    return paired.reshape(qweight.shape).contiguous()


def unpair_int4(paired: torch.Tensor) -> torch.Tensor:
    """The inverse of `repair_int4` (tests, and reading our layout back as TRITON's)."""
    lo = paired & 0xF
    hi = paired >> 4
    shape = paired.shape
    chunks = torch.stack(
        (lo.reshape(*shape[:-1], -1, CHUNK // 2), hi.reshape(*shape[:-1], -1, CHUNK // 2)),
        dim=-2,
    ).reshape(*shape[:-1], -1, 2)  # [..., K/2, 2]: codes 2j, 2j + 1
    return (chunks[..., 0] | (chunks[..., 1] << 4)).reshape(shape).contiguous()
