"""One MoE layer of a whole-checkpoint job through the conversion routes, stage by stage.

The job hands each layer's mapped source tensors to a `Converter` and writes what comes
back. `registry_converter` is the job's own: the tensors to the job's device, the layer
through `routes.convert` (a direct route where one covers it, else the canonical one; the
same bytes either way), the result back to pinned host memory. With `stages`, each call adds
its seconds per stage there (`to_device`: the mapped shard pages read and copied to the GPU;
`repack`; `to_host`), the device synchronized between stages so each stage's time is its
own: where a layer's time goes is what a slow conversion needs to show first.

Torch is imported only when a converter is built: the job's torch-free parts (the plan, the
journal) stay importable in the server process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from service.formats.checkpoint.plan import CheckpointJob, MoELayerPlan

if TYPE_CHECKING:
    import torch

    from service.formats.writers import ConvertedLayer

__all__ = ["Converter", "LayerRoute", "registry_converter", "route_converter"]

Converter = Callable[[MoELayerPlan, Mapping[str, "torch.Tensor"]], tuple[dict[str, Any], Any]]
"""(layer, its per-expert tensors) -> (kernel tensors on the CPU, descriptor JSON)."""

LayerRoute = Callable[..., "ConvertedLayer"]
"""A conversion route with `routes.convert.convert`'s signature."""


def registry_converter(job: CheckpointJob, *, stages: dict[str, float] | None = None) -> Converter:
    """The job's converter: every layer through `routes.convert.convert`."""
    from service.formats.routes.convert import convert

    return route_converter(job, convert, stages=stages)


def route_converter(
    job: CheckpointJob, route: LayerRoute, *, stages: dict[str, float] | None = None
) -> Converter:
    """Per-expert tensors of one layer -> (kernel tensors on the CPU, descriptor JSON)
    through `route`; `stages` as in the module doc."""
    import torch

    from service.formats import registry
    from service.formats.writers import ConversionOptions, descriptor_json

    quant = registry.SourceQuantization(
        bits=job.source.bits,
        group_size=job.source.group_size,
        symmetric=job.source.symmetric,
        desc_act=job.source.desc_act,
        gptq_v2=job.source.gptq_v2,
    )
    registry.writer_for(job.target.backend)  # ConversionUnsupported before any work
    options = ConversionOptions(ruleset=job.target.ruleset)
    device = torch.device(job.device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def lap(stage: str, since: float) -> float:
        now = time.perf_counter()
        if stages is not None:
            sync()
            now = time.perf_counter()
            stages[stage] = stages.get(stage, 0.0) + now - since
        return now

    def convert(
        layer: MoELayerPlan, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, Any], Any]:
        began = time.perf_counter()
        if device.type != "cpu":
            tensors = {k: v.to(device, non_blocking=True) for k, v in tensors.items()}
            began = lap("to_device", began)
        converted = route(
            job.source.layout,
            tensors,
            quant,
            job.target.backend,
            num_experts=job.num_experts or layer.num_experts,
            gated=job.gated,
            options=options,
        )
        began = lap("repack", began)
        out = {k: _to_host(v) for k, v in converted.tensors.items()}
        sync()
        if device.type != "cpu":
            lap("to_host", began)
        return out, descriptor_json(converted.descriptor)

    return convert


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A device tensor copied into pinned host memory (the caller synchronizes). A copy
    into fresh pageable memory goes through the driver's staging buffer and first-touch
    page faults; pinned blocks come from torch's caching host allocator,
    reused layer after layer, and the copy runs at the link's speed. The bytes are the
    same: the copy is contiguous in the tensor's logical order, as `tensor_bytes` reads."""
    import torch

    if tensor.device.type == "cpu":
        return tensor
    if tensor.device.type != "cuda":
        return tensor.to("cpu")
    host = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
