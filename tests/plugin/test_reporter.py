"""The plugin's reporter in the product's environment (it needs grpc and protobuf, not
vLLM), against a real server on loopback: a report arrives with the process's identity, a
wrong token or an absent server costs one warning line, `submit` returns while the server
holds a report unanswered, and a full queue drops instead of waiting (proved by order, with a
server that answers only when the test releases it, not by timing `submit`)."""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from integration.serverproc import ServerProcess, launch, wait_ready
from moe_control_vllm import reporter as reporter_module
from moe_control_vllm.record import Candidate, Decision, Process, WeightKey
from moe_control_vllm.reporter import Reporter
from moe_control_vllm.settings import ReportSettings

from service.client.channel import Connection
from service.client.inventory import list_observed
from service.oracle import select

pytestmark = pytest.mark.timeout(120)

TOKEN = "plugin-token"
SPEC = {
    "hf_quantization_config": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": False,
        "sym": True,
    },
    "layer": {"num_experts": 8, "top_k": 2, "hidden_size": 1024, "intermediate_size": 512},
    "platform": "h100",
}
PROCESS = Process("node-7", "vllm-0", "serving", 4242, "0.33.0", "0.1.0", "org/model")


def decision() -> Decision:
    """A decision as the plugin records it, the oracle's own answer standing in for
    vLLM's (so the server agrees)."""
    answer = select(SPEC)
    key = answer.weight_key
    assert key is not None
    return Decision(
        layer_name="model.layers.0.mlp.experts",
        moe_method=answer.moe_method,
        integration=answer.quantization,
        deployment_json=json.dumps(SPEC),
        weight_key=WeightKey(key.dtype, key.scale_dtype, key.group_shape, key.symmetric),
        may_have_zp=bool(answer.may_have_zp),
        may_have_bias=bool(answer.may_have_bias),
        allow_tile_padding=bool(answer.allow_tile_padding),
        backend=answer.backend or "",
        experts_class=answer.experts_class or "",
        candidates=tuple(Candidate(c.backend, str(c.verdict), c.reason) for c in answer.candidates),
    )


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = launch("--auth-token", TOKEN)
    wait_ready(process, timeout=180)
    yield process
    process.stop()


def reporter_for(address: str, token: str | None = TOKEN) -> Reporter:
    return Reporter(ReportSettings(address, token=token, deadline_s=1.0), lambda: PROCESS)


def test_a_report_arrives_with_who_sent_it(server: ServerProcess) -> None:
    reporter = reporter_for(server.address)
    reporter.submit(decision())
    assert reporter.flush(10)
    assert (reporter.sent, reporter.failed) == (1, 0)
    listing = list_observed(Connection(server.address, token=TOKEN, timeout=10))
    (found,) = listing["deployments"]
    assert found["count"] == 1 and not found["first_difference"] and not found["note"]
    assert found["processes"][0]["host"] == "node-7" and found["processes"][0]["pod"] == "vllm-0"
    assert found["ruleset"] == "vllm-0.33"


def test_a_wrong_token_is_one_warning(
    server: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    reporter = reporter_for(server.address, token="wrong")
    with caplog.at_level(logging.WARNING, logger="moe_control_vllm"):
        for _ in range(3):
            reporter.submit(decision())
            assert reporter.flush(10)
    assert reporter.failed == 3 and reporter.sent == 0
    (warning,) = caplog.records
    assert "UNAUTHENTICATED" in warning.getMessage()


def test_an_absent_server_is_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    reporter = reporter_for(f"127.0.0.1:{port}")
    with caplog.at_level(logging.WARNING, logger="moe_control_vllm"):
        reporter.submit(decision())
        assert reporter.flush(30)
    assert reporter.failed == 1
    assert len(caplog.records) == 1 and "UNAVAILABLE" in caplog.records[0].getMessage()


class StalledServer:
    """A real gRPC server on loopback whose ReportDecisions holds every call until released:
    while it holds one, a reporter's sending thread is inside a call the server has not
    answered, whatever the machine's speed."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0
        method = grpc.unary_unary_rpc_method_handler(self._hold)
        handler = grpc.method_handlers_generic_handler(
            "moe_control.v1.MoeControlService", {"ReportDecisions": method}
        )
        self._server = grpc.server(ThreadPoolExecutor(max_workers=4), handlers=(handler,))
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def _hold(self, request: bytes, context: Any) -> bytes:
        self.calls += 1
        self.entered.set()
        self.release.wait(120)
        return b""  # an empty ReportDecisionsResponse

    def stop(self) -> None:
        self.release.set()
        self._server.stop(grace=None)


@pytest.fixture
def stalled() -> Iterator[StalledServer]:
    server = StalledServer()
    yield server
    server.stop()


def held_reporter(stalled: StalledServer) -> Reporter:
    """A reporter whose sending thread is inside a call the server holds (its queue empty):
    the deadline is far beyond the test's own timeout, so the call cannot end on its own."""
    reporter = Reporter(ReportSettings(stalled.address, deadline_s=3600.0), lambda: PROCESS)
    reporter.submit(decision())
    assert not reporter.flush(0)  # wakes the thread now instead of after its start-up delay
    assert stalled.entered.wait(60), "the report never reached the server"
    return reporter


def test_submit_never_waits_for_the_server(stalled: StalledServer) -> None:
    reporter = held_reporter(stalled)
    reporter.submit(decision())
    # submit returned while the only call so far is still held by the server.
    assert (stalled.calls, reporter.sent, reporter.failed, reporter.dropped) == (1, 0, 0, 0)
    stalled.release.set()
    assert reporter.flush(60)
    assert (reporter.sent, reporter.failed) == (2, 0)


def test_a_full_queue_drops_instead_of_waiting(
    stalled: StalledServer, caplog: pytest.LogCaptureFixture
) -> None:
    reporter = held_reporter(stalled)
    extra = 10
    with caplog.at_level(logging.WARNING, logger="moe_control_vllm"):
        for _ in range(reporter_module.QUEUE_SIZE + extra):
            reporter.submit(decision())
    # Every submit returned while the server still held the first call: the queue took
    # QUEUE_SIZE of them and the rest were dropped, with one warning.
    assert (stalled.calls, reporter.sent, reporter.dropped) == (1, 0, extra)
    assert len(caplog.records) == 1 and "full" in caplog.records[0].getMessage()
    stalled.release.set()
    assert reporter.flush(60)
    assert reporter.sent == 1 + reporter_module.QUEUE_SIZE
