"""The plugin's reporter in the product's environment (it needs grpc and protobuf, not
vLLM), against a real server on loopback: a report arrives with the process's identity, a
wrong token or an absent server costs one warning line and never blocks `submit`, and a full
queue drops instead of waiting."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator

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


def test_an_absent_server_never_blocks_submit(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    reporter = reporter_for(f"127.0.0.1:{port}")
    with caplog.at_level(logging.WARNING, logger="moe_control_vllm"):
        began = time.perf_counter()
        reporter.submit(decision())
        assert time.perf_counter() - began < 0.05
        assert reporter.flush(30)
    assert reporter.failed == 1
    assert len(caplog.records) == 1 and "UNAVAILABLE" in caplog.records[0].getMessage()


def test_a_full_queue_drops_instead_of_waiting(
    server: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    reporter = reporter_for(server.address)
    one = decision()
    extra = 10
    with caplog.at_level(logging.WARNING, logger="moe_control_vllm"):
        began = time.perf_counter()
        for _ in range(reporter_module.QUEUE_SIZE + extra):
            reporter.submit(one)  # the thread waits FIRST_SEND_DELAY_S before it sends
        assert time.perf_counter() - began < 0.5
    assert reporter.dropped == extra
    assert len(caplog.records) == 1 and "full" in caplog.records[0].getMessage()
    assert reporter.flush(30)
    assert reporter.sent == reporter_module.QUEUE_SIZE
