"""A client that cancels a ConvertWeights stream is an ordinary end: the server logs it at
info and nothing at error level (no task left pending, no traceback), whether the call is
cancelled while the client streams tensors, while the worker converts, or between the
progress messages of a whole-checkpoint conversion. The server's JSON log lines are read
after it stops, so a task destroyed at shutdown shows too."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from integration.serverproc import ServerProcess, launch, wait_for, wait_ready
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc
from service.client.convert import header_for, tensor_requests
from service.formats.io.safetensors import SafetensorsFile
from service.formats.io.streaming import FROM_SAFETENSORS, TensorSpec
from service.formats.synthetic.checkpoints import SyntheticSpec, write_synthetic_checkpoint

SPEC = SyntheticSpec(num_layers=4, num_experts=8, hidden_size=512, intermediate_size=512)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("cancel")
    write_synthetic_checkpoint(base / "root" / "model", SPEC)
    (base / "segments").mkdir()
    return base


def _records(server: ServerProcess) -> list[dict[str, Any]]:
    records = []
    for line in server.stderr_lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            records.append({"level": "error", "msg": line.rstrip()})  # not a log record
    return records


def _cancelled(server: ServerProcess, mode: str) -> int:
    """Cancels of `mode` conversions the server logged (each at info)."""
    return sum(
        r.get("event") == "convert_cancelled" and r.get("mode") == mode and r["level"] == "info"
        for r in _records(server)
    )


def _layer_messages(root: Path) -> list[pb.ConvertWeightsRequest]:
    tensors: dict[str, tuple[TensorSpec, memoryview]] = {}
    for shard in sorted((root / "root" / "model").glob("*.safetensors")):
        file = SafetensorsFile(shard)
        for name, entry in file.entries.items():
            if name.startswith("model.layers.0.") and ".experts." in name:
                tensors[name] = (
                    TensorSpec.of(name, FROM_SAFETENSORS[entry.dtype], entry.shape),
                    file.raw(name),
                )
    config = (root / "root" / "model" / "config.json").read_text()
    head = header_for(model_config_json=config, backend="TRITON")
    return list(tensor_requests(head, tensors, 4096))


def _cancel_while_streaming(
    channel: grpc.Channel, messages: list[pb.ConvertWeightsRequest]
) -> None:
    halfway = threading.Event()
    release = threading.Event()

    def requests() -> Iterator[pb.ConvertWeightsRequest]:
        for number, message in enumerate(messages):
            if number == len(messages) // 2:
                halfway.set()
                release.wait(30)
            yield message

    call = pb_grpc.MoeControlServiceStub(channel).ConvertWeights(requests(), timeout=60)
    assert halfway.wait(30)
    call.cancel()
    release.set()
    with pytest.raises(grpc.RpcError):
        list(call)


def _cancel_after_sending(channel: grpc.Channel, messages: list[pb.ConvertWeightsRequest]) -> None:
    sent = threading.Event()

    def requests() -> Iterator[pb.ConvertWeightsRequest]:
        yield from messages
        sent.set()

    call = pb_grpc.MoeControlServiceStub(channel).ConvertWeights(requests(), timeout=60)
    assert sent.wait(30)
    call.cancel()
    with pytest.raises(grpc.RpcError):
        list(call)


def _cancel_at_first_progress(channel: grpc.Channel, output: str) -> None:
    header = header_for(backend="TRITON", checkpoint=("model", output))
    call = pb_grpc.MoeControlServiceStub(channel).ConvertWeights(
        iter([pb.ConvertWeightsRequest(header=header)]), timeout=60
    )
    for response in call:
        if response.HasField("progress"):
            call.cancel()
            break


def test_a_cancelled_stream_is_logged_at_info_and_nothing_at_error(root: Path) -> None:
    server = launch("--data-root", str(root / "root"), "--segment-dir", str(root / "segments"))
    try:
        wait_ready(server)
        messages = _layer_messages(root)
        with server.channel() as channel:
            for attempt in range(3):
                _cancel_while_streaming(channel, messages)
                _cancel_after_sending(channel, messages)
                _cancel_at_first_progress(channel, f"out/{attempt}")
            assert wait_for(lambda: _cancelled(server, "checkpoint") == 3, timeout=60)
            assert wait_for(lambda: _cancelled(server, "inline") >= 1, timeout=60)
    finally:
        server.stop()
    records = _records(server)
    assert all(r.get("level") == "info" for r in records if r.get("event") == "convert_cancelled")
    errors = [r for r in records if r.get("level") in ("error", "critical")]
    assert errors == [], errors
