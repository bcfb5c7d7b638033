"""The direct routes' targets: how a backend's tensors are allocated, cut and completed.

A `WeightTarget` says how the output weight of one backend family is allocated, which bytes
hold a given block of one expert's output rows (what a weight transform writes into), which
other tensors complete the layer (scales, zero points, bias, from the packed layer's
canonical parts), and which layers it takes at all (every other layer takes the canonical
route). TRITON's tensors are the TRITON writer's; MARLIN's are shared by MARLIN and
BATCHED_MARLIN.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from service.formats import bits as packing
from service.formats.routes.packed import PackedLayer, PackedProjection
from service.formats.writers import ConversionOptions
from service.formats.writers import marlin_layout as mlayout
from service.formats.writers.marlin import MARLIN_GROUP_SIZES, padded_intermediate

__all__ = ["MARLIN", "TRITON", "WeightTarget"]


@dataclass(frozen=True)
class WeightTarget:
    """How a backend's weight tensor is allocated and sliced per expert and row block.

    `allocate(e, n, k, bits, device)` gives the output weight; `rows(out_e, start, stop,
    bits)` the bytes of output rows [start, stop) of one expert's slice."""

    allocate: Callable[[int, int, int, int, torch.device], torch.Tensor]
    rows: Callable[[torch.Tensor, int, int, int], torch.Tensor]
    tensors: Callable[[PackedLayer, torch.Tensor, torch.Tensor], dict[str, torch.Tensor | None]]
    applies: Callable[[PackedLayer, ConversionOptions], bool]


def _triton_allocate(e: int, n: int, k: int, bits: int, device: torch.device) -> torch.Tensor:
    return torch.empty(e, n, k * bits // 8, dtype=torch.uint8, device=device)


def _triton_rows(out_e: torch.Tensor, start: int, stop: int, bits: int) -> torch.Tensor:
    return out_e[start:stop]


def _triton_tensors(
    layer: PackedLayer, w13: torch.Tensor, w2: torch.Tensor
) -> dict[str, torch.Tensor | None]:
    def zeros(p: PackedProjection) -> torch.Tensor | None:
        return None if p.zeros is None else packing.pack(p.zeros, p.bits, 1, torch.uint8)

    return {
        "w13_qweight": w13,
        "w2_qweight": w2,
        "w13_scales": layer.w13.scales.contiguous(),
        "w2_scales": layer.w2.scales.contiguous(),
        "w13_qzeros": zeros(layer.w13),
        "w2_qzeros": zeros(layer.w2),
        "w13_bias": layer.w13.bias,
        "w2_bias": layer.w2.bias,
    }


def _triton_applies(layer: PackedLayer, options: ConversionOptions) -> bool:
    return all(p.g_idx is None and (p.bits != 4 or p.n % 2 == 0) for p in (layer.w13, layer.w2))


def _marlin_allocate(e: int, n: int, k: int, bits: int, device: torch.device) -> torch.Tensor:
    return torch.empty(e, k // 16, n * 16 * bits // 32, dtype=torch.int32, device=device)


def _marlin_rows(out_e: torch.Tensor, start: int, stop: int, bits: int) -> torch.Tensor:
    """Output rows [start, stop) are whole 64-wide n tiles of every k tile."""
    k_tiles = int(out_e.shape[0])
    tiles = out_e.view(torch.uint8).view(k_tiles, -1, 64 * 16 * bits // 8)
    return tiles[:, start // 64 : stop // 64]


def _marlin_tensors(
    layer: PackedLayer, w13: torch.Tensor, w2: torch.Tensor
) -> dict[str, torch.Tensor | None]:
    out: dict[str, torch.Tensor | None] = {"w13_qweight": w13, "w2_qweight": w2}
    for name, p in (("w13", layer.w13), ("w2", layer.w2)):
        out[f"{name}_scales"] = _marlin_scales(p)
    for name, p in (("w13", layer.w13), ("w2", layer.w2)):
        out[f"{name}_qzeros"] = (
            None
            if p.zeros is None
            else mlayout.pack_zero_points(p.zeros.transpose(1, 2).contiguous(), p.bits)
        )
    for name, p in (("w13", layer.w13), ("w2", layer.w2)):
        if p.bias is None:
            out[f"{name}_bias"] = None
        else:
            index = _gather_index("bias", int(p.bias.shape[1]), p.bias.device)
            out[f"{name}_bias"] = torch.index_select(p.bias, 1, index)
    return out


def _marlin_scales(p: PackedProjection) -> torch.Tensor:
    """`mlayout.permute_scales` of the K-first scales [E, G, N], as one gather straight
    from the per-shard stack (K-first already for GPTQ and AWQ: no transpose copy first):
    the permutation moves channels only within runs of 64 (32), which never straddle gate
    and up (Marlin's route needs N/S a multiple of 64), so each shard permutes alone."""
    e, shards, rows, groups = (int(d) for d in p.shard_scales.shape)
    grouped = p.num_groups > 1
    if rows % 64:
        return mlayout.permute_scales(p.scales.transpose(1, 2), grouped)
    index = _gather_index("grouped" if grouped else "channelwise", rows, p.device)
    k_first = p.shard_scales.permute(0, 3, 1, 2)  # [E, G, S, N/S], a view
    return torch.index_select(k_first, 3, index).reshape(e, groups, shards * rows)


_ORDERS: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "grouped": lambda x: mlayout.permute_scales(x, True),
    "channelwise": lambda x: mlayout.permute_scales(x, False),
    "bias": lambda x: mlayout.permute_bias(x[0]).unsqueeze(0),
}


@functools.lru_cache(maxsize=32)
def _gather_index(order: str, width: int, device: torch.device) -> torch.Tensor:
    """The source channel of each output channel of `_ORDERS[order]` over `width` channels:
    that very function applied to 0, 1, ..., width - 1 (so the gather is its permutation by
    construction), kept on the device."""
    channels = torch.arange(width, dtype=torch.int64).view(1, 1, width)
    return _ORDERS[order](channels).reshape(width).to(device)


_A16 = (None, torch.float16, torch.bfloat16)


def _marlin_applies(layer: PackedLayer, options: ConversionOptions) -> bool:
    """16-bit activations, no act-order, no padding, shapes Marlin tiles: everything else
    (and every refusal) is the canonical writer's."""
    w13, w2 = layer.w13, layer.w2
    inter, group = layer.intermediate_size, w13.group_size
    return (
        options.activation_dtype in _A16
        and options.extra.get("act_order", "reject") in ("reject", "sort")
        and w13.g_idx is None
        and w2.g_idx is None
        and group in MARLIN_GROUP_SIZES
        and layer.hidden_size % 128 == 0
        and inter % 64 == 0
        and padded_intermediate(inter, group) == inter
        and w13.n in (inter, 2 * inter)
        and all(len(shards) * inter == w13.n for shards in w13.weights)
    )


TRITON = WeightTarget(_triton_allocate, _triton_rows, _triton_tensors, _triton_applies)


MARLIN = WeightTarget(_marlin_allocate, _marlin_rows, _marlin_tensors, _marlin_applies)
