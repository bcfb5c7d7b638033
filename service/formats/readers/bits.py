"""Bit packing shared by every layout: integer codes <-> int32 words or uint8 bytes.

All the formats we read pack `32 // bits` (int32) or `8 // bits` (uint8) codes per word,
lowest code in the lowest bits, along one axis; they differ only in the axis, the word type and
(AWQ) a fixed permutation of the codes inside each word. So one pair of functions with those
three parameters covers them all, and the layout modules only say which.

Packing goes through bytes: a little-endian int32 is four bytes, the lowest first, so
"code i of word w sits at bits [bits*i, bits*(i+1))" is exactly "pack the codes into bytes
(two nibbles per byte, the even index low) and view four bytes as one int32". That avoids
signed-shift overflow in int32 arithmetic and is the same rule vLLM's `.view(torch.uint8)`
conversions rely on.
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


def _pack_bytes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., L] codes -> uint8 [..., L * bits / 8]; for int4 the even index is low."""
    if bits == 8:
        return codes.contiguous()
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def _unpack_bytes(data: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return data
    low = data & 0xF
    high = data >> 4
    return torch.stack((low, high), dim=-1).reshape(*data.shape[:-1], data.shape[-1] * 2)


def pack(
    codes: torch.Tensor,
    bits: int,
    dim: int,
    word: torch.dtype,
    order: Sequence[int] | None = None,
) -> torch.Tensor:
    """Pack uint8 `codes` along `dim` into `word` (torch.int32 or torch.uint8).

    `order` (AWQ): packed slot i of each word holds code `order[i]` of that word's run.
    The caller guarantees the packed axis is a multiple of the codes per word.
    """
    per_word = codes_per_word(bits, word)
    moved = codes.to(torch.uint8).movedim(dim, -1)
    if order is not None:
        runs = moved.reshape(*moved.shape[:-1], moved.shape[-1] // per_word, per_word)
        moved = runs[..., list(order)].reshape(moved.shape)
    data = _pack_bytes(moved.contiguous(), bits)
    if word != torch.uint8:
        # Through 1-D: `view` rejects odd strides that size-1 dims may carry.
        shape = (*data.shape[:-1], data.shape[-1] // word.itemsize)
        data = data.reshape(-1).view(word).reshape(shape)
    return data.movedim(-1, dim).contiguous()


def unpack(
    words: torch.Tensor,
    bits: int,
    dim: int,
    order: Sequence[int] | None = None,
) -> torch.Tensor:
    """Inverse of `pack`: int32 or uint8 words -> uint8 codes, `dim` grown by codes per word."""
    per_word = codes_per_word(bits, words.dtype)
    moved = words.movedim(dim, -1).contiguous()
    data = moved
    if moved.dtype != torch.uint8:
        shape = (*moved.shape[:-1], moved.shape[-1] * moved.dtype.itemsize)
        data = moved.reshape(-1).view(torch.uint8).reshape(shape)
    codes = _unpack_bytes(data, bits)
    if order is not None:
        inverse = [0] * len(order)
        for slot, column in enumerate(order):
            inverse[column] = slot
        runs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per_word, per_word)
        codes = runs[..., inverse].reshape(codes.shape)
    return codes.movedim(-1, dim).contiguous()
