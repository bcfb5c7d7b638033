"""SelectBackend with policy MEASURED over real gRPC against the real server (CPU worker).

On a CPU worker EMULATION is what runs (TRITON too under TRITON_INTERPRET=1); the GPU
backends answer why they cannot. The checks: the static decision is unchanged and stands
beside the timings, each token count gets every backend's time or reason, a repeat is
answered from the cache without measuring, the cache survives a restart through the state
dir, a replica forwards to the primary (every test server runs two processes), and a
what-if platform is refused for MEASURED.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from integration.platforms import FORCED_MARLIN, oracle_on, rejected, server_worker_platform
from integration.serverproc import ServerProcess
from service.api.codecs import selection as codec
from service.api.generated.moe_control.v1 import measured_pb2
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc
from service.oracle import SelectionError

QUANT = {"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True, "desc_act": False}
LAYER = {"num_experts": 4, "top_k": 2, "hidden_size": 128, "intermediate_size": 128}


SPEC: dict[str, Any] = {"hf_quantization_config": QUANT, "layer": LAYER}


def request(
    tokens: list[int], spec: dict[str, Any] = SPEC, **extra: Any
) -> pb.SelectBackendRequest:
    return pb.SelectBackendRequest(
        spec_json=json.dumps(spec),
        policy=measured_pb2.SELECTION_POLICY_MEASURED,
        token_counts=tokens,
        **extra,
    )


def call(server: ServerProcess, message: pb.SelectBackendRequest) -> pb.SelectBackendResponse:
    with server.channel() as channel:
        answer: pb.SelectBackendResponse = pb_grpc.MoeControlServiceStub(channel).SelectBackend(
            message, timeout=120
        )
        return answer


def rejections(server: ServerProcess) -> float:
    """moe_control_backend_rejections_total, summed over its children."""
    assert server.metrics_url is not None
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("moe_control_backend_rejections_total{")
    )


def timings(bucket: measured_pb2.TokenBucketMeasurement) -> dict[str, Any]:
    return {
        t.backend: t.device_seconds if t.HasField("device_seconds") else t.error
        for t in bucket.timings
    }


def assert_vllm_fails(answer: pb.SelectBackendResponse, failure: SelectionError) -> None:
    """The static part of a MEASURED answer where vLLM fails: no backend, every candidate's
    verdict and reason as the oracle gives them, and the failure as the one hazard."""
    assert not answer.HasField("backend")
    assert answer.candidates
    assert [codec.candidate_from_pb(c) for c in answer.candidates] == list(failure.candidates)
    assert [h.code for h in answer.hazards] == ["VLLM_FAILS"]
    assert str(failure) in answer.hazards[0].message


def test_measured_answers_then_caches_and_persists(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    state = tmp_path / "state"
    # two processes: each call's new channel lands on the primary or the replica, which
    # forwards MEASURED to the primary (one store, one measurement)
    server = server_factory("--state-dir", str(state), "--server-processes", "2")
    first = call(server, request([1, 8]))
    # The static part is vLLM's answer on the worker's own platform, probed from this host's
    # CPU: with AMX vLLM picks CPU (which MEASURED does not time), without it vLLM fails, and
    # MEASURED then keeps every candidate's reason and carries the failure as a hazard.
    # Either way it times what runs here.
    expected = oracle_on(SPEC, server_worker_platform(server))
    plain = pb.SelectBackendRequest(spec_json=request([1]).spec_json)
    if isinstance(expected, SelectionError):
        with pytest.raises(grpc.RpcError) as info:
            call(server, plain)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert_vllm_fails(first, expected)
        static = ""
    else:
        assert codec.select_response_to_json(call(server, plain)) == expected.to_json()
        assert first.backend == expected.backend == "CPU"
        assert [codec.candidate_from_pb(c) for c in first.candidates] == list(expected.candidates)
        assert [(h.code, h.message) for h in first.hazards] == [
            (h.code, h.message) for h in expected.hazards
        ]
        static = expected.backend
    measured = first.measured
    assert not measured.from_cache and measured.measure_seconds > 0
    assert measured.device_name == "cpu" and measured.versions["torch"]
    assert [b.tokens for b in measured.buckets] == [1, 8]
    for bucket in measured.buckets:
        found = timings(bucket)
        assert set(found) == {"HUMMING", "MARLIN", "BATCHED_MARLIN", "TRITON", "EMULATION"}
        assert isinstance(found["EMULATION"], float) and found["EMULATION"] > 0
        assert "CUDA" in found["MARLIN"] and "CUDA" in found["HUMMING"]
        assert bucket.fastest_backend == "EMULATION"
        assert bucket.fastest_seconds == found["EMULATION"]
        # neither CPU nor no backend at all is among the backends MEASURED times
        assert static not in found
        assert bucket.static_backend == static and not bucket.HasField("static_seconds")

    again = call(server, request([8, 1]))
    assert again.measured.from_cache and again.measured.measure_seconds == 0
    assert [timings(b) for b in again.measured.buckets] == [timings(b) for b in measured.buckets]
    # repeats are served as kept bytes, and still counted like fresh decisions
    before = rejections(server)
    repeats = [call(server, request([8, 1])) for _ in range(3)]
    assert all(r == again for r in repeats)
    # ZEN_CPU each time, and CPU too without AMX
    assert rejected(expected) == (1 if static else 2)
    assert rejections(server) == before + 3 * rejected(expected)

    # naming the serving worker explicitly is the same request to the cache
    named = call(server, request([1, 8], measure_worker_index=0))
    assert named.measured.from_cache and named.measured.worker_index == 0
    assert [timings(b) for b in named.measured.buckets] == [timings(b) for b in measured.buckets]

    # where vLLM fails on any CPU (a forced Marlin backend), the answer carries the failure
    # and the same timings: the spec's backend choice is no part of what is measured
    forced_spec = {**SPEC, **FORCED_MARLIN}
    forced_failure = oracle_on(forced_spec, server_worker_platform(server))
    assert isinstance(forced_failure, SelectionError)
    forced = call(server, request([1, 8], forced_spec))
    assert_vllm_fails(forced, forced_failure)
    assert forced.measured.from_cache
    assert [timings(b) for b in forced.measured.buckets] == [timings(b) for b in measured.buckets]
    assert all(b.static_backend == "" for b in forced.measured.buckets)

    # a new token count is measured alone; the known one keeps its time
    more = call(server, request([1, 2]))
    assert not more.measured.from_cache
    assert timings(more.measured.buckets[0]) == timings(measured.buckets[0])

    saved = json.loads((state / "measured_backends.json").read_text())
    (entry,) = saved["entries"].values()
    assert set(entry["buckets"]) == {"1", "2", "8"}
    assert not [p for p in state.iterdir() if p.name.startswith(".")]  # no temporary left
    server.stop()

    restarted = server_factory("--state-dir", str(state), "--server-processes", "2")
    after = call(restarted, request([1, 2, 8]))
    assert after.measured.from_cache
    assert [timings(b) for b in after.measured.buckets] == [
        timings(b) for b in (*more.measured.buckets, measured.buckets[1])
    ]
    refreshed = call(restarted, request([1], refresh=True))
    assert not refreshed.measured.from_cache

    # MEASURED times the serving worker: a what-if platform is refused, as are bad counts
    preset = request([1])
    preset.platform.preset = "h100"
    for bad, field in ((preset, "policy"), (request([0]), "token_counts")):
        with pytest.raises(grpc.RpcError) as info:
            call(restarted, bad)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in (info.value.details() or "")


def test_measured_times_interpreted_triton(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory(env={"TRITON_INTERPRET": "1"})
    answer = call(server, request([1]))
    found = timings(answer.measured.buckets[0])
    assert isinstance(found["TRITON"], float) and found["TRITON"] > 0
    assert isinstance(found["EMULATION"], float)
    fastest = min(("TRITON", "EMULATION"), key=lambda b: found[b])
    assert answer.measured.buckets[0].fastest_backend == fastest
