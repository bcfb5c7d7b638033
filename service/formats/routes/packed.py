"""A MoE layer read for a direct route: every check done, the weights still packed.

The canonical form (`formats.canonical`) unpacks every weight to one byte per code; a direct
route never does. `PackedLayer` is what a direct route reads instead: the weight tensors
exactly as the checkpoint stores them (per expert, per shard), everything else (scales,
zero points, g_idx, bias: a few percent of the bytes) already in canonical terms, so the
writers' rules for those are stated once.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from service.formats.readers.layouts import SourceLayout

__all__ = ["PackedLayer", "PackedProjection"]


@dataclass(frozen=True)
class PackedProjection:
    """One projection of every expert with its weight still packed as the checkpoint has it.

    `weights[e]` lists expert e's stored weight tensors (2-D, source storage order) whose
    output rows follow one another (gate then up for w13). Everything else is canonical:
    `zeros` uint8 [E, N, G] (real) or None, `g_idx`, `bias`; the scales are kept per shard
    as `shard_scales` [E, S, N/S, G], any strides (S = 2 for a fused w13: gate, up): a view
    of the one stack of the stored tensors, so a target that wants them K-first (Marlin)
    gathers them straight from the stored order, and only a target that wants canonical
    [E, N, G] (`scales`, computed on first use) pays for the transpose.
    """

    weights: Sequence[Sequence[torch.Tensor]]
    n: int
    k: int
    bits: int
    group_size: int
    shard_scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    bias: torch.Tensor | None

    @functools.cached_property
    def scales(self) -> torch.Tensor:
        """Canonical [E, N, G], contiguous (one copy unless the stored order was already)."""
        e, s, rows, g = (int(d) for d in self.shard_scales.shape)
        return self.shard_scales.reshape(e, s * rows, g).contiguous()

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @property
    def num_experts(self) -> int:
        return len(self.weights)

    @property
    def num_groups(self) -> int:
        return int(self.shard_scales.shape[3])

    @property
    def device(self) -> torch.device:
        return self.shard_scales.device


@dataclass(frozen=True)
class PackedLayer:
    layout: SourceLayout
    w13: PackedProjection
    w2: PackedProjection

    @property
    def hidden_size(self) -> int:
        return self.w13.k

    @property
    def intermediate_size(self) -> int:
        return self.w2.k
