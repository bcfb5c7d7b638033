"""ConvertWeights' messages <-> domain: the header, the tensor stream, progress, summary.

The request stream becomes the data plane's header and items (`convert_call`): its first
message must be the header, and a message grpc cannot parse is INVALID_ARGUMENT, not
INTERNAL. The data plane's events become response messages (`event_to_pb`).

Wire dtype names are the `Dtype` enum's own names without the prefix, lower case
(`DTYPE_UINT4_PACKED_INT32` <-> "uint4_packed_int32"), so the table lives once, in
`service.formats.io.streaming.DTYPES`, and a new enum value needs no code here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

from google.protobuf.message import DecodeError

from service.api.codecs.selection import deployment_to_json, platform_choice
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import tensor_pb2
from service.dataplane.convert import (
    CheckpointPaths,
    ChunkReceived,
    ChunkSent,
    ConvertHeader,
    Event,
    Progress,
    StrayHeader,
    StreamItem,
    Summary,
    TensorDeclared,
    TensorSent,
)
from service.formats.errors import ConvertInputError
from service.formats.io.streaming import FROM_SAFETENSORS, Packing, TensorSpec

_DTYPE_PREFIX = "DTYPE_"
_ORDER_PREFIX = "PACK_ORDER_"


def dtype_name(value: int) -> str:
    """Wire dtype name of an enum value ("" for unspecified or unknown values)."""
    try:
        name = tensor_pb2.Dtype.Name(value)
    except ValueError:
        return ""
    return "" if value == tensor_pb2.DTYPE_UNSPECIFIED else name.removeprefix(_DTYPE_PREFIX).lower()


def dtype_value(name: str) -> int:
    return int(tensor_pb2.Dtype.Value(_DTYPE_PREFIX + name.upper()))


def tensor_spec(header: tensor_pb2.TensorHeader) -> TensorSpec:
    """A streamed tensor's declaration. A zero byte_size means "not given": it follows from
    dtype and shape (a wrong non-zero one is an error the validation names)."""
    dtype = dtype_name(header.dtype) or f"<enum {header.dtype}>"
    packing = None
    if header.HasField("packing") and header.packing.order != tensor_pb2.PACK_ORDER_UNSPECIFIED:
        try:
            order = tensor_pb2.PackOrder.Name(header.packing.order).removeprefix(_ORDER_PREFIX)
        except ValueError:  # an unknown (open-enum) value: validation names the field
            order = f"<enum {header.packing.order}>"
        packing = Packing(header.packing.packed_dim, order.lower())
    derived = TensorSpec.of(header.name, dtype, list(header.shape))
    return TensorSpec(
        name=header.name,
        dtype=dtype,
        shape=tuple(header.shape),
        byte_size=header.byte_size or derived.byte_size,
        sha256=header.sha256,
        packing=packing,
    )


def tensor_header(spec: TensorSpec) -> tensor_pb2.TensorHeader:
    message = tensor_pb2.TensorHeader(
        name=spec.name,
        dtype=dtype_value(spec.dtype),  # type: ignore[arg-type]
        shape=list(spec.shape),
        byte_size=spec.byte_size,
        sha256=spec.sha256,
    )
    if spec.packing is not None:
        message.packing.packed_dim = spec.packing.packed_dim
        message.packing.order = tensor_pb2.PackOrder.Value(  # type: ignore[assignment]
            _ORDER_PREFIX + spec.packing.order.upper()
        )
    return message


def safetensors_header(entry: Mapping[str, Any]) -> tensor_pb2.TensorHeader:
    """A checkpoint manifest's tensor entry (safetensors dtype codes) as a TensorHeader."""
    dtype = FROM_SAFETENSORS.get(str(entry["dtype"]))
    return tensor_pb2.TensorHeader(
        name=str(entry["name"]),
        dtype=dtype_value(dtype) if dtype else tensor_pb2.DTYPE_UNSPECIFIED,  # type: ignore[arg-type]
        shape=[int(d) for d in entry["shape"]],
        byte_size=int(entry["bytes"]),
        sha256=str(entry["sha256"]),
    )


#: Descriptor fields that have their own KernelFormat field (the rest become attributes).
_FORMAT_FIELDS = ("backend", "bits", "group_size", "has_zero_points", "dtypes")


def kernel_format(
    backend: str, experts_class: str, descriptor: Mapping[str, Any] | None
) -> pb.KernelFormat:
    """A writer's descriptor as KernelFormat: typed fields plus string attributes (the
    weight scalar type, the source layout, act-order, bias, and each tensor's dtype)."""
    descriptor = descriptor or {}
    message = pb.KernelFormat(
        backend=backend,
        experts_class=experts_class,
        bits=int(descriptor.get("bits", 0)),
        group_size=int(descriptor.get("group_size", 0)),
        has_zero_points=bool(descriptor.get("has_zero_points", False)),
    )
    for key, value in descriptor.items():
        if key in _FORMAT_FIELDS:
            continue
        message.attributes[key] = str(value).lower() if isinstance(value, bool) else str(value)
    for name, dtype in (descriptor.get("dtypes") or {}).items():
        message.attributes[f"dtype.{name}"] = str(dtype)
    return message


def progress(event: Progress) -> pb.ConvertWeightsResponse:
    return pb.ConvertWeightsResponse(
        progress=pb.ConvertProgress(
            layers_done=event.layers_done,
            layers_total=event.layers_total,
            bytes_done=event.bytes_done,
            bytes_total=event.bytes_total,
            current=event.current,
            stage=event.stage,
        )
    )


def summary(event: Summary) -> pb.ConvertWeightsResponse:
    message = pb.ConvertSummary(
        target_format=kernel_format(event.backend, event.experts_class, event.descriptor),
        tensors=[tensor_header(spec) for spec in event.tensors]
        + [safetensors_header(entry) for entry in event.manifest_tensors],
        bytes_in=event.bytes_in,
        bytes_out=event.bytes_out,
        layer_id=event.layer_id,
        manifest_path=event.manifest_path,
        layers_converted=event.layers_converted,
        layers_skipped=event.layers_skipped,
        backend_chosen_by=event.chosen_by,
    )
    message.elapsed.FromNanoseconds(int(event.elapsed_s * 1e9))
    message.device_time.FromNanoseconds(int(event.device_seconds * 1e9))
    return pb.ConvertWeightsResponse(summary=message)


def event_to_pb(event: Event) -> pb.ConvertWeightsResponse:
    """The response message of one of the call's events."""
    if isinstance(event, ChunkSent):
        return pb.ConvertWeightsResponse(
            chunk=tensor_pb2.TensorChunk(name=event.name, offset=event.offset, data=event.data)
        )
    if isinstance(event, TensorSent):
        return pb.ConvertWeightsResponse(tensor=tensor_header(event.spec))
    if isinstance(event, Progress):
        return progress(event)
    return summary(event)


# ---------------------------------------------------------------------------------------
# Requests


def convert_header(header: pb.ConvertWeightsHeader) -> ConvertHeader:
    """The data plane's header (the deployment converted when the call judges it)."""
    checkpoint = None
    if header.WhichOneof("mode") == "checkpoint":
        paths = header.checkpoint
        checkpoint = CheckpointPaths(
            input_dir=paths.input_dir,
            output_dir=paths.output_dir,
            layers=(paths.layers.start, paths.layers.end) if paths.HasField("layers") else None,
        )
    return ConvertHeader(
        deployment=lambda: deployment_to_json(header),
        names_deployment=header.WhichOneof("deployment") is not None,
        platform=platform_choice(header.platform),
        target_backend=header.target_backend,
        ruleset=header.ruleset,
        keep_loaded=header.keep_loaded,
        worker_index=header.worker_index if header.HasField("worker_index") else None,
        max_chunk_bytes=header.max_chunk_bytes,
        return_tensors=header.inline.return_tensors if header.HasField("inline") else True,
        checkpoint=checkpoint,
    )


async def convert_call(
    requests: AsyncIterator[pb.ConvertWeightsRequest],
) -> tuple[ConvertHeader, AsyncIterator[StreamItem]]:
    """The call's header and the rest of its stream as data plane items."""
    stream = _decoded(requests)
    first = await anext(stream, None)
    if first is None or first.WhichOneof("message") != "header":
        raise ConvertInputError(
            "header", "required: the first message of a ConvertWeights stream is its header"
        )
    return convert_header(first.header), _items(stream)


async def _items(stream: AsyncIterator[pb.ConvertWeightsRequest]) -> AsyncIterator[StreamItem]:
    async for message in stream:
        kind = message.WhichOneof("message")
        if kind == "tensor":
            yield TensorDeclared(tensor_spec(message.tensor))
        elif kind == "chunk":
            chunk = message.chunk
            yield ChunkReceived(chunk.name, chunk.offset, chunk.data)
        else:
            yield StrayHeader()


async def _decoded(
    requests: AsyncIterator[pb.ConvertWeightsRequest],
) -> AsyncIterator[pb.ConvertWeightsRequest]:
    """The request stream, a message grpc cannot parse as INVALID_ARGUMENT: grpc raises the
    DecodeError while reading, and unmapped it answered INTERNAL (tests/reliability)."""
    stream = aiter(requests)
    while True:
        try:
            message = await anext(stream)
        except StopAsyncIteration:
            return
        except DecodeError:
            raise ConvertInputError(
                "request", "a stream message is not a moe_control.v1.ConvertWeightsRequest"
            ) from None
        yield message


def progress_to_json(message: pb.ConvertProgress) -> dict[str, Any]:
    return {
        "stage": message.stage,
        "layers_done": message.layers_done,
        "layers_total": message.layers_total,
        "bytes_done": message.bytes_done,
        "bytes_total": message.bytes_total,
        "current": message.current,
    }


def summary_to_json(summary: pb.ConvertSummary) -> dict[str, Any]:
    """The summary as the CLI prints it (--json)."""
    fmt = summary.target_format
    return {
        "target_format": {
            "backend": fmt.backend,
            "experts_class": fmt.experts_class,
            "bits": fmt.bits,
            "group_size": fmt.group_size,
            "has_zero_points": fmt.has_zero_points,
            "attributes": dict(sorted(fmt.attributes.items())),
        },
        "backend_chosen_by": summary.backend_chosen_by,
        "tensors": [
            {
                "name": t.name,
                "dtype": dtype_name(t.dtype),
                "shape": list(t.shape),
                "bytes": t.byte_size,
                "sha256": t.sha256,
            }
            for t in summary.tensors
        ],
        "bytes_in": summary.bytes_in,
        "bytes_out": summary.bytes_out,
        "elapsed_s": summary.elapsed.ToTimedelta().total_seconds(),
        "device_time_s": summary.device_time.ToTimedelta().total_seconds(),
        "layer_id": summary.layer_id,
        "manifest_path": summary.manifest_path,
        "layers_converted": summary.layers_converted,
        "layers_skipped": summary.layers_skipped,
    }
