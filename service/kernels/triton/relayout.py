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

from collections.abc import Callable

import torch

#: Inputs per re-paired chunk: the high nibbles of a chunk's first CHUNK/2 bytes hold its
#: second half. 32 keeps both halves in one quantization group for every group size that is
#: a multiple of 32, and each half's activations a 32-byte run.
CHUNK = 32


#: Codes per slice of the leading (expert) dimension the re-layouts work on at a time, so
#: their intermediates stay a few hundred megabytes whatever the layer's size.
_SLICE_CODES = 1 << 27


def _by_slices(fn: Callable[[torch.Tensor], torch.Tensor], q: torch.Tensor) -> torch.Tensor:
    """`fn` applied to slices of q's first dimension, concatenated."""
    per_row = max(1, q[0].numel() * 2) if q.dim() > 1 else q.numel() * 2
    step = max(1, _SLICE_CODES // per_row)
    if q.dim() < 2 or q.shape[0] <= step:
        return fn(q)
    return torch.cat([fn(q[i : i + step]) for i in range(0, q.shape[0], step)])


def repair_int4(qweight: torch.Tensor) -> torch.Tensor:
    """TRITON int4 bytes [..., K/2] -> our re-paired bytes (same shape and dtype, new tensor).

    K must be a multiple of `CHUNK`.
    """
    return _by_slices(_repair, qweight)


def _repair(qweight: torch.Tensor) -> torch.Tensor:
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


#: Inputs per word chunk of the word layout, and 32-bit words per chunk row.
WORD_CHUNK = 128
WORDS = WORD_CHUNK // 8


def pack_words_int4(qweight: torch.Tensor) -> torch.Tensor:
    """TRITON int4 bytes [..., K/2] -> our word layout, int32 [..., K/8].

    Word w of chunk c holds, in nibble t (bits 4t..4t+3), code c·WORD_CHUNK + t·WORDS + w.
    So the word tile [rows, WORDS] of a chunk gives, nibble t by nibble t, eight [rows, WORDS]
    tiles of contiguous inputs, each one mask (and a shift) from a 16-bit float pair per two
    words; two consecutive words of a row are what one thread holds of a Hopper MMA operand,
    so no bytes are shuffled between load and dequantization. K must be a multiple of
    WORD_CHUNK.
    """
    half = qweight.shape[-1]
    if (2 * half) % WORD_CHUNK:
        raise ValueError(f"K = {2 * half} is not a multiple of the word chunk {WORD_CHUNK}")
    codes = torch.stack((qweight & 0xF, qweight >> 4), dim=-1).to(torch.int32)
    # [..., K/WORD_CHUNK, 8 (t), WORDS (w)] -> words [..., K/WORD_CHUNK, WORDS]
    codes = codes.reshape(*qweight.shape[:-1], -1, 8, WORDS)
    shifts = (4 * torch.arange(8, device=qweight.device, dtype=torch.int32)).view(8, 1)
    words = (codes << shifts).sum(dim=-2, dtype=torch.int64)  # disjoint bits: sum == or
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.reshape(*qweight.shape[:-1], half // 4).contiguous()


def unpack_words_int4(words: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_words_int4`: TRITON int4 bytes [..., K/2]."""
    shape = words.shape
    w = words.reshape(*shape[:-1], -1, 1, WORDS).to(torch.int64) & 0xFFFFFFFF
    shifts = (4 * torch.arange(8, device=words.device, dtype=torch.int64)).view(8, 1)
    codes = ((w >> shifts) & 0xF).to(torch.uint8).reshape(*shape[:-1], -1, 2)  # k order
    return (codes[..., 0] | (codes[..., 1] << 4)).contiguous()
