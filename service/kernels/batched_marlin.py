"""BATCHED_MARLIN: vLLM's Marlin MoE GEMM over tokens batched by expert, on our MARLIN layout.

vLLM 0.33's `BatchedMarlinExperts` (fused_moe/experts/marlin_moe.py, `batched_fused_marlin_moe`)
runs the very op MARLIN runs, `_moe_C.moe_wna16_marlin_gemm`, on the same repacked weights,
scales and zero points (the BATCHED_MARLIN writer writes the MARLIN tensors). What differs is
the activation format: its hidden states arrive already dispatched by an expert-parallel
all-to-all as a [E, T, H] batch (expert e's tokens in rows [e, :count_e), the rest unused),
read as a [E*T, H] matrix with top_k = 1 (each row belongs to exactly one expert, its batch)
and aligned by `batched_moe_align_block_size` from the per-expert counts. The router weights
are not applied inside (the kernel gets ones); vLLM's finalize step sums each token's k
expert rows with its weights.

Outside vLLM no all-to-all hands us that batch, so this adapter builds it: it dispatches the
[M, H] hidden states into [E, T, H] (T = the largest per-expert count, read back to the host
once per forward: vLLM sizes T from its configured `max_num_tokens` instead), aligns the
batch with our own torch version of the batched alignment, runs the two GEMMs exactly as
`batched_fused_marlin_moe` calls them (same block size rule, top_k 1, ones as router weights,
`mul_topk_weights` in GEMM2), and does the weighted top-k sum in float32. Same interface,
same answer as MARLIN; what it measures is the batched kernel path, not vLLM's all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from service.kernels.activation import ResolvedActivation
from service.kernels.align import Alignment
from service.kernels.interface import into
from service.kernels.marlin import BLOCK_FILL, BLOCK_SIZES_M, MarlinExperts

BACKEND = "BATCHED_MARLIN"


def batch_block_size(max_tokens: int) -> int:
    """`batched_fused_marlin_moe`'s M block: the first candidate a batch fills under 90%."""
    for block in BLOCK_SIZES_M:
        if max_tokens / block < BLOCK_FILL:
            return block
    return BLOCK_SIZES_M[-1]


@dataclass(frozen=True)
class Batch:
    """Routes dispatched by expert: `rows` [E*T, H] (expert e's routes in rows e*T + i,
    i < counts[e], in their flat route order), `counts` [E] int32, and `slots` [M*k] int64:
    the row of each route (token m, slot s) at index m*k + s."""

    rows: torch.Tensor
    counts: torch.Tensor
    slots: torch.Tensor
    max_tokens: int


def dispatch(hidden_states: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> Batch:
    """The [E, T, H] batch an expert-parallel all-to-all would deliver (flattened to rows)."""
    top_k = int(topk_ids.shape[1])
    device = hidden_states.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    counts = torch.bincount(flat, minlength=num_experts)
    max_tokens = max(int(counts.max()), 1) if flat.numel() else 1
    order = torch.argsort(flat, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    expert_sorted = flat[order]
    rank = torch.arange(flat.numel(), device=device) - starts[expert_sorted]
    slots = torch.empty_like(flat)
    slots[order] = expert_sorted * max_tokens + rank
    rows = hidden_states.new_zeros((num_experts * max_tokens, hidden_states.shape[1]))
    rows[slots] = hidden_states.repeat_interleave(top_k, dim=0)
    return Batch(rows=rows, counts=counts.to(torch.int32), slots=slots, max_tokens=max_tokens)


def batched_align(counts: torch.Tensor, max_tokens: int, block_size: int) -> Alignment:
    """`batched_moe_align_block_size` in torch, without a host synchronisation.

    Expert e's valid rows e*T .. e*T + count_e - 1, padded with the sentinel E*T up to a
    multiple of `block_size`, one expert after another (an expert with no rows gets no
    block); `expert_ids` names each block's expert, -1 past the end; the padded total goes
    in `num_tokens_post_padded`. Buffers are vLLM's size, E * round_up(T, block).
    """
    device = counts.device
    experts = int(counts.numel())
    per_expert = -(-max_tokens // block_size) * block_size
    size = experts * per_expert
    sentinel = experts * max_tokens
    counts64 = counts.to(torch.int64)
    padded = (counts64 + block_size - 1) // block_size * block_size
    offsets = torch.cumsum(padded, 0) - padded
    position = torch.arange(per_expert, device=device)
    expert = torch.arange(experts, device=device)
    # Unused positions write to one spare slot past the end, dropped afterwards.
    dest = torch.where(position < padded[:, None], offsets[:, None] + position, size)
    value = torch.where(
        position < counts64[:, None], expert[:, None] * max_tokens + position, sentinel
    )
    sorted_ids = torch.full((size + 1,), sentinel, dtype=torch.int64, device=device)
    sorted_ids.scatter_(0, dest.reshape(-1), value.reshape(-1))
    blocks = size // block_size
    block_position = torch.arange(per_expert // block_size, device=device)
    block_dest = torch.where(
        block_position < (padded // block_size)[:, None],
        (offsets // block_size)[:, None] + block_position,
        blocks,
    )
    expert_ids = torch.full((blocks + 1,), -1, dtype=torch.int64, device=device)
    expert_ids.scatter_(
        0, block_dest.reshape(-1), expert[:, None].expand_as(block_dest).reshape(-1)
    )
    return Alignment(
        sorted_ids=sorted_ids[:size].to(torch.int32),
        expert_ids=expert_ids[:blocks].to(torch.int32),
        num_tokens_post_padded=padded.sum().reshape(1).to(torch.int32),
        block_size=block_size,
        num_routes=sentinel,
    )


class BatchedMarlinExperts(MarlinExperts):
    """Runs a MARLIN-layout layer through the batched (expert-parallel) Marlin path."""

    name: ClassVar[str] = BACKEND

    def _forward_into(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        activation: ResolvedActivation,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        m, hidden = hidden_states.shape
        top_k = int(topk_ids.shape[1])
        batch = dispatch(hidden_states, topk_ids, self.spec.num_experts)
        block = batch_block_size(batch.max_tokens)
        aligned = batched_align(batch.counts, batch.max_tokens, block)
        # vLLM hands the kernel ones (its finalize step applies the router weights).
        ones = torch.ones(
            (batch.rows.shape[0], 1), dtype=torch.float32, device=hidden_states.device
        )
        down = self._gemm_pair(batch.rows, aligned, ones, 1, activation)
        routed = down[batch.slots].view(m, top_k, hidden).float()
        result = (routed * topk_weights.unsqueeze(-1)).sum(dim=1)
        return into(result.to(hidden_states.dtype), out)
