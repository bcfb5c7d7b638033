"""Fused Triton repack kernels for the direct packed -> packed routes on a GPU.

The torch direct routes (`service.formats.direct`) move a weight in several passes (a
nibble exchange over int32 words, then a strided byte copy): on an H200 they reach 5-15 %
of the memory bandwidth. Every one of those routes is a fixed permutation of the weight's
nibbles (bytes for 8-bit codes, whole words for a transpose) that repeats tile by tile, so
one kernel does them all: each program builds a 2-D block of output tiles, every output
word assembled from the input words its fields come from, and stores whole int32 words.
Every input byte is read from memory once (a tile's input words are re-read from L1 for
each field), every output byte written once.

The permutation is not written down a second time: `Repack` derives it by running the
route's own torch transform (the exactness reference) on the CPU over a probe of 2 x 2
tiles whose nibbles hold their own positions (one pass per 4-bit digit), checks that
the four tiles agree (the route is tile-periodic), and keeps the table of one tile: for
each output word and field, the input word (row and column inside the input tile) and
the field's bit offset there. Fields are as wide as the permutation allows (32 bits for a
word transpose, 8 for int8, 4 for int4), so a transpose moves words, not nibbles; a pure
word transpose (GPTQ -> TRITON) takes the kernel's 2-D block path instead of the table,
coalesced on both sides.

Triton is imported only when a kernel first runs, so the CPU-only path never needs it.
`KERNEL_DEVICES` names the device types that take the kernels (the tests add "cpu" under
TRITON_INTERPRET=1).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["KERNEL_DEVICES", "Repack", "available", "usable"]

KERNEL_DEVICES = {"cuda"}
"""Device types whose weights go through the Triton kernels when Triton is importable."""

ProbeFn = Callable[[torch.Tensor, int], torch.Tensor]
"""(stored int32 [rows, cols] on the CPU, bits) -> the route's output as an int32 word
matrix [rows, cols] (one expert), written by the route's torch transform."""

_TARGET_ELEMENTS = 8192
"""(output words x fields) per program: 32 per thread with 8 warps."""


@functools.cache
def available() -> bool:
    """Triton is importable (the CPU-only install may lack it)."""
    return importlib.util.find_spec("triton") is not None


def usable(device: torch.device) -> bool:
    return device.type in KERNEL_DEVICES and available()


@dataclass(frozen=True)
class _Table:
    """One output tile: for output word w and field s (`fields` per word of `width` bits),
    `packed[w * fields + s]` = input row << 16 | input column << 8 | bit offset, inside
    the input tile."""

    width: int
    fields: int
    packed: torch.Tensor


@dataclass
class Repack:
    """A route's weight transform as one Triton kernel (a `direct.WeightFn`).

    `in_tile`/`out_tile` are one tile's [rows, cols] of int32 words in the stored tensor and
    in the output word matrix; `transposed`: output tile (i, j) comes from input tile
    (j, i). Shapes that are not whole tiles (or outputs that are not int32 word matrices)
    take the torch transform `fallback`."""

    fallback: Callable[[torch.Tensor, torch.Tensor, int], None]
    probe: ProbeFn
    bits: int
    in_tile: tuple[int, int]
    out_tile: tuple[int, int]
    transposed: bool = False
    _tables: dict[str, _Table] = field(default_factory=dict, repr=False)

    def table(self, device: torch.device) -> _Table:
        found = self._tables.get(str(device))
        if found is None:
            cpu = self._tables.get("cpu") or _derive(self)
            self._tables["cpu"] = cpu
            found = _Table(cpu.width, cpu.fields, cpu.packed.to(device))
            self._tables[str(device)] = found
        return found

    def __call__(self, stored: torch.Tensor, out: torch.Tensor, bits: int) -> None:
        matrix = _word_matrix(out)
        tir, tic = self.in_tile
        tor, toc = self.out_tile
        rows, cols = (int(d) for d in stored.shape)
        if (
            matrix is None
            or stored.dtype != torch.int32
            or rows % tir
            or cols % tic
            or int(matrix.shape[0]) % tor
            or int(matrix.shape[1]) % toc
        ):
            self.fallback(stored, out, bits)
            return
        tiles = (int(matrix.shape[0]) // tor, int(matrix.shape[1]) // toc)
        source_tiles = (tiles[1], tiles[0]) if self.transposed else tiles
        if source_tiles != (rows // tir, cols // tic):
            self.fallback(stored, out, bits)
            return
        _launch(self, stored.contiguous(), matrix, tiles)


def _word_matrix(out: torch.Tensor) -> torch.Tensor | None:
    """`out` (a route's target view: rows of int32 words or of bytes, contiguous inside a
    row) as an int32 [rows, words] view, or None when it is not one."""
    try:
        words = out if out.dtype == torch.int32 else out.view(torch.int32)
        return words.view(int(words.shape[0]), -1) if words.dim() > 1 else None
    except RuntimeError:
        return None


# -- the table: the torch transform run over a probe of 2 x 2 tiles ----------------------


def _derive(repack: Repack) -> _Table:
    tir, tic = repack.in_tile
    tor, toc = repack.out_tile
    rows, cols = 2 * tir, 2 * tic
    count = rows * cols * 8  # input nibbles, numbered in memory order
    ids = torch.arange(count, dtype=torch.int64)
    source = torch.empty(0, dtype=torch.int64)
    out = torch.empty(0)
    for digit in range(-(-(count - 1).bit_length() // 4)):
        nibbles = ((ids >> (4 * digit)) & 0xF).to(torch.uint8)
        stored = (nibbles[0::2] | (nibbles[1::2] << 4)).view(torch.int32).view(rows, cols)
        out = repack.probe(stored, repack.bits)
        got = out.contiguous().view(torch.uint8).reshape(-1).to(torch.int64)
        source_digit = torch.stack((got & 0xF, got >> 4), dim=-1).reshape(-1)
        source = source_digit if digit == 0 else source | (source_digit << (4 * digit))
    out_rows, out_cols = int(out.shape[0]), int(out.shape[1])
    if (out_rows, out_cols) != (2 * tor, 2 * toc) or int(source.max()) >= count:
        raise AssertionError(f"probe output {list(out.shape)} is not 2 x 2 tiles {[tor, toc]}")
    # per output nibble: (input row, column, nibble); per tile relative to its input tile
    grid = source.view(2, tor, 2, toc, 8)
    tiles = []
    for ti in range(2):
        for tj in range(2):
            src = grid[ti, :, tj].reshape(-1)
            word, nibble = src // 8, src % 8
            row, col = word // cols, word % cols
            si, sj = (tj, ti) if repack.transposed else (ti, tj)
            tiles.append(torch.stack((row - si * tir, col - sj * tic, nibble), dim=-1))
    first = tiles[0]
    inside = (first[:, 0].clamp(0, tir - 1) == first[:, 0]) & (
        first[:, 1].clamp(0, tic - 1) == first[:, 1]
    )
    if not all(torch.equal(t, first) for t in tiles) or not bool(inside.all()):
        raise AssertionError("the route is not periodic over the declared tiles")
    return _coarsen(first.view(tor * toc, 8, 3))


def _coarsen(nibbles: torch.Tensor) -> _Table:
    """Per output word its 8 nibbles' (row, column, nibble) -> fields as wide as possible:
    a field of f nibbles is f consecutive nibbles of one input word, aligned."""
    for width in (32, 16, 8, 4):
        f = width // 4
        grouped = nibbles.view(-1, 8 // f, f, 3)
        head = grouped[:, :, :1]
        step = torch.arange(f).view(1, 1, f)
        same_word = bool((grouped[..., :2] == head[..., :2]).all())
        in_order = bool((grouped[..., 2] == head[..., 2] + step).all())
        aligned = bool((head[..., 2] % f == 0).all())
        if same_word and in_order and aligned:
            h = head[:, :, 0]
            packed = (h[..., 0] << 16) | (h[..., 1] << 8) | (h[..., 2] * 4)
            return _Table(width, 8 // f, packed.reshape(-1).to(torch.int32).contiguous())
    raise AssertionError("unreachable: 4-bit fields always fit")


# -- the kernel -------------------------------------------------------------------------


NUM_WARPS = 8
"""Warps per program (`_TARGET_ELEMENTS` is sized for them)."""


def launch_constexprs(repack: Repack, table: _Table) -> dict[str, int | bool]:
    """The kernel's compile-time parameters for `repack` (what `_launch` passes, and what
    the CPU test compiles for sm_90a: one set per route and bit width)."""
    tor, toc = repack.out_tile
    per_tile = tor * toc * table.fields
    block = max(1, _TARGET_ELEMENTS // per_tile)
    # A transposed route's lanes run along the input's rows (tile rows i): 32 of them fill
    # a warp (a word transpose, its own 2-D path, takes 64 x 128). Otherwise a square-ish
    # block of tiles.
    if repack.transposed:
        bi = min(block, 64 if per_tile == 1 else 32)
        bj = max(1, block // bi)
    else:
        bj = 1 << (block.bit_length() // 2)
        bi = max(1, block // bj)
    return {
        "TIR": repack.in_tile[0],
        "TIC": repack.in_tile[1],
        "TOR": tor,
        "TOC": toc,
        "S": table.fields,
        "F": table.width,
        "BI": bi,
        "BJ": bj,
        "TRANSPOSED": repack.transposed,
        "WORD_TRANSPOSE": repack.transposed and per_tile == 1,
    }


def _launch(
    repack: Repack, stored: torch.Tensor, out: torch.Tensor, tiles: tuple[int, int]
) -> None:
    table = repack.table(stored.device)
    kernel = _kernel()
    consts = launch_constexprs(repack, table)
    grid = (triton_cdiv(tiles[0], int(consts["BI"])), triton_cdiv(tiles[1], int(consts["BJ"])))
    # Triton launches on the current CUDA device: make it the tensors' (a multi-GPU
    # conversion converts on several devices from one process).
    with _on_device(stored.device):
        kernel[grid](
            stored,
            out,
            table.packed,
            int(stored.stride(0)),
            int(out.stride(0)),
            tiles[0],
            tiles[1],
            **consts,
            num_warps=NUM_WARPS,
        )


def _on_device(device: torch.device) -> Any:
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, imported on first use (so importing this module needs no Triton,
    and the TRITON_INTERPRET switch is read when the tests have set it)."""
    from service.formats import gpu_repack_kernel
    from service.kernels.runtime import fix_interpreter_index, interpreting

    if interpreting():
        fix_interpreter_index()
    return gpu_repack_kernel.repack_kernel
