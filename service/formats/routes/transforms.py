"""The direct routes' weight transforms: one expert's stored weight -> its rows of a target.

They never expand the weight: they rearrange the packed words (GPTQ -> TRITON is a transpose
of int32 words) or, where nibbles must change words, pair them with one mask-and-shift
exchange over int32 words and then move bytes once, straight into the output tensor (a
single strided copy on a GPU, a fixed per-block table on the CPU: `_move_blocks`).

The nibble exchange: two int32 words `a`, `b` whose byte i holds codes (2i, 2i+1) of one
run each become `low` (byte i = a's low nibble | b's low nibble << 4) and `high` (a's high
nibble | b's high nibble << 4): t = ((a >> 4) ^ b) & 0x0F0F0F0F; high = b ^ t;
low = a ^ (t << 4). Six elementwise passes over half the weight each. The transforms also
trace under torch.compile (no `out=` into views there), so they can be fused.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import torch

__all__ = [
    "TABLE_MOVE_DEVICES",
    "WeightFn",
    "exchange_nibbles",
    "marlin4_from_awq",
    "marlin4_from_ct",
    "marlin4_from_gptq",
    "marlin8_from_ct",
    "marlin8_from_gptq",
    "triton_from_awq",
    "triton_from_k_first",
    "triton_from_n_first",
]


_LOW_NIBBLES = 0x0F0F0F0F


def exchange_nibbles(
    a: torch.Tensor, b: torch.Tensor, low: torch.Tensor, high: torch.Tensor
) -> None:
    """int32 words: `low` byte i = a's low nibble | b's low nibble << 4, `high` the same
    for the high nibbles (see the module docstring). `low`/`high` may be strided views."""
    t = torch.bitwise_right_shift(a, 4)
    t ^= b
    t &= _LOW_NIBBLES
    torch.bitwise_xor(b, t, out=high)
    t <<= 4
    torch.bitwise_xor(a, t, out=low)


def _pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int32 [..., 2]: (low, high) of `exchange_nibbles`. Eagerly the results go straight
    into their final places (no stacking pass); under torch.compile (which has no `out=`
    into views) the same arithmetic is written functionally and fused."""
    if torch.compiler.is_compiling():
        t = ((a >> 4) ^ b) & _LOW_NIBBLES
        return torch.stack((a ^ (t << 4), b ^ t), dim=-1)
    mixed = torch.empty(*a.shape, 2, dtype=torch.int32, device=a.device)
    exchange_nibbles(a, b, mixed[..., 0], mixed[..., 1])
    return mixed


# A weight transform writes one stored per-expert tensor (source order) into `out`, the
# target's bytes for exactly those output rows, already shaped by the route's `target_view`.
WeightFn = Callable[[torch.Tensor, torch.Tensor, int], None]


def triton_from_k_first(stored: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """GPTQ int32 [K/pf, N] (K packed) -> Triton bytes [N, K*bits/8]: a word transpose."""
    out.view(torch.int32).copy_(stored.t())


def triton_from_n_first(stored: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """compressed-tensors int32 [N, K/pf] / MoeWNA16 uint8 [N, K/p8]: the same bytes."""
    out.copy_(stored.contiguous().view(torch.uint8).view(out.shape))


def triton_from_awq(stored: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """AWQ int4 int32 [K, N/8] (N packed, nibble order 0,2,4,6,1,3,5,7) -> Triton [N, K/2].

    Rows k and k+1 exchange nibbles: byte i of `low` pairs column order[2i] of both rows,
    of `high` column order[2i+1], so column j = 4*(i%2) + 2*high + i//2. A GPU then puts
    every byte in place with one strided copy (a transpose of the whole matrix). On the CPU
    a byte-granular transpose is slow, so the move is split by granularity: the eight
    bytes of each (k pair, word) move as one int64 (a word transpose), 4 x 8 byte blocks
    are reordered by a table, and the 4-byte results move as int32 words."""
    k, words = (int(d) for d in stored.shape)
    pairs = stored.view(k // 2, 2, words)
    mixed = _pair(pairs[:, 0], pairs[:, 1])  # [kb, nw, high] words of bytes i
    if not _table_moves(stored):
        source = mixed.view(torch.uint8).view(k // 2, words, 2, 2, 2)  # kb nw high ih il
        out.view(words, 2, 2, 2, k // 2).copy_(source.permute(1, 4, 2, 3, 0))
        return
    by_word = mixed.view(torch.int64).view(k // 2, words).t().contiguous()  # [nw, kb]
    blocks = by_word.view(torch.uint8).view(words, k // 8, 32)  # [nw, kw, (kb4 high ih il)]
    moved = torch.empty_like(blocks)
    _move_blocks(blocks, (4, 2, 2, 2), (3, 1, 2, 0), moved)  # -> [nw, kw, (j, kb4)]
    columns = moved.view(torch.int32).view(words, k // 8, 8)
    out.view(torch.int32).view(words, 8, k // 8).copy_(columns.transpose(1, 2))


TABLE_MOVE_DEVICES = {"cpu"}
"""Device types whose block moves go through numpy's `take` (see `_move_blocks`); the
tests empty it to check the strided-copy path a GPU takes, on the CPU."""


def _table_moves(tensor: torch.Tensor) -> bool:
    return tensor.device.type in TABLE_MOVE_DEVICES and not torch.compiler.is_compiling()


def _move_blocks(
    source: torch.Tensor, block: tuple[int, ...], order: tuple[int, ...], out: torch.Tensor
) -> None:
    """out[x, y] = source[x, y] with each block's bytes, seen as digits `block`, permuted
    to `order`; `source` and `out` are uint8 [X, Y, prod(block)] (`out` may be a slice).

    On a GPU one strided copy (a single kernel). On the CPU torch's copy of a 7-D byte
    permutation is several times slower than numpy's `take` over one fixed table of the
    block's bytes, so the CPU takes that path."""
    x, y, _ = (int(d) for d in source.shape)
    if _table_moves(source):
        table = _block_table(block, order)
        np.take(source.numpy(), table, axis=2, out=out.numpy(), mode="clip")
        return
    target = tuple(block[d] for d in order)
    shifted = (0, 1, *(2 + d for d in order))
    out.view(x, y, *target).copy_(source.view(x, y, *block).permute(shifted))


@functools.cache
def _block_table(block: tuple[int, ...], order: tuple[int, ...]) -> npt.NDArray[np.intp]:
    """Source byte of each target byte of one block."""
    table = np.arange(math.prod(block), dtype=np.intp).reshape(block).transpose(order)
    return np.ascontiguousarray(table).reshape(-1)


# Marlin (16-bit activations): in a 16x64 tile k = 8a + 2q + b, n = 16j + 8c + r; word
# (r, q, j) holds byte (b, c) with the a = 0 code in the low nibble (marlin_layout).
def marlin4_from_gptq(stored: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """GPTQ int4 [K/8, N] -> Marlin bytes [K/16, N/64, 512]: words of a = 0 and a = 1 (the
    two words of each k tile) exchange nibbles into b = 0 / b = 1 bytes (byte q of a word),
    then each 512-byte block's (j, c, r, b, q) moves to (r, q, j, b, c)."""
    k8, n = (int(d) for d in stored.shape)
    kt = k8 // 2
    pairs = stored.view(kt, 2, n)
    mixed = _pair(pairs[:, 0], pairs[:, 1])  # [kt, n, b] words of bytes q
    source = mixed.view(torch.uint8).view(kt, n // 64, 512)
    _move_blocks(source, (4, 2, 8, 2, 4), (2, 4, 0, 3, 1), out)


def marlin4_from_ct(stored: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """compressed-tensors int4 [N, K/8]: the same exchange, words (a = 0, 1) adjacent."""
    n, k8 = (int(d) for d in stored.shape)
    kt = k8 // 2
    pairs = stored.view(n, kt, 2)
    mixed = _pair(pairs[..., 0], pairs[..., 1])
    source = mixed.view(torch.uint8).view(n // 64, 4, 2, 8, kt, 2, 4)  # nt j c r kt b q
    out.view(kt, n // 64, 8, 4, 4, 2, 2).copy_(source.permute(4, 0, 3, 6, 1, 5, 2))


def marlin4_from_awq(stored: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """AWQ int4 [K, N/8]: rows k and k+8 of a tile (a = 0, 1) exchange nibbles; byte i of
    the low/high word holds column r = 4*(i%2) + 2*high + i//2 of word nw = 8nt + 2j + c.

    For the CPU's table move the exchange reads the rows through a transposed view so each
    64-column block comes out contiguous; a GPU exchanges in storage order (coalesced) and
    lets its one strided copy gather the blocks."""
    k, words = (int(d) for d in stored.shape)
    kt = k // 16
    if _table_moves(stored):
        pairs = stored.view(kt, 2, 8, words).transpose(2, 3)  # kt a nw kin
        mixed = _pair(pairs[:, 0], pairs[:, 1])  # [kt, nw, kin, high] words of bytes i
        source = mixed.view(torch.uint8).view(kt, words // 8, 512)
        # block digits: j c q b high ih il -> r = (il, high, ih), q, j, b, c
        _move_blocks(source, (4, 2, 4, 2, 2, 2, 2), (6, 4, 5, 2, 0, 3, 1), out)
        return
    pairs = stored.view(kt, 2, 8, words)
    mixed = _pair(pairs[:, 0], pairs[:, 1])  # [kt, kin, nw, high] words of bytes i
    # kt q b nt j c high ih il -> kt nt (il high ih) q j b c
    digits = mixed.view(torch.uint8).view(kt, 4, 2, words // 8, 4, 2, 2, 2, 2)
    target = out.view(kt, words // 8, 2, 2, 2, 4, 4, 2, 2)
    target.copy_(digits.permute(0, 3, 8, 6, 7, 1, 4, 2, 5))


def marlin8_from_gptq(stored: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """GPTQ int8 [K/4, N] (byte 2*(q%2)+b of word 4kt + 2a + q//2): a byte permutation
    into Marlin's int8 tile order (r, q, j, c, b, a)."""
    k4, n = (int(d) for d in stored.shape)
    kt = k4 // 4
    source = stored.view(torch.uint8).view(kt, 2, 2, n // 64, 4, 2, 8, 2, 2)
    # kt a qh nt j c r ql b -> kt nt r qh ql j c b a
    out.view(kt, n // 64, 8, 2, 2, 4, 2, 2, 2).copy_(source.permute(0, 3, 6, 2, 7, 4, 5, 8, 1))


def marlin8_from_ct(stored: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """compressed-tensors int8 [N, K/4]: bytes [N, K] permuted the same way."""
    n, k4 = (int(d) for d in stored.shape)
    kt = k4 // 4
    source = stored.view(torch.uint8).view(n // 64, 4, 2, 8, kt, 2, 2, 2, 2)
    # nt j c r kt a qh ql b -> kt nt r qh ql j c b a
    out.view(kt, n // 64, 8, 2, 2, 4, 2, 2, 2).copy_(source.permute(4, 0, 3, 6, 7, 1, 2, 8, 5))
