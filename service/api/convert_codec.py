"""Protobuf <-> domain conversions of ConvertWeights (tensor headers, progress, summary).

Wire dtype names are the `Dtype` enum's own names without the prefix, lower case
(`DTYPE_UINT4_PACKED_INT32` <-> "uint4_packed_int32"), so the table lives once, in
`service.formats.io.streaming.DTYPES`, and a new enum value needs no code here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import tensor_pb2
from service.formats.io.streaming import Packing, TensorSpec

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
    from service.formats.io.streaming import FROM_SAFETENSORS

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


def progress(event: Mapping[str, Any]) -> pb.ConvertWeightsResponse:
    return pb.ConvertWeightsResponse(
        progress=pb.ConvertProgress(
            layers_done=int(event.get("layers_done", 0)),
            layers_total=int(event.get("layers_total", 0)),
            bytes_done=int(event.get("bytes_done", 0)),
            bytes_total=int(event.get("bytes_total", 0)),
            current=str(event.get("current", "")),
            stage=str(event.get("stage", "")),
        )
    )


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
