"""Block alignment of routed tokens to experts, the input every grouped MoE GEMM reads.

Semantics are vLLM's `moe_align_block_size(topk_ids, block_size, num_experts)`:

* the M·k routes (flat index r = token·k + slot) are grouped by expert; each expert's group
  is padded up to a multiple of `block_size` (an expert with no route gets no block);
* `sorted_ids[max_padded]` int32: the routes of expert 0, its padding, the routes of expert
  1, ...; padding and the unused tail hold the sentinel M·k;
* `expert_ids[max_blocks]` int32: the expert of each block of `block_size` slots, -1 for
  blocks past the end;
* `num_tokens_post_padded[1]` int32: the padded total, so a GEMM grid sized for the worst
  case can return early without a host synchronisation.

Buffer sizes are vLLM's: max_padded = M·k + E·(block_size - 1), or at most M·k·block_size
when there are fewer routes than experts. Within an expert the routes keep their flat order
(vLLM's CUDA kernel leaves that order unspecified; a stable order makes the output
deterministic and testable).

Two implementations: Triton kernels (no host synchronisation, so the alignment sits inside
a CUDA graph with the GEMMs; one program when the routes are few, three launches
otherwise), and a torch fallback for CPUs without the Triton interpreter.
"""

# Triton idiom: compile-time parameters are UPPER_CASE and kernels take many arguments;
# @triton.jit device functions are untyped (triton has no type information).
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# ruff: noqa: N803, PLR0917

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from service.kernels.errors import KernelInputError
from service.triton_runtime import fix_interpreter_index, interpreting, triton_unavailable_reason

#: Tiles (blocks x experts, chunks x experts) are kept at about this many elements.
_TILE_ELEMENTS = 16384
#: Routes per chunk: a chunk ranks its routes with one [CHUNK, CHUNK] comparison.
_CHUNK = 128
#: Up to this many routes one program aligns everything (one launch); above, three
#: launches spread the counting and the scatter over one program per chunk.
_SINGLE_PROGRAM_ROUTES = 1024


@dataclass(frozen=True, slots=True)
class Alignment:
    """The aligned routing one GEMM pair reads (see the module docstring)."""

    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_tokens_post_padded: torch.Tensor
    block_size: int
    num_routes: int


def max_padded_size(num_routes: int, num_experts: int, block_size: int) -> int:
    """vLLM's upper bound on the padded route count (the size of `sorted_ids`)."""
    size = num_routes + num_experts * (block_size - 1)
    if num_routes < num_experts:
        size = min(num_routes * block_size, size)
    return size


def align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int, *, impl: str = "auto"
) -> Alignment:
    """Align `topk_ids` [M, k] to `block_size`; `impl` is "auto", "triton" or "torch"."""
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise KernelInputError("topk_ids", "must be an int32 [M, k] tensor")
    if block_size < 1 or num_experts < 1:
        raise KernelInputError("block_size", "block size and expert count must be positive")
    if impl == "auto":
        impl = "torch" if triton_unavailable_reason(topk_ids.device) else "triton"
    if impl == "torch":
        return _align_torch(topk_ids, block_size, num_experts)
    if impl == "triton":
        return _align_triton(topk_ids, block_size, num_experts)
    raise KernelInputError("impl", f"must be auto, triton or torch, got {impl!r}")


def _empty_buffers(
    num_routes: int, block_size: int, num_experts: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    max_padded = max_padded_size(num_routes, num_experts, block_size)
    max_blocks = triton.cdiv(max_padded, block_size)
    return (
        torch.empty(max_padded, dtype=torch.int32, device=device),
        torch.empty(max_blocks, dtype=torch.int32, device=device),
        torch.empty(1, dtype=torch.int32, device=device),
    )


def _align_torch(topk_ids: torch.Tensor, block_size: int, num_experts: int) -> Alignment:
    """The same result from plain torch ops (no host synchronisation either)."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_routes = flat.numel()
    sorted_ids, expert_ids, post_padded = _empty_buffers(
        num_routes, block_size, num_experts, device
    )
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    padded = (counts + block_size - 1) // block_size * block_size
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(key, stable=True)
    grouped = key[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    keep = grouped < num_experts
    order, grouped = order[keep], grouped[keep]
    rank = torch.arange(order.numel(), device=device) - first_of_expert[grouped]
    sorted_ids.fill_(num_routes)
    sorted_ids[starts[grouped] + rank] = order.to(torch.int32)
    total = padded.sum()
    block_start = torch.arange(expert_ids.numel(), device=device) * block_size
    owner = torch.searchsorted(ends, block_start, right=True)
    expert_ids.copy_(torch.where(block_start < total, owner, torch.full_like(owner, -1)))
    post_padded.copy_(total.reshape(1))
    return Alignment(sorted_ids, expert_ids, post_padded, block_size, num_routes)


def _align_triton(topk_ids: torch.Tensor, block_size: int, num_experts: int) -> Alignment:
    reason = triton_unavailable_reason(topk_ids.device)
    if reason is not None:
        raise KernelInputError("topk_ids", f"Triton alignment cannot run here: {reason}")
    if interpreting():
        fix_interpreter_index()
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    num_routes = flat.numel()
    sorted_ids, expert_ids, post_padded = _empty_buffers(
        num_routes, block_size, num_experts, device
    )
    block_e = max(16, triton.next_power_of_2(num_experts))
    # Tiles sized to the problem: decode aligns a handful of routes.
    fill = min(1024, max(16, triton.next_power_of_2(sorted_ids.numel())))
    block_fill = min(max(16, _TILE_ELEMENTS // block_e), triton.next_power_of_2(expert_ids.numel()))
    block_fill = max(16, block_fill)
    if num_routes <= _SINGLE_PROGRAM_ROUTES:
        _align_single_kernel[(1,)](
            flat,
            sorted_ids,
            expert_ids,
            post_padded,
            num_routes,
            num_experts,
            sorted_ids.numel(),
            expert_ids.numel(),
            BS=block_size,
            BLOCK_E=block_e,
            CHUNK=min(_CHUNK, max(16, triton.next_power_of_2(num_routes))),
            FILL=fill,
            BLOCK_FILL=block_fill,
        )
    else:
        num_chunks = triton.cdiv(num_routes, _CHUNK)
        bases = torch.empty((num_chunks, block_e), dtype=torch.int32, device=device)
        fill_per_program = triton.cdiv(triton.cdiv(sorted_ids.numel(), num_chunks), fill) * fill
        _align_count_kernel[(num_chunks,)](
            flat,
            bases,
            sorted_ids,
            num_routes,
            num_experts,
            sorted_ids.numel(),
            fill_per_program,
            BLOCK_E=block_e,
            CHUNK=_CHUNK,
            FILL=fill,
        )
        _align_offsets_kernel[(1,)](
            bases,
            expert_ids,
            post_padded,
            num_chunks,
            expert_ids.numel(),
            BS=block_size,
            BLOCK_E=block_e,
            ROWS=max(1, min(_TILE_ELEMENTS // block_e, triton.next_power_of_2(num_chunks))),
            BLOCK_FILL=block_fill,
        )
        _align_scatter_kernel[(num_chunks,)](
            flat,
            bases,
            sorted_ids,
            num_routes,
            num_experts,
            BLOCK_E=block_e,
            CHUNK=_CHUNK,
        )
    return Alignment(sorted_ids, expert_ids, post_padded, block_size, num_routes)


@triton.jit
def _chunk_ids(ids_ptr, c0, num_routes, num_experts, CHUNK: tl.constexpr):
    """Routes c0 .. c0+CHUNK, their expert ids, and which of them are real, in-range routes."""
    routes = c0 + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + routes, mask=routes < num_routes, other=-1).to(tl.int32)
    valid = (ids >= 0) & (ids < num_experts)
    return routes, tl.where(valid, ids, 0), valid


@triton.jit
def _rank_in_chunk(ids, valid, CHUNK: tl.constexpr):
    """For each route: how many earlier routes of the chunk go to the same expert. A
    [CHUNK, CHUNK] comparison: no scan, and no work proportional to the expert count."""
    same = (ids[None, :] == ids[:, None]) & valid[None, :]
    earlier = tl.arange(0, CHUNK)[None, :] < tl.arange(0, CHUNK)[:, None]
    return tl.sum((same & earlier).to(tl.int32), axis=1)


@triton.jit
def _pick(vector, ids, BLOCK_E: tl.constexpr):
    """vector[ids] for a [BLOCK_E] register vector (a masked reduction, no gather)."""
    hits = ids[:, None] == tl.arange(0, BLOCK_E)[None, :]
    return tl.sum(tl.where(hits, vector[None, :], 0), axis=1)


@triton.jit
def _expert_of_blocks(
    expert_ids_ptr, ends, total, max_blocks, BS: tl.constexpr, BLOCK_FILL: tl.constexpr
):
    """expert_ids[b] = the expert whose padded range holds slot b·BS (-1 past the end)."""
    for b0 in range(0, max_blocks, BLOCK_FILL):
        blocks = b0 + tl.arange(0, BLOCK_FILL)
        slot = blocks * BS
        owner = tl.sum((ends[None, :] <= slot[:, None]).to(tl.int32), axis=1)
        owner = tl.where(slot < total, owner, -1)
        tl.store(expert_ids_ptr + blocks, owner, mask=blocks < max_blocks)


@triton.jit
def _fill_sentinel(sorted_ptr, start, stop, max_padded, value, FILL: tl.constexpr):
    for p0 in range(start, stop, FILL):
        slots = p0 + tl.arange(0, FILL)
        sentinel = tl.zeros([FILL], dtype=tl.int32) + value
        tl.store(sorted_ptr + slots, sentinel, mask=slots < max_padded)


@triton.jit
def _align_single_kernel(
    ids_ptr,
    sorted_ptr,
    expert_ids_ptr,
    post_padded_ptr,
    num_routes,
    num_experts,
    max_padded,
    max_blocks,
    BS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    FILL: tl.constexpr,
    BLOCK_FILL: tl.constexpr,
):
    """Everything in one program (few routes): count, pad, prefix-sum, fill, scatter."""
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, num_routes, CHUNK):
        _, ids, valid = _chunk_ids(ids_ptr, c0, num_routes, num_experts, CHUNK)
        counts += tl.histogram(ids, BLOCK_E, mask=valid)
    padded = (counts + BS - 1) // BS * BS
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(post_padded_ptr, total)
    _expert_of_blocks(expert_ids_ptr, ends, total, max_blocks, BS, BLOCK_FILL)
    _fill_sentinel(sorted_ptr, 0, max_padded, max_padded, num_routes, FILL)
    # The sentinel fill above must land before the scatter below overwrites some of it.
    tl.debug_barrier()
    running = ends - padded
    for c0 in range(0, num_routes, CHUNK):
        routes, ids, valid = _chunk_ids(ids_ptr, c0, num_routes, num_experts, CHUNK)
        dest = _pick(running, ids, BLOCK_E) + _rank_in_chunk(ids, valid, CHUNK)
        tl.store(sorted_ptr + dest, routes, mask=valid)
        running += tl.histogram(ids, BLOCK_E, mask=valid)


@triton.jit
def _align_count_kernel(
    ids_ptr,
    counts_ptr,
    sorted_ptr,
    num_routes,
    num_experts,
    max_padded,
    fill_per_program,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    FILL: tl.constexpr,
):
    """Per chunk of routes: its count per expert; and a share of the sentinel fill."""
    pid = tl.program_id(0)
    _, ids, valid = _chunk_ids(ids_ptr, pid * CHUNK, num_routes, num_experts, CHUNK)
    counts = tl.histogram(ids, BLOCK_E, mask=valid)
    tl.store(counts_ptr + pid * BLOCK_E + tl.arange(0, BLOCK_E), counts)
    start = pid * fill_per_program
    _fill_sentinel(sorted_ptr, start, start + fill_per_program, max_padded, num_routes, FILL)


@triton.jit
def _align_offsets_kernel(
    counts_ptr,
    expert_ids_ptr,
    post_padded_ptr,
    num_chunks,
    max_blocks,
    BS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_FILL: tl.constexpr,
):
    """One program: expert totals, padded offsets, block owners; then, in place, the first
    destination slot of every (chunk, expert) pair."""
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for r0 in range(0, num_chunks, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        tile = tl.load(
            counts_ptr + rows[:, None] * BLOCK_E + experts[None, :],
            mask=rows[:, None] < num_chunks,
            other=0,
        )
        counts += tl.sum(tile, axis=0)
    padded = (counts + BS - 1) // BS * BS
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(post_padded_ptr, total)
    _expert_of_blocks(expert_ids_ptr, ends, total, max_blocks, BS, BLOCK_FILL)
    running = ends - padded
    for r0 in range(0, num_chunks, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        ptrs = counts_ptr + rows[:, None] * BLOCK_E + experts[None, :]
        tile = tl.load(ptrs, mask=rows[:, None] < num_chunks, other=0)
        base = tl.cumsum(tile, axis=0) - tile + running[None, :]
        tl.store(ptrs, base, mask=rows[:, None] < num_chunks)
        running += tl.sum(tile, axis=0)


@triton.jit
def _align_scatter_kernel(
    ids_ptr,
    bases_ptr,
    sorted_ptr,
    num_routes,
    num_experts,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Per chunk: each route's slot = its chunk's base for the expert + its rank in the chunk."""
    pid = tl.program_id(0)
    routes, ids, valid = _chunk_ids(ids_ptr, pid * CHUNK, num_routes, num_experts, CHUNK)
    base = tl.load(bases_ptr + pid * BLOCK_E + ids, mask=valid, other=0)
    dest = base + _rank_in_chunk(ids, valid, CHUNK)
    tl.store(sorted_ptr + dest, routes, mask=valid)
