"""Bit packing shared by every layout: integer codes <-> int32 words or uint8 bytes.

All the formats we read pack `32 // bits` (int32) or `8 // bits` (uint8) codes per word,
lowest code in the lowest bits, along one axis; they differ only in the axis, the word type and
(AWQ) a fixed permutation of the codes inside each word. So one pair of functions with those
three parameters covers them all, and the layout modules only say which.

On a little-endian host "code i of an int32 word sits at bits [bits*i, bits*(i+1))" is also
"byte j of the word holds codes 2j (low nibble) and 2j+1": the rule vLLM's
`.view(torch.uint8)` conversions between GPTQ words and the Triton layout rely on.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

if sys.byteorder != "little":  # pragma: no cover - every machine we run on is little-endian
    raise ImportError("service.formats assumes a little-endian host, as vLLM's layouts do")

AWQ_ORDER_4BIT = (0, 2, 4, 6, 1, 3, 5, 7)
"""AWQ's int4 word: nibble i holds column AWQ_ORDER_4BIT[i] of its group of eight."""
AWQ_ORDER_8BIT = (0, 2, 1, 3)
"""The int8 counterpart (vLLM's `awq_pack` test helper); no vLLM MoE path loads 8-bit AWQ."""


def codes_per_word(bits: int, word: torch.dtype) -> int:
    return (8 * word.itemsize) // bits


def _split(shape: Sequence[int], dim: int, per_word: int) -> tuple[int, ...]:
    """`shape` with axis `dim` split into (words, per_word)."""
    return (*shape[:dim], shape[dim] // per_word, per_word, *shape[dim + 1 :])


def pack(
    codes: torch.Tensor,
    bits: int,
    dim: int,
    word: torch.dtype,
    order: Sequence[int] | None = None,
) -> torch.Tensor:
    """Pack uint8 `codes` along `dim` into `word` (torch.int32 or torch.uint8).

    Slot i of each word (bits [bits*i, bits*(i+1))) holds code `order[i]` of that word's run
    (AWQ), or code i without `order`. The caller guarantees the axis is a multiple of the codes
    per word. Two strategies, both without transposing the codes: along the last axis the
    codes become bytes (two nibbles, even index low) viewed as words; along another axis each
    slot is one pass over contiguous slices.
    """
    dim %= codes.dim()
    per_word = codes_per_word(bits, word)
    codes = codes.to(torch.uint8).contiguous()
    if dim == codes.dim() - 1 and order is None:
        data = codes
        if bits == 4:
            pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
            data = pairs[..., 0] | (pairs[..., 1] << 4)
        if word == torch.uint8:
            return data.contiguous()
        # Through 1-D: `view` rejects odd strides that size-1 dims may carry.
        shape = (*data.shape[:-1], data.shape[-1] // word.itemsize)
        return data.contiguous().reshape(-1).view(word).reshape(shape)
    runs = codes.reshape(_split(codes.shape, dim, per_word))
    words = torch.zeros(runs.select(dim + 1, 0).shape, dtype=word, device=codes.device)
    for slot in range(per_word):
        column = slot if order is None else order[slot]
        # int32 shifts into the sign bit are well defined in torch (done on the unsigned type).
        words |= runs.select(dim + 1, column).to(word) << (bits * slot)
    return words


def unpack(
    words: torch.Tensor,
    bits: int,
    dim: int,
    order: Sequence[int] | None = None,
) -> torch.Tensor:
    """Inverse of `pack`: int32 or uint8 words -> contiguous uint8 codes, `dim` grown."""
    dim %= words.dim()
    per_word = codes_per_word(bits, words.dtype)
    words = words.contiguous()
    shape = list(words.shape)
    shape[dim] *= per_word
    if dim == words.dim() - 1 and order is None:
        data = words
        if words.dtype != torch.uint8:
            flat = (*words.shape[:-1], words.shape[-1] * words.dtype.itemsize)
            data = words.reshape(-1).view(torch.uint8).reshape(flat)
        if bits == 8:
            return data
        return torch.stack((data & 0xF, data >> 4), dim=-1).reshape(shape)
    mask = (1 << bits) - 1
    out = torch.empty(_split(shape, dim, per_word), dtype=torch.uint8, device=words.device)
    for slot in range(per_word):
        column = slot if order is None else order[slot]
        out.select(dim + 1, column).copy_((words >> (bits * slot)) & mask)
    return out.reshape(shape)
