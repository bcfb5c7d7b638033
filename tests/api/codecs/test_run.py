"""The RunMoE reply written by hand (run_moe.reply_bytes) is byte for byte what protobuf
serializes for the same response with its output's data filled in: clients parse it with
the generated classes, so any difference would be a wire change."""

from __future__ import annotations

import os
from typing import Any

import pytest

from service.api.codecs.run import Reply, parts_bytes, parts_message, reply_parts, run_request
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import tensor_pb2
from service.dataplane.run import RunResult
from service.metrics import Metrics


def response(shape: list[int], *, error: float | None, backend: str = "EMULATION") -> Any:
    """The whole response, as the generated classes build it (the reference)."""
    message = pb.RunMoEResponse(backend=backend, worker_index=3)
    message.output.name = "output"
    message.output.dtype = tensor_pb2.DTYPE_BFLOAT16
    message.output.shape.extend(shape)
    message.device_time.FromNanoseconds(1_234_567)
    if error is not None:
        message.max_abs_error = error
    return message


def parts(shape: list[int], data: memoryview, *, error: float | None) -> Reply:
    """The same response as the handler holds it: without its output, the output's head."""
    rest = response(shape, error=error)
    head = tensor_pb2.Tensor()
    head.CopyFrom(rest.output)
    rest.ClearField("output")
    return Reply(rest, head, data)


CASES = [
    # (shape, data bytes, max_abs_error): the lengths cross the varint's byte boundaries
    ([1, 64], 128, None),
    ([4, 16], 128, 0.0),
    ([0, 1024], 0, None),
    ([300, 1024], 600 * 1024, 1.5e-3),
    ([4096, 1024], 8 << 20, None),
]


@pytest.mark.parametrize(("shape", "nbytes", "error"), CASES)
def test_reply_bytes_are_the_serialized_response(
    shape: list[int], nbytes: int, error: float | None
) -> None:
    data = os.urandom(nbytes)
    fast = parts_bytes(parts(shape, memoryview(data), error=error))
    slow = parts_message(parts(shape, memoryview(data), error=error))
    assert fast == slow.SerializeToString()
    reference = response(shape, error=error)
    reference.output.data = data
    assert slow == reference
    parsed = pb.RunMoEResponse.FromString(fast)
    assert parsed == slow
    assert parsed.output.data == data


def test_reply_bytes_from_a_mapped_view() -> None:
    """The data comes from a slice of a mapped segment in the server."""
    import mmap

    with mmap.mmap(-1, 4096) as mapped:
        mapped[:10] = b"0123456789"
        view = memoryview(mapped)[:256]
        fast = parts_bytes(parts([1, 128], view, error=None))
        assert pb.RunMoEResponse.FromString(fast).output.data == bytes(mapped[:256])
        view.release()


@pytest.mark.parametrize("seconds", [0.0, 1e-9, 0.000568, 0.85e-3, 1.0, 2.75, 3601.000000123])
def test_device_time_as_from_nanoseconds(seconds: float) -> None:
    """The codec sets the Duration's two fields itself: the same message as
    `Duration.FromNanoseconds` gives for every device time."""
    result = RunResult("TRITON", 2, seconds, 0.5, "float16", [1, 64], memoryview(b""))
    reply = reply_parts(result)
    expected = pb.RunMoEResponse(backend="TRITON", worker_index=2, max_abs_error=0.5)
    expected.device_time.FromNanoseconds(int(seconds * 1e9))
    assert reply.rest == expected
    assert reply.head == tensor_pb2.Tensor(
        name="output", dtype=tensor_pb2.DTYPE_FLOAT16, shape=[1, 64]
    )


def test_run_moe_metric_children_are_bound_once() -> None:
    """One pair of label children per backend, the same objects on every call."""
    metrics = Metrics()
    first = metrics.run_moe_children("TRITON")
    assert metrics.run_moe_children("TRITON") is first
    assert first[0] is metrics.run_moe_seconds.labels("TRITON")
    assert first[1] is metrics.run_moe_tokens.labels("TRITON")
    assert metrics.run_moe_children("MARLIN")[0] is not first[0]


def test_a_request_reads_as_the_data_plane_request() -> None:
    """Oneofs left unset stay None; each tensor keeps its wire dtype's name and value."""
    request = pb.RunMoERequest(layer_id="L1", backend="triton", timed_iterations=3)
    request.hidden_states.dtype = tensor_pb2.DTYPE_BFLOAT16
    request.hidden_states.shape.extend([2, 8])
    request.hidden_states.data = bytes(32)
    request.topk.topk_ids.dtype = 12345
    domain = run_request(request)
    assert domain.weights == "layer_id" and domain.layer_id == "L1"
    assert domain.inline_layer is None and domain.router_logits is None
    assert domain.worker_index is None and domain.timed_iterations == 3
    assert domain.hidden_states is not None
    assert (domain.hidden_states.dtype, domain.hidden_states.shape) == ("bfloat16", (2, 8))
    assert domain.hidden_states.data == bytes(32)
    assert domain.topk is not None
    assert (domain.topk[0].dtype, domain.topk[0].dtype_code) == ("", 12345)
    assert run_request(pb.RunMoERequest()).hidden_states is None
