"""Marlin's tile layouts, written as whole-tensor reshapes and permutations.

Marlin's GEMM reads each 16x64 (k x n) tile of the weight matrix so that one warp's 32 lanes
each fetch the int32 words their tensor-core fragments need, already in the nibble order of
the fast int4 -> fp16 conversion. vLLM produces that order with a CUDA repack kernel (and a
pure-torch reference used only by its tests); both are a fixed permutation of the digits of
the (k, n) index. Written as one digit permutation, the repack is a single strided copy of
the whole [experts, N, K] code tensor, so the same code runs on CPU and GPU at memory speed
with no loop over experts or tiles.

Digit names (outer to inner). Within a 16-bit-activation tile, k = 8a + 2q + b and
n = 16j + 8c + r: lane (r, q) of warp j holds the 2x2 fragment (a, b) of columns r and r + 8
(c). With 8-bit activations the tile is 32x32 and k = 16a + 4q + b, n = 16j + 8c + r.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass

import torch

TILE = 16
"""Marlin's k tile: the repacked weight has one row per 16 input channels."""


@dataclass(frozen=True)
class _TileLayout:
    """One weight layout: the digits of k and n inside one tile and the output order.

    `nibble` names the k digit that picks the low or high nibble of a byte (4-bit codes);
    `order` lists the remaining digits outermost first, after the (k tile, n tile) pair.
    """

    k_digits: tuple[tuple[str, int], ...]
    n_digits: tuple[tuple[str, int], ...]
    order: tuple[str, ...]
    nibble: str | None

    @property
    def tile_k(self) -> int:
        return _product(self.k_digits)

    @property
    def tile_n(self) -> int:
        return _product(self.n_digits)


def _product(digits: tuple[tuple[str, int], ...]) -> int:
    size = 1
    for _, extent in digits:
        size *= extent
    return size


# (bits, 8-bit activations) -> layout. Read from the repack kernel's lane arithmetic: the word
# index inside a tile is (r, q, j) (and c with 8-bit activations or 8-bit codes); the value
# order inside a word is the dequantizer's interleave ([0,2,4,6,1,3,5,7] for int4 with 16-bit
# activations, [0,2,1,3] for int8, [0,4,1,5,2,6,3,7] / identity with 8-bit activations).
_A16_K = (("a", 2), ("q", 4), ("b", 2))
_A16_N = (("j", 4), ("c", 2), ("r", 8))
_A8_K = (("a", 2), ("q", 4), ("b", 4))
_A8_N = (("j", 2), ("c", 2), ("r", 8))
_WEIGHT_LAYOUTS: dict[tuple[int, bool], _TileLayout] = {
    (4, False): _TileLayout(_A16_K, _A16_N, ("r", "q", "j", "b", "c"), nibble="a"),
    (8, False): _TileLayout(_A16_K, _A16_N, ("r", "q", "j", "c", "b", "a"), nibble=None),
    (4, True): _TileLayout(_A8_K, _A8_N, ("r", "q", "j", "c", "b"), nibble="a"),
    (8, True): _TileLayout(_A8_K, _A8_N, ("r", "q", "j", "c", "a", "b"), nibble=None),
}


def _require_little_endian() -> None:
    # Words are assembled by viewing bytes as int32, which is only Marlin's order on a
    # little-endian host (every CUDA host is one).
    if sys.byteorder != "little":
        raise RuntimeError("Marlin packing needs a little-endian host")


def _weight_layout(bits: int, a8: bool) -> _TileLayout:
    layout = _WEIGHT_LAYOUTS.get((bits, a8))
    if layout is None:
        raise ValueError(f"no Marlin layout for {bits}-bit weights")
    return layout


def _source_names(layout: _TileLayout) -> list[str]:
    """Dimension names of the [E, N, K] codes viewed as digits (nibble digit included)."""
    return [
        "E",
        "NB",
        *(name for name, _ in layout.n_digits),
        "KB",
        *(name for name, _ in layout.k_digits),
    ]


def _source_shape(layout: _TileLayout, e: int, n: int, k: int) -> list[int]:
    return [
        e,
        n // layout.tile_n,
        *(extent for _, extent in layout.n_digits),
        k // layout.tile_k,
        *(extent for _, extent in layout.k_digits),
    ]


def check_tile_shape(n: int, k: int, a8: bool = False) -> None:
    """Raise ValueError unless (n, k) tiles evenly (vLLM's repack asserts the same)."""
    layout = _weight_layout(4, a8)
    if n % max(layout.tile_n, 64) or k % layout.tile_k:
        raise ValueError(
            f"Marlin needs N % {max(layout.tile_n, 64)} == 0 and K % {layout.tile_k} == 0, "
            f"got N={n}, K={k}"
        )


@functools.cache
def _tile_order(bits: int, a8: bool) -> torch.Tensor:
    """Where each byte of one repacked (k tile, n tile) block comes from, when the block's
    source is stored n-major: [n in tile, bytes of that n's tile row] (nibbles paired)."""
    layout = _weight_layout(bits, a8)
    digits = [
        *layout.n_digits,
        *(digit for digit in layout.k_digits if digit[0] != layout.nibble),
    ]
    names = [name for name, _ in digits]
    source = torch.arange(math.prod(extent for _, extent in digits))
    source = source.view([extent for _, extent in digits])
    return source.permute([names.index(name) for name in layout.order]).reshape(-1)


def repack_weights(codes: torch.Tensor, bits: int, a8: bool = False) -> torch.Tensor:
    """uint8 codes [E, N, K] (N-first, one code per byte) -> Marlin int32 [E, K/16, N*16*bits/32].

    Equal to vLLM's `gptq_marlin_moe_repack` of the same weights (and to
    `marlin_utils_test.marlin_weights` per expert). `a8` selects the layout for 8-bit
    activations (`VLLM_MARLIN_INPUT_DTYPE`).

    Three whole-tensor steps: pair the codes that share a byte; move every tile row (all of
    its bytes as 8-byte words) to its tile, a batched transpose of [N, K tiles]; reorder the
    bytes inside each tile with one gather over a fixed table. Each step reads and writes
    memory in runs, unlike a single byte-granular permutation of the code tensor.
    """
    _require_little_endian()
    layout = _weight_layout(bits, a8)
    e, n, k = (int(d) for d in codes.shape)
    check_tile_shape(n, k, a8)
    k_tiles = k // layout.tile_k
    row_bytes = layout.tile_k * bits // 8
    words = codes.contiguous().view(torch.int64).view(e, n, k_tiles, -1)
    if layout.nibble is not None:
        # The nibble digit is the outermost k digit of a tile, so the codes sharing a byte
        # sit in the two halves of each tile row: low + 16 * high, added as 8-byte words,
        # cannot carry from byte to byte because every code is below 16.
        halves = words.view(e, n, k_tiles, 2, -1)
        words = torch.add(halves[:, :, :, 0], halves[:, :, :, 1], alpha=16)
    tiles = words.transpose(1, 2).contiguous()  # [E, K tiles, N, row words]
    blocks = tiles.view(torch.uint8).view(e, k_tiles, n // layout.tile_n, -1)
    packed = blocks[..., _tile_order(bits, a8).to(codes.device)]
    assert packed.shape[-1] == layout.tile_n * row_bytes
    return packed.view(e, k // TILE, -1).view(torch.int32)


def unpack_weights(
    qweight: torch.Tensor, bits: int, size_n: int, size_k: int, a8: bool = False
) -> torch.Tensor:
    """Inverse of `repack_weights`: Marlin int32 [E, K/16, ...] -> uint8 codes [E, N, K]."""
    _require_little_endian()
    layout = _weight_layout(bits, a8)
    e = int(qweight.shape[0])
    check_tile_shape(size_n, size_k, a8)
    expected = (e, size_k // TILE, size_n * TILE * bits // 32)
    if qweight.dtype != torch.int32 or tuple(qweight.shape) != expected:
        raise ValueError(f"qweight must be int32 {list(expected)}, got {list(qweight.shape)}")
    names = _source_names(layout)
    shape = _source_shape(layout, e, size_n, size_k)
    nibble_axis = None
    if layout.nibble is not None:
        nibble_axis = names.index(layout.nibble)
        names.pop(nibble_axis)
        shape.pop(nibble_axis)
    target = ["E", "KB", "NB", *layout.order]
    target_shape = [shape[names.index(name)] for name in target]
    data = qweight.contiguous().view(torch.uint8).view(target_shape)
    digits = data.permute([target.index(name) for name in names])
    if nibble_axis is not None:
        digits = torch.stack((digits & 0xF, digits >> 4), dim=nibble_axis)
    return digits.reshape(e, size_n, size_k)


# --- small permutations (scales, zero points, bias) as index tables over the last dim ---


def _transpose_8x8() -> torch.Tensor:
    """Grouped-scale order: each run of 64 output channels read as an 8x8 block, transposed
    (one lane's eight columns become adjacent)."""
    return torch.arange(64).view(8, 8).t().reshape(-1)


def _single_32() -> torch.Tensor:
    """Channelwise-scale and bias order: in each run of 32, digits (u, i, v) of 8u + 2i + v
    become (i, u, v), the pairs of columns one lane owns in each of its four MMA tiles."""
    return torch.arange(32).view(4, 4, 2).permute(1, 0, 2).reshape(-1)


_INTERLEAVE = {4: (0, 2, 4, 6, 1, 3, 5, 7), 8: (0, 2, 1, 3)}


def _zero_point_order(bits: int, a8: bool) -> torch.Tensor:
    """Zero-point order inside 64 channels: the grouped-scale transpose, then (16-bit
    activations only) the dequantizer's interleave within each packed word."""
    order = _transpose_8x8()
    if not a8:
        interleave = torch.tensor(_INTERLEAVE[bits])
        order = order.view(-1, interleave.numel())[:, interleave].reshape(-1)
    return order


def _gather_last(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    width = order.numel()
    if x.shape[-1] % width:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of {width}")
    shape = x.shape
    blocks = x.reshape(*shape[:-1], shape[-1] // width, width)
    return blocks[..., order.to(x.device)].reshape(shape).contiguous()


def _inverse(order: torch.Tensor) -> torch.Tensor:
    return torch.argsort(order)


def permute_scales(scales: torch.Tensor, grouped: bool) -> torch.Tensor:
    """K-first scales [E, G, N] -> Marlin order (vLLM's `marlin_moe_permute_scales`).

    `grouped` is true when the kernel sees more than one group (and 16-bit activations):
    then the 64-wide transpose, else the 32-wide channelwise order.
    """
    return _gather_last(scales, _transpose_8x8() if grouped else _single_32())


def unpermute_scales(scales: torch.Tensor, grouped: bool) -> torch.Tensor:
    return _gather_last(scales, _inverse(_transpose_8x8() if grouped else _single_32()))


def permute_bias(bias: torch.Tensor) -> torch.Tensor:
    """[E, N] -> Marlin order (vLLM's `marlin_permute_bias`)."""
    return _gather_last(bias, _single_32())


def unpermute_bias(bias: torch.Tensor) -> torch.Tensor:
    return _gather_last(bias, _inverse(_single_32()))


def pack_words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., M] -> int32 [..., M*bits/32]: value p of each word at bits [p*bits, ...)."""
    _require_little_endian()
    if bits == 4:
        values = values[..., 0::2] | (values[..., 1::2] << 4)
    return values.contiguous().view(torch.int32)


def unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_words`."""
    _require_little_endian()
    data = words.contiguous().view(torch.uint8)
    if bits == 4:
        data = torch.stack((data & 0xF, data >> 4), dim=-1).flatten(-2)
    return data


def pack_zero_points(zeros: torch.Tensor, bits: int, a8: bool = False) -> torch.Tensor:
    """Real zero points uint8 [E, G, N] -> Marlin int32 [E, G, N*bits/32]
    (vLLM's `marlin_zero_points` per expert, after its own unpacking of the checkpoint)."""
    return pack_words(_gather_last(zeros, _zero_point_order(bits, a8)), bits)


def unpack_zero_points(words: torch.Tensor, bits: int, a8: bool = False) -> torch.Tensor:
    return _gather_last(unpack_words(words, bits), _inverse(_zero_point_order(bits, a8)))
