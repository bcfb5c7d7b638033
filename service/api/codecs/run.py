"""RunMoE's messages <-> domain, and the reply written as bytes from the output's segment.

A request becomes the data plane's `RunRequest` (each tensor's data read once: every read
of a protobuf bytes field copies it). The reply is encoded by hand (`reply_bytes`): the
output's data goes from its segment straight into the response bytes, one copy instead of
three (segment -> bytes -> message -> serialized), and the bytes are exactly what protobuf
serializes for the same response (tests/api/codecs/test_run.py). RunMoE is registered with
these bytes as its response, so grpc sends them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.api.codecs.conversion import dtype_name, dtype_value
from service.api.codecs.selection import spec_to_json
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import tensor_pb2
from service.dataplane.run import InlineLayer, RunRequest, RunResult, WireTensor

#: Wire dtype enum value -> name, as `dtype_name` gives it ("" for unspecified), built
#: once: the enum's `Name()` is a Python call per lookup.
_DTYPE_NAMES = {value: dtype_name(value) for value in tensor_pb2.Dtype.values()}


def wire_tensor(message: tensor_pb2.Tensor) -> WireTensor:
    """A whole-tensor message as the data plane reads it (its data read once)."""
    return WireTensor(
        name=message.name,
        dtype=_DTYPE_NAMES.get(message.dtype, ""),
        dtype_code=message.dtype,
        shape=tuple(message.shape),
        data=message.data,
    )


def run_request(request: pb.RunMoERequest) -> RunRequest:
    """The data plane's request for a RunMoE message (oneofs left unset stay None)."""
    weights = request.WhichOneof("weights")
    inline = None
    if weights == "inline_layer":
        layer = request.inline_layer
        inline = InlineLayer(
            spec=lambda: spec_to_json(layer.spec),
            tensors=tuple(wire_tensor(message) for message in layer.tensors),
        )
    routing = request.WhichOneof("routing")
    router_logits = topk = None
    if routing == "router_logits":
        router_logits = wire_tensor(request.router_logits)
    elif routing == "topk":
        topk = (wire_tensor(request.topk.topk_ids), wire_tensor(request.topk.topk_weights))
    return RunRequest(
        hidden_states=(
            wire_tensor(request.hidden_states) if request.HasField("hidden_states") else None
        ),
        weights=weights,
        layer_id=request.layer_id,
        inline_layer=inline,
        router_logits=router_logits,
        topk=topk,
        worker_index=request.worker_index if request.HasField("worker_index") else None,
        backend=request.backend,
        validate_inputs=request.validate_inputs,
        warmup_iterations=request.warmup_iterations,
        timed_iterations=request.timed_iterations,
        compare_with_reference=request.compare_with_reference,
        ruleset=request.ruleset,
    )


@dataclass(frozen=True, slots=True)
class Reply:
    """A RunMoE response in three parts: the response without its output (`rest`), the
    output without its data (`head`), and the data (valid only while the call holds its
    segment)."""

    rest: pb.RunMoEResponse
    head: tensor_pb2.Tensor
    data: memoryview


def reply_parts(result: RunResult) -> Reply:
    """The response without its output, the output without its data, and that data: apart,
    so the bytes path serializes each once, copying none."""
    rest = pb.RunMoEResponse(backend=result.backend, worker_index=result.worker_index)
    # Duration.FromNanoseconds in two assignments (its Python checks cost more than the
    # rest of the message; a device time is never negative).
    rest.device_time.seconds, rest.device_time.nanos = divmod(
        int(result.device_seconds * 1e9), 1_000_000_000
    )
    if result.max_abs_error is not None:
        rest.max_abs_error = result.max_abs_error
    head = tensor_pb2.Tensor(
        name="output",
        dtype=dtype_value(result.dtype),  # type: ignore[arg-type]
        shape=result.shape,
    )
    return Reply(rest, head, result.data)


def reply_message(result: RunResult) -> pb.RunMoEResponse:
    """The reply as a message (what the generated classes build; the bytes' reference)."""
    return parts_message(reply_parts(result))


def reply_bytes(result: RunResult) -> bytes:
    """The reply's serialized bytes, the output's data copied once, from its segment."""
    return parts_bytes(reply_parts(result))


def parts_message(reply: Reply) -> pb.RunMoEResponse:
    # The output filled in place: a Tensor with its data passed as `output=` is copied
    # whole into the response; the head has no data yet, so copying it costs nothing.
    response = reply.rest
    response.output.CopyFrom(reply.head)
    response.output.data = bytes(reply.data)
    return response


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


#: Wire tags (field number << 3 | 2, length-delimited) of RunMoEResponse.output and
#: Tensor.data: both are emitted by hand, everything else by protobuf.
_OUTPUT_TAG = _varint(pb.RunMoEResponse.OUTPUT_FIELD_NUMBER << 3 | 2)
_DATA_TAG = _varint(tensor_pb2.Tensor.DATA_FIELD_NUMBER << 3 | 2)


def parts_bytes(reply: Reply) -> bytes:
    """Exactly `SerializeToString()` of the response with its output's data filled in, the
    data copied once, from its segment into the result. Protobuf serializes fields in
    number order: output (1) first, and within it data (5) last, so the bytes are the
    output's tag and length, its small fields, data's tag, length and bytes, then the
    response's other fields. proto3 leaves empty bytes out, and so does this."""
    data = reply.data
    head = reply.head.SerializeToString()
    data_part = _DATA_TAG + _varint(len(data)) if len(data) else b""
    length = len(head) + len(data_part) + len(data)
    return b"".join(
        (_OUTPUT_TAG, _varint(length), head, data_part, data, reply.rest.SerializeToString())
    )
