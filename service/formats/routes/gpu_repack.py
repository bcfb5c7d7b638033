"""Fused Triton repack kernels for the direct packed -> packed routes on a GPU.

The torch direct routes (`routes.direct`, `routes.transforms`) move a weight in several
passes (a nibble exchange over int32 words, then a strided byte copy), expert by expert, far
below the memory bandwidth. Every one of those routes is a fixed permutation of the weight's
nibbles (bytes for 8-bit codes, whole words for a transpose) that repeats tile by tile, so a
kernel assembles each output int32 word in registers from the input words its fields come
from and stores whole words: every input byte read from memory once, every output byte
written once. `Repack.run` converts all of a projection's stored tensors (every expert, gate
and up) in one launch, the kernel reading each slab's two pointers from a small device
table: at Mixtral's size one tensor is a few microseconds of bandwidth, less than a launch
costs the host.

The kernels (`gpu_repack_kernel`): a 2-D word transpose (GPTQ -> TRITON), a dedicated AWQ
int4 -> TRITON kernel (an 8 x 8 nibble transpose per block, constant shifts), dedicated GPTQ
/ AWQ int4 -> Marlin kernels (a block of 16 x 64 tiles from int32 x 4 loads, constant
shifts, one turn through shared memory to the store order), and a table kernel for the other
Marlin routes (int8; bench/repack_variants.py keeps the int4 ones for comparison), which
gathers one input word per nibble field. The table is not written down a second time:
`Repack` derives it by running the route's own torch transform (the exactness reference) on
the CPU over a probe of 2 x 2 tiles whose nibbles hold their own positions (one pass per
4-bit digit), checks that the four tiles agree (the route is tile-periodic), and keeps the
table of one tile: for each output word and field, the input word (row and column inside the
input tile) and the field's bit offset there. Fields are as wide as the permutation allows
(32 bits for a word transpose, 8 for int8, 4 for int4).

Triton is imported only when a kernel first runs, so the CPU-only path never needs it.
`KERNEL_DEVICES` names the device types that take the kernels (the tests add "cpu" under
TRITON_INTERPRET=1).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable, Sequence
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
    `packed[s * words + w]` = input row << 16 | input column << 8 | bit offset, inside
    the input tile."""

    width: int
    fields: int
    packed: torch.Tensor


KINDS = ("table", "transpose", "awq_triton", "marlin4_gptq", "marlin4_awq")
"""Which kernel a `Repack` launches: `table` (any tile-periodic permutation, table read off
the route's torch transform), `transpose` (a word transpose), `awq_triton` (AWQ int4 ->
TRITON's 8 x 8 nibble transpose), `marlin4_gptq` / `marlin4_awq` (GPTQ / AWQ int4 ->
Marlin, one 16 x 64 tile per 128 output words, constant shifts). `transpose` and
`awq_triton` are transposed: output tile (i, j) comes from input tile (j, i)."""

_TRANSPOSED = frozenset({"transpose", "awq_triton"})


@dataclass
class Repack:
    """A route's weight transform as one Triton kernel (a `direct.WeightFn`; `run` does
    many stored tensors, e.g. a projection's experts, in one launch).

    `in_tile`/`out_tile` are one tile's [rows, cols] of int32 words in the stored tensor and
    in the output word matrix. Shapes that are not whole tiles (or outputs that are not int32
    word matrices) take the torch transform `fallback`."""

    fallback: Callable[[torch.Tensor, torch.Tensor, int], None]
    probe: ProbeFn
    bits: int
    in_tile: tuple[int, int]
    out_tile: tuple[int, int]
    kind: str = "table"
    _tables: dict[str, _Table] = field(default_factory=dict, repr=False)
    _consts: dict[bool, dict[str, int | bool]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown kernel kind {self.kind!r}")

    def constexprs(self, aligned: bool) -> dict[str, int | bool]:
        """`launch_constexprs`, computed once per alignment."""
        found = self._consts.get(aligned)
        if found is None:
            found = self._consts[aligned] = launch_constexprs(self, aligned=aligned)
        return found

    @property
    def transposed(self) -> bool:
        return self.kind in _TRANSPOSED

    def table(self, device: torch.device) -> _Table:
        found = self._tables.get(str(device))
        if found is None:
            cpu = self._tables.get("cpu") or _derive(self)
            self._tables["cpu"] = cpu
            found = _Table(cpu.width, cpu.fields, cpu.packed.to(device))
            self._tables[str(device)] = found
        return found

    def __call__(self, stored: torch.Tensor, out: torch.Tensor, bits: int) -> None:
        self.run([(stored, out)], bits)

    def run(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], bits: int) -> None:
        """Each (stored tensor, its output view) converted, in one launch when they all
        have one shape and strides (a projection's experts and shards do), else one by one
        (through the torch transform where a pair is not whole tiles)."""
        slabs = [self._slab(stored, out) for stored, out in pairs]
        if not slabs:
            return
        first = slabs[0]
        if first is None or any(s is None or s.key != first.key for s in slabs):
            for (stored, out), slab in zip(pairs, slabs, strict=True):
                if slab is None:
                    self.fallback(stored, out, bits)
                else:
                    _launch(self, slab, [slab.stored], [slab.matrix.data_ptr()])
            return
        whole = [s for s in slabs if s is not None]
        _launch(self, first, [s.stored for s in whole], [s.matrix.data_ptr() for s in whole])

    def run_experts(
        self,
        stored: Sequence[Sequence[torch.Tensor]],
        views: Sequence[torch.Tensor],
        step: int,
        bits: int,
    ) -> bool:
        """A projection in one launch: `stored[e][s]` into `views[s]` (shard s's output view
        of expert 0) moved on by e * `step` bytes (expert e's copy of that view). Only the
        first expert's views are cut and checked (the host's time per tensor is most of a
        tensor's time at Mixtral's size); the others must be tensors of the same shape,
        contiguous, on the device. False (nothing done) when the layer does not fit: the
        caller then cuts every view and calls `run`."""
        heads = [self._slab(tensor, view) for tensor, view in zip(stored[0], views, strict=False)]
        first = heads[0] if heads else None
        if first is None or any(h is None or h.key != first.key for h in heads):
            return False
        shape, device = first.stored.shape, first.stored.device
        sources: list[torch.Tensor] = []
        targets: list[int] = []
        for expert, shards in enumerate(stored):
            if len(shards) != len(heads):
                return False
            for tensor, head in zip(shards, heads, strict=True):
                if not (
                    tensor.shape == shape
                    and tensor.dtype == torch.int32
                    and tensor.device == device
                    and tensor.is_contiguous()
                ):
                    return False
                sources.append(tensor)
                assert head is not None
                targets.append(head.matrix.data_ptr() + expert * step)
        _launch(self, first, sources, targets)
        return True

    def _slab(self, stored: torch.Tensor, out: torch.Tensor) -> _Slab | None:
        matrix = _word_matrix(out)
        if matrix is None or stored.dim() != 2 or int(matrix.stride(1)) != 1:
            return None
        tir, tic = self.in_tile
        tor, toc = self.out_tile
        rows, cols = (int(d) for d in stored.shape)
        if (
            stored.dtype != torch.int32
            or rows % tir
            or cols % tic
            or int(matrix.shape[0]) % tor
            or int(matrix.shape[1]) % toc
            or matrix.device != stored.device
        ):
            return None
        tiles = (int(matrix.shape[0]) // tor, int(matrix.shape[1]) // toc)
        source_tiles = (tiles[1], tiles[0]) if self.transposed else tiles
        if source_tiles != (rows // tir, cols // tic):
            return None
        stored = stored.contiguous()
        key = (tiles, cols, int(matrix.stride(0)), stored.device)
        return _Slab(stored, matrix, key)


@dataclass(frozen=True)
class _Slab:
    """One stored tensor and its output word matrix; `key` = what one launch shares
    (tile counts, the strides, the device)."""

    stored: torch.Tensor
    matrix: torch.Tensor
    key: tuple[tuple[int, int], int, int, torch.device]

    @property
    def tiles(self) -> tuple[int, int]:
        return self.key[0]


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
            packed = (h[..., 0] << 16) | (h[..., 1] << 8) | (h[..., 2] * 4)  # [word, field]
            return _Table(width, 8 // f, packed.t().reshape(-1).to(torch.int32).contiguous())
    raise AssertionError("unreachable: 4-bit fields always fit")


# -- the kernels ------------------------------------------------------------------------


NUM_WARPS = 8
"""Warps per program (the block sizes below give each thread 8-16 words)."""

_TABLE_WORDS = 2048
"""Output words per program of the table kernel (8 per thread, times S field loads)."""

KERNEL_NAMES = {
    "table": "table_kernel",
    "transpose": "transpose_kernel",
    "awq_triton": "awq_triton_kernel",
    "marlin4_gptq": "marlin4_gptq_kernel",
    "marlin4_awq": "marlin4_awq_kernel",
}
"""`Repack.kind` -> its kernel in `gpu_repack_kernel`."""


def launch_constexprs(repack: Repack, *, aligned: bool = True) -> dict[str, int | bool]:
    """The compile-time parameters of `repack`'s kernel (what `_launch` passes, and what
    the CPU test compiles for sm_90a: one set per route and bit width). Every block size is
    a power of two, so the kernels' index arithmetic is shifts and masks."""
    if repack.kind == "transpose":
        return {"BI": 64, "BJ": 64, "ALIGNED": aligned}
    if repack.kind == "awq_triton":
        return {"BK": 16, "BN": 32, "ALIGNED": aligned}
    if repack.kind in ("marlin4_gptq", "marlin4_awq"):
        # 2 k tiles x 16 n tiles = 4096 output words: 16 per thread with 8 warps
        return {"BI": 2, "BJ": 16, "ALIGNED": aligned}
    table = repack.table(torch.device("cpu"))
    tor, toc = repack.out_tile
    per_tile = tor * toc
    block = max(1, _TABLE_WORDS // per_tile)
    return {
        "TIR": repack.in_tile[0],
        "TIC": repack.in_tile[1],
        "TOR": tor,
        "TOC": toc,
        "S": table.fields,
        "F": table.width,
        "BI": 1,
        "BJ": block,
        "ALIGNED": aligned,
    }


def _launch(
    repack: Repack, head: _Slab, sources: Sequence[torch.Tensor], targets: Sequence[int]
) -> None:
    """One launch over the slabs (`sources[i]` -> the word matrix at address `targets[i]`),
    all shaped and strided as `head`."""
    device = head.stored.device
    addresses = tuple([t.data_ptr() for t in sources] + list(targets))
    # Keyed by the stream too: a table made (copied) on one stream is not yet ordered
    # before a kernel on another.
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    ptrs = _pointer_table(device, stream, addresses)
    src_stride, dst_stride = int(head.stored.stride(0)), int(head.matrix.stride(0))
    # Every pointer 16-byte aligned and every row a multiple of 16 bytes (fresh torch
    # allocations and Mixtral's shapes are): the kernels may then vectorize.
    aligned = all(a % 16 == 0 for a in addresses) and src_stride % 4 == 0 and dst_stride % 4 == 0
    consts = repack.constexprs(aligned)
    kernel = _kernel(repack.kind)
    tiles = head.tiles
    count = len(sources)
    # The two extents the grid's axes 0 and 1 cover: the transposed kernels count
    # (output rows, output words) and (input blocks of 8 rows, input words), the table
    # kernel output tiles.
    extent = (tiles[1], tiles[0]) if repack.kind == "awq_triton" else tiles
    blocks = ("BK", "BN") if repack.kind == "awq_triton" else ("BI", "BJ")
    grid = (
        triton_cdiv(extent[0], int(consts[blocks[0]])),
        triton_cdiv(extent[1], int(consts[blocks[1]])),
        count,
    )
    table = (repack.table(device).packed,) if repack.kind == "table" else ()
    # Triton launches on the current CUDA device: make it the tensors' (a multi-GPU
    # conversion converts on several devices from one process).
    with _on_device(device):
        kernel[grid](
            ptrs,
            count,
            *table,
            src_stride,
            dst_stride,
            *extent,
            **consts,
            num_warps=NUM_WARPS,
        )


@functools.lru_cache(maxsize=64)
def _pointer_table(device: torch.device, stream: int, addresses: tuple[int, ...]) -> torch.Tensor:
    """The slab pointers as a device int64 tensor, kept per address set: its content is its
    key, so a kept one is always right, and consecutive layers of one shape usually get the
    same addresses back from torch's caching allocator (no host tensor, pinning and copy
    per launch then)."""
    return _to_device(torch.tensor(addresses, dtype=torch.int64), device)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device` without waiting for the GPU: a plain `.to(cuda)` from pageable
    memory synchronizes the stream, which would make the host wait for every kernel queued
    before this launch (the weight writes then cost host time plus device time). Pinned,
    the copy is queued like a kernel; torch's pinned allocator keeps the buffer until the
    copy has run."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _on_device(device: torch.device) -> Any:
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _kernel(kind: str) -> Any:
    """The Triton kernel of `kind`, imported on first use (so importing this module needs no
    Triton, and the TRITON_INTERPRET switch is read when the tests have set it)."""
    from service.formats.routes import gpu_repack_kernel
    from service.triton_runtime import fix_interpreter_index, interpreting

    if interpreting():
        fix_interpreter_index()
    return getattr(gpu_repack_kernel, KERNEL_NAMES[kind])
