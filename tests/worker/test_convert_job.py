"""The worker side of conversions, in process: segments in, segments out, layer store,
cancellation, error details, and background jobs answering while pings go on."""

from __future__ import annotations

import json
import queue
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from service.formats import registry
from service.formats.errors import (
    ConversionUnsupported,
    ConvertCancelledError,
    ConvertInputError,
    PermissionDeniedError,
)
from service.formats.io.safetensors import tensor_bytes
from service.formats.io.streaming import FROM_TORCH, TensorSpec
from service.formats.readers import GPTQ, SourceQuantization, write_checkpoint
from service.formats.routes.spec import SourceSpec
from service.formats.synthetic.quantize import random_layer
from service.ipc import protocol
from service.ipc.errors import SegmentError
from service.ipc.segments import SegmentDir
from service.oracle import DEFAULT_RULESET, InvalidSpecError
from service.worker import jobs
from service.worker.main import Worker


@pytest.fixture
def layer() -> Any:
    return random_layer(
        2, 64, 64, bits=4, group_size=32, symmetric=True, generator=torch.Generator().manual_seed(1)
    )


class Lines:
    """Collects what the worker writes, by call id."""

    def __init__(self) -> None:
        self.queue: queue.Queue[dict[str, Any]] = queue.Queue()

    def __call__(self, line: bytes) -> None:
        self.queue.put(protocol.decode(line))

    def answer(self, call_id: int, timeout: float = 30.0) -> dict[str, Any]:
        while True:
            message = self.queue.get(timeout=timeout)
            if message.get("id") == call_id and "event" not in message:
                return message


def put_inputs(segments: SegmentDir, tensors: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    inputs = []
    for number, (name, tensor) in enumerate(tensors.items()):
        data = tensor_bytes(tensor)
        spec = TensorSpec.of(
            name, FROM_TORCH[str(tensor.dtype).removeprefix("torch.")], tensor.shape
        )
        with segments.new(f"t-in-{number}", len(data)) as segment:
            segment.view[:] = data
        inputs.append({"spec": spec.to_json(), "segment": f"t-in-{number}"})
    return inputs


def params(segments: SegmentDir, inputs: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "segments_dir": str(segments.path),
        "inputs": inputs,
        "source": SourceSpec("gptq", 4, 32).to_json(),
        "backend": "TRITON",
        "ruleset": DEFAULT_RULESET,
        "shape": {"num_experts": 2, "hidden_size": 64, "intermediate_size": 64, "gated": True},
        "out_prefix": "t-out-",
        "return_tensors": True,
        **extra,
    }


def request(call_id: int, method: str, values: dict[str, Any]) -> bytes:
    return protocol.request(call_id, method, values)


def test_convert_layer_through_segments(layer: Any, tmp_path: Path) -> None:
    lines = Lines()
    worker = Worker("cpu", lines)
    segments = SegmentDir.create(tmp_path)
    quant = SourceQuantization(bits=4, group_size=32)
    tensors = write_checkpoint(GPTQ, layer, quant, naming="mixtral")
    assert (
        worker.handle(
            request(
                1,
                "convert_layer",
                params(segments, put_inputs(segments, tensors), keep_loaded=True),
            )
        )
        is None
    )
    answer = lines.answer(1)["result"]
    expected = registry.convert(layer, "TRITON", source="gptq").tensors
    assert [t["spec"]["name"] for t in answer["tensors"]] == list(expected)
    for item in answer["tensors"]:
        spec = TensorSpec.from_json(item["spec"])
        with segments.open(item["segment"], spec.byte_size) as segment:
            assert bytes(segment.view) == bytes(tensor_bytes(expected[spec.name]))
    assert answer["layer_id"] in {i["layer_id"] for i in worker.layers.infos()}
    stored = worker.layers.get(answer["layer_id"])
    assert stored is not None and torch.equal(
        stored.tensors["w13_qweight"], expected["w13_qweight"]
    )
    unloaded = protocol.decode(
        worker.handle(request(2, "unload_layer", {"layer_id": answer["layer_id"]})) or b""
    )
    assert unloaded["result"]["found"] and len(worker.layers) == 0


def test_errors_carry_their_category_and_field(layer: Any, tmp_path: Path) -> None:
    lines = Lines()
    worker = Worker("cpu", lines)
    segments = SegmentDir.create(tmp_path)
    tensors = write_checkpoint(GPTQ, layer, SourceQuantization(bits=4, group_size=32), naming="hf")
    tensors["0.gate_proj.qweight"] = tensors["0.gate_proj.qweight"].to(torch.float32)
    worker.handle(request(1, "convert_layer", params(segments, put_inputs(segments, tensors))))
    error = lines.answer(1)["error"]
    assert error["details"]["category"] == "invalid_argument"
    assert "0.gate_proj.qweight" in error["details"]["field"]
    assert not list(segments.path.glob("t-out-*"))


@pytest.mark.parametrize(
    ("exc", "category"),
    [
        (ConvertInputError("tensors[x].sha256", "bad"), "invalid_argument"),
        (PermissionDeniedError("checkpoint.input_dir", "/etc", "outside"), "permission_denied"),
        (ConversionUnsupported("CPU", "opaque"), "unimplemented"),
        (InvalidSpecError.single("layer", "missing"), "invalid_spec"),
        (ConvertCancelledError("stop"), "cancelled"),
        (SegmentError("full"), "resource_exhausted"),
        (RuntimeError("boom"), "internal"),
    ],
)
def test_describe_maps_exceptions_by_class(exc: Exception, category: str) -> None:
    kind, message, details = jobs.describe(exc)
    assert kind == type(exc).__name__ and message == str(exc)
    assert details["category"] == category
    json.dumps(details)  # always encodable


def test_jobs_answer_while_quick_calls_go_on_and_cancel_stops_them() -> None:
    lines = Lines()
    runner = jobs.Jobs(lines)
    started = threading.Event()

    def slow(values: dict[str, Any], context: jobs.JobContext) -> dict[str, Any]:
        started.set()
        context.emit("progress", {"step": 1})
        while True:
            context.check()
            context.cancel_event.wait(0.01)

    runner.start(7, "slow", slow, {})
    assert started.wait(5)
    assert lines.queue.get(timeout=5) == {"id": 7, "event": "progress", "data": {"step": 1}}
    assert runner.active == 1
    assert runner.cancel(7) and not runner.cancel(99)
    error = lines.answer(7)["error"]
    assert error["details"]["category"] == "cancelled"
    assert runner.active == 0


def test_check_target(tmp_path: Path) -> None:
    worker = Worker("cpu", Lines())
    yes = protocol.decode(worker.handle(request(1, "check_target", {"backend": "TRITON"})) or b"")
    no = protocol.decode(worker.handle(request(2, "check_target", {"backend": "CPU"})) or b"")
    assert yes["result"] == {"supported": True, "reason": ""}
    assert no["result"]["supported"] is False and no["result"]["reason"]
