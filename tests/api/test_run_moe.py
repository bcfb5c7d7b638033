"""The RunMoE reply written by hand (run_moe.reply_bytes) is byte for byte what protobuf
serializes for the same response with its output's data filled in: clients parse it with
the generated classes, so any difference would be a wire change."""

from __future__ import annotations

import os
from typing import Any

import pytest

from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import tensor_pb2
from service.api.run_moe import Reply, _reply_message, reply_bytes


def response(shape: list[int], *, error: float | None, backend: str = "EMULATION") -> Any:
    message = pb.RunMoEResponse(backend=backend, worker_index=3)
    message.output.name = "output"
    message.output.dtype = tensor_pb2.DTYPE_BFLOAT16
    message.output.shape.extend(shape)
    message.device_time.FromNanoseconds(1_234_567)
    if error is not None:
        message.max_abs_error = error
    return message


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
    fast = reply_bytes(Reply(response(shape, error=error), memoryview(data)))
    slow = _reply_message(Reply(response(shape, error=error), memoryview(data)))
    assert fast == slow.SerializeToString()
    parsed = pb.RunMoEResponse.FromString(fast)
    assert parsed == slow
    assert parsed.output.data == data


def test_reply_bytes_from_a_mapped_view() -> None:
    """The data comes from a slice of a mapped segment in the server."""
    import mmap

    with mmap.mmap(-1, 4096) as mapped:
        mapped[:10] = b"0123456789"
        view = memoryview(mapped)[:256]
        fast = reply_bytes(Reply(response([1, 128], error=None), view))
        assert pb.RunMoEResponse.FromString(fast).output.data == bytes(mapped[:256])
        view.release()
