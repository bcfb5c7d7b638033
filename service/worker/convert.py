"""The worker's conversion jobs: one inline layer, or a whole checkpoint on disk.

Both run in a background thread of the worker (jobs.py) on the worker's own device. Inline
tensors arrive as segments the server filled (ipc/segments.py): they are mapped, viewed as
tensors without a copy, converted, and the results written into new segments of the call's
prefix for the server to stream back. A layer kept loaded stays on the device in the
worker's layer store, registered as the very last step, so a cancelled call never leaves
one behind. Checkpoint jobs arrive fully resolved (paths confined by the server) and report
progress as events.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import torch

from service.formats.checkpoint import job as checkpoint_job
from service.formats.checkpoint import plan as checkpoint_plan
from service.formats.errors import ConvertCancelledError
from service.formats.io.safetensors import tensor_bytes
from service.formats.io.streaming import DTYPES, FROM_TORCH, TensorSpec
from service.formats.routes import inline
from service.ipc.messages import (
    MAX_LISTED_TENSORS,
    CheckpointConverted,
    ConvertCheckpoint,
    ConvertLayer,
    LayerConverted,
    SegmentTensor,
)
from service.ipc.segments import Segment, SegmentDir
from service.oracle import DEFAULT_RULESET
from service.worker.context import WorkerContext
from service.worker.jobs import JobContext
from service.worker.layers import LoadedLayer, new_layer_id, now_rfc3339


def _input_tensor(segment: Segment, spec: TensorSpec) -> torch.Tensor:
    dtype = getattr(torch, DTYPES[spec.dtype].torch_name)
    if spec.byte_size == 0:
        return torch.empty(spec.shape, dtype=dtype)
    return torch.frombuffer(segment.view, dtype=torch.uint8).view(dtype).reshape(spec.shape)


def _wire_spec(name: str, tensor: torch.Tensor, sha256: str) -> TensorSpec:
    dtype = FROM_TORCH[str(tensor.dtype).removeprefix("torch.")]
    return TensorSpec.of(name, dtype, tuple(tensor.shape), sha256=sha256)


def convert_layer(
    worker: WorkerContext, request: ConvertLayer, context: JobContext
) -> LayerConverted:
    segments = SegmentDir(Path(request.segments_dir))
    opened: list[Segment] = []
    made: list[str] = []
    try:
        tensors: dict[str, torch.Tensor] = {}
        for item in request.inputs:
            spec = item.spec
            try:
                segment = segments.open(item.segment, spec.byte_size)
            except FileNotFoundError:
                # The server deletes a call's segments once the call has ended (a client
                # gone, a stream cut by a limit): nobody waits for this answer any more.
                raise ConvertCancelledError(
                    f"input segment {item.segment} is gone: the call was abandoned"
                ) from None
            opened.append(segment)
            tensors[spec.name] = _input_tensor(segment, spec)
        context.check()
        shape = request.shape
        result = inline.convert_layer(
            tensors,
            source=request.source,
            backend=request.backend,
            shape=inline.LayerShape(
                shape.num_experts, shape.hidden_size, shape.intermediate_size, shape.gated
            ),
            device=worker.device,
            keep_device=request.keep_loaded,
            vllm_quantization=request.quantization,
            ruleset=request.ruleset or DEFAULT_RULESET,
        )
        del tensors
        context.check()
        outputs: list[SegmentTensor] = []
        for number, (name, tensor) in enumerate(result.tensors.items()):
            host = tensor.detach().to("cpu").contiguous()
            data = tensor_bytes(host)
            segment_name = ""
            if request.return_tensors:
                segment_name = f"{request.out_prefix}{number}"
                with segments.new(segment_name, len(data)) as out:
                    made.append(segment_name)
                    out.view[:] = data
            described = _wire_spec(name, host, hashlib.sha256(data).hexdigest())
            outputs.append(SegmentTensor(described, segment_name))
            context.check()
        return LayerConverted(
            tensors=tuple(outputs),
            descriptor=result.descriptor,
            device_seconds=result.device_seconds,
            layer_id=_keep(worker, request, result) if request.keep_loaded else "",
        )
    except BaseException:
        for name in made:
            segments.file(name).unlink(missing_ok=True)
        raise
    finally:
        for segment in opened:
            segment.close()


def _keep(worker: WorkerContext, request: ConvertLayer, result: inline.InlineResult) -> str:
    shape = request.shape
    layer_id = new_layer_id()
    descriptor = result.descriptor
    size = sum(t.numel() * t.element_size() for t in result.tensors.values())
    info = {
        "layer_id": layer_id,
        "format": {
            "backend": request.backend,
            "experts_class": request.experts_class,
            "bits": int(descriptor.get("bits", 0)),
            "group_size": int(descriptor.get("group_size", 0)),
            "has_zero_points": bool(descriptor.get("has_zero_points", False)),
            "attributes": format_attributes(descriptor),
        },
        "num_experts": shape.num_experts,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "byte_size": size,
        "load_time": now_rfc3339(),
        "device": worker.device,
    }
    worker.layers.add(
        LoadedLayer(layer_id, info, dict(result.tensors), dict(request.deployment)),
        budget_bytes=request.layer_budget_bytes,
    )
    return layer_id


def format_attributes(descriptor: dict[str, Any]) -> dict[str, str]:
    """The descriptor's layout facts as KernelFormat attributes (strings)."""
    skip = {"backend", "bits", "group_size", "has_zero_points", "dtypes"}
    out = {
        k: str(v).lower() if isinstance(v, bool) else str(v)
        for k, v in descriptor.items()
        if k not in skip
    }
    for name, dtype in (descriptor.get("dtypes") or {}).items():
        out[f"dtype.{name}"] = str(dtype)
    return out


def convert_checkpoint(
    worker: WorkerContext, request: ConvertCheckpoint, context: JobContext
) -> CheckpointConverted:
    job = checkpoint_plan.CheckpointJob.from_json({**request.job, "device": worker.device})
    began = time.perf_counter()
    result = checkpoint_job.convert_checkpoint(
        job, progress=lambda event: context.emit("progress", event), check=context.check
    )
    tensors = result.tensors
    return CheckpointConverted(
        manifest_path=str(result.manifest_path) if result.manifest_path else "",
        output_dir=str(result.output_dir),
        layers_total=result.layers_total,
        layers_converted=result.layers_converted,
        layers_skipped=result.layers_skipped,
        bytes_in=result.bytes_in,
        bytes_out=result.bytes_out,
        seconds=time.perf_counter() - began,
        device_seconds=result.convert_seconds,
        stage_seconds=dict(result.stage_seconds),
        descriptor=result.descriptor,
        tensors=tuple(tensors[:MAX_LISTED_TENSORS]),
        tensors_total=len(tensors),
    )
