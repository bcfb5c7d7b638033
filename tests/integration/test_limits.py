"""Per-method concurrency limits and configured size limits against the real server (a CPU
worker, loopback), started with small limits.

ConvertWeights streams are held open by request iterators that wait; the server counts a
call as started (grpc_server_started_total) just before it takes its slot, without
suspending in between, so the test knows when the slots are taken. The stream over the
limit is refused with RESOURCE_EXHAUSTED and details naming the method and the limit, while
SelectBackend and health answer; 50 cancelled streams leave every slot free again. The
unary classes (select, run) are driven the same way in tests/api/test_limits.py, where
handlers can be made to wait. A conversion declaring more than --convert-max-layer-bytes
is RESOURCE_EXHAUSTED naming the field and the limit (it used to be INVALID_ARGUMENT).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from prometheus_client.parser import text_string_to_metric_families

from integration.serverproc import ServerProcess, health_status, launch, wait_ready
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc
from service.client.convert import header_for, tensor_requests
from service.formats.io.safetensors import SafetensorsFile
from service.formats.io.streaming import FROM_SAFETENSORS, TensorSpec
from service.formats.synthetic.checkpoints import SyntheticSpec, write_synthetic_checkpoint

CONVERT_LIMIT = 2
LAYER_BYTES = 4096
SPEC = SyntheticSpec(num_layers=1, num_experts=4, hidden_size=128, intermediate_size=128)
SELECT_SPEC = json.dumps(
    {
        "hf_quantization_config": {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 128,
            "desc_act": False,
            "sym": True,
        },
        "layer": {"num_experts": 60, "top_k": 4, "hidden_size": 2048, "intermediate_size": 1408},
        "platform": "a100",
    }
)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("limits")
    write_synthetic_checkpoint(base / "mixtral", SPEC)
    return base


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = launch(
        "--max-concurrent-convert",
        str(CONVERT_LIMIT),
        "--max-concurrent-select",
        "4",
        "--convert-max-layer-bytes",
        str(LAYER_BYTES),
    )
    wait_ready(process)
    yield process
    alive = process.process.poll() is None
    process.stop()
    assert alive, "".join(process.stderr_lines[-40:])


@pytest.fixture(scope="module")
def channel(server: ServerProcess) -> Iterator[grpc.Channel]:
    with server.channel() as ch:
        yield ch


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    assert server.metrics_url is not None
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def started(server: ServerProcess) -> float:
    return metric(server, "grpc_server_started_total", grpc_method="ConvertWeights")


def details(error: grpc.RpcError) -> dict[str, Any]:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, error
    found: dict[str, Any] = {}
    for packed in status.details:
        for kind in (
            error_details_pb2.QuotaFailure,
            error_details_pb2.ErrorInfo,
            error_details_pb2.BadRequest,
        ):
            if packed.Is(kind.DESCRIPTOR):
                message = kind()
                packed.Unpack(message)
                found[kind.__name__] = message
    return found


class HeldStream:
    """A ConvertWeights call whose request stream stays open until `end()`."""

    def __init__(self, stub: Any) -> None:
        self._done = threading.Event()
        self.call = stub.ConvertWeights(self._requests(), timeout=60)

    def _requests(self) -> Iterator[pb.ConvertWeightsRequest]:
        self._done.wait(60)
        return
        yield  # a generator that sends nothing until it ends

    def cancel(self) -> None:
        self.call.cancel()
        self._done.set()


def wait_until(predicate: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_convert_limit_refuses_one_over_leaves_others_alone_and_leaks_no_slot(
    server: ServerProcess, channel: grpc.Channel
) -> None:
    stub = pb_grpc.MoeControlServiceStub(channel)
    select = pb.SelectBackendRequest(spec_json=SELECT_SPEC)
    refused_before = metric(server, "moe_control_rpc_limited_total", grpc_method="ConvertWeights")
    cancelled = 0
    while cancelled < 50:
        target = started(server) + CONVERT_LIMIT
        held = [HeldStream(stub) for _ in range(CONVERT_LIMIT)]
        wait_until(lambda target=target: started(server) >= target)  # type: ignore[misc]
        over = HeldStream(stub)
        with pytest.raises(grpc.RpcError) as refused:
            next(iter(over.call))
        over.cancel()
        error = refused.value
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
        found = details(error)
        method = "/moe_control.v1.MoeControlService/ConvertWeights"
        assert found["QuotaFailure"].violations[0].subject == method
        assert dict(found["ErrorInfo"].metadata) == {
            "method": method,
            "limit": "max_concurrent_convert",
            "value": str(CONVERT_LIMIT),
        }
        # Other methods and health are unaffected while the convert slots are full.
        assert stub.SelectBackend(select, timeout=10).backend
        assert health_status(channel) == "SERVING"
        for stream in held:
            stream.cancel()
        cancelled += len(held)
    refused_after = metric(server, "moe_control_rpc_limited_total", grpc_method="ConvertWeights")
    assert refused_after - refused_before == 50 // CONVERT_LIMIT
    # After 50 cancelled streams the full limit is free: CONVERT_LIMIT streams start and
    # none is refused (a refused one would end at once with RESOURCE_EXHAUSTED).
    before = started(server)
    held = [HeldStream(stub) for _ in range(CONVERT_LIMIT)]
    wait_until(lambda: started(server) >= before + CONVERT_LIMIT)
    time.sleep(0.2)
    for stream in held:
        assert stream.call.running(), stream.call.code()
        stream.cancel()
    limited = metric(server, "moe_control_rpc_limited_total", grpc_method="ConvertWeights")
    assert limited == refused_after


def test_a_conversion_over_the_layer_byte_limit_is_resource_exhausted(
    root: Path, channel: grpc.Channel
) -> None:
    stub = pb_grpc.MoeControlServiceStub(channel)
    tensors: dict[str, tuple[TensorSpec, memoryview]] = {}
    for shard in sorted((root / "mixtral").glob("*.safetensors")):
        file = SafetensorsFile(shard)
        for name, entry in file.entries.items():
            if name.startswith("model.layers.0.block_sparse_moe.experts."):
                spec = TensorSpec.of(name, FROM_SAFETENSORS[entry.dtype], entry.shape)
                tensors[name] = (spec, file.raw(name))
    assert sum(s.byte_size for s, _ in tensors.values()) > LAYER_BYTES
    header = header_for(
        model_config_json=(root / "mixtral" / "config.json").read_text(), backend="TRITON"
    )
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.ConvertWeights(tensor_requests(header, tensors), timeout=60))
    error = caught.value
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    found = details(error)
    field = found["BadRequest"].field_violations[0].field
    assert field.startswith("tensors[") and field.endswith("].byte_size")
    assert found["ErrorInfo"].reason == "CONVERT_LIMIT"
    assert dict(found["ErrorInfo"].metadata) == {"field": field, "limit": "convert_max_layer_bytes"}
    assert found["QuotaFailure"].violations[0].subject == field


def test_with_replicas_the_convert_limit_is_server_wide(
    server_factory: Any,
) -> None:
    """Two server processes share the port; a replica forwards conversions to the primary,
    whose one set of limits covers its own public server and the forwarded calls: whichever
    process a connection lands on, the stream over the limit is refused."""
    server = server_factory("--server-processes", "2", "--max-concurrent-convert", "2")
    channels: list[grpc.Channel] = []

    def own_connection() -> Any:
        channel = grpc.insecure_channel(
            server.address, options=[("grpc.use_local_subchannel_pool", 1)]
        )
        channels.append(channel)
        return pb_grpc.MoeControlServiceStub(channel)

    try:
        held = [HeldStream(own_connection()) for _ in range(2)]
        time.sleep(1.0)  # both calls reached the primary (directly or forwarded)
        for _ in range(6):
            over = HeldStream(own_connection())
            with pytest.raises(grpc.RpcError) as refused:
                next(iter(over.call))
            over.cancel()
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            info = details(refused.value)["ErrorInfo"]
            assert info.metadata["limit"] == "max_concurrent_convert"
        for stream in held:
            stream.cancel()
        time.sleep(0.5)
        again = [HeldStream(own_connection()) for _ in range(2)]
        time.sleep(1.0)
        assert all(stream.call.running() for stream in again)
        for stream in again:
            stream.cancel()
    finally:
        for channel in channels:
            channel.close()
