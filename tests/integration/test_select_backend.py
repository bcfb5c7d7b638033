"""SelectBackend and the other unary RPCs over real channels against the real server."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2
from google.rpc import error_details_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from integration.platforms import NO_AMX_CPU
from integration.serverproc import SERVICE, ServerProcess, health_status
from service.api.codecs import selection as codec
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import platform_pb2, selection_pb2
from service.oracle import (
    DEFAULT_RULESET,
    PLATFORM_PRESETS,
    PlatformProfile,
    SelectionError,
    deployment_from_model_config,
    select,
)

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
CT = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 128,
                "dynamic": False,
                "actorder": None,
            },
        }
    },
    "ignore": ["lm_head"],
}
LAYER = {"num_experts": 60, "top_k": 4, "hidden_size": 2048, "intermediate_size": 1408}
QWEN_CONFIG = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "hidden_size": 2048,
    "moe_intermediate_size": 1408,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "quantization_config": GPTQ,
}


def spec(quant: dict[str, Any] = GPTQ, platform: Any = "a100", **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"hf_quantization_config": quant, "layer": dict(LAYER), **extra}
    if platform is not None:
        out["platform"] = platform
    return out


def rich_error(error: grpc.RpcError) -> tuple[grpc.StatusCode, list[Any]]:
    status = rpc_status.from_call(error)
    return error.code(), list(status.details) if status is not None else []


def unpack(details: list[Any], kind: type) -> Any:
    for detail in details:
        message = kind()
        if detail.Unpack(message):
            return message
    raise AssertionError(f"no {kind.__name__} among the details")


def test_health_liveness_and_readiness(server: ServerProcess) -> None:
    with server.channel() as channel:
        assert health_status(channel, "") == "SERVING"
        assert health_status(channel, SERVICE) == "SERVING"
        with pytest.raises(grpc.RpcError) as caught:
            health_status(channel, "no.such.Service")
        assert caught.value.code() is grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_service(server: ServerProcess) -> None:
    with server.channel() as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= names


@pytest.mark.parametrize("quant", [GPTQ, AWQ, CT], ids=["gptq", "awq", "compressed-tensors"])
@pytest.mark.parametrize("preset", sorted(PLATFORM_PRESETS))
def test_answers_match_the_library(stub: Any, preset: str, quant: dict[str, Any]) -> None:
    deployment = spec(quant, preset)
    request = pb.SelectBackendRequest(spec_json=json.dumps(deployment))
    try:
        expected = select(deployment).to_json()
    except SelectionError as exc:
        with pytest.raises(grpc.RpcError) as caught:
            stub.SelectBackend(request, timeout=5)
        code, details = rich_error(caught.value)
        assert code is grpc.StatusCode.FAILED_PRECONDITION
        failure = unpack(details, selection_pb2.SelectionFailure)
        assert codec.selection_error_from_pb(failure).to_json() == exc.to_json()
        return
    response = stub.SelectBackend(request, timeout=5)
    assert codec.select_response_to_json(response) == expected
    assert response.platform == codec.platform_to_pb(PLATFORM_PRESETS[preset])


def test_typed_spec_and_struct_forms_match_the_json_form(stub: Any) -> None:
    expected = select(spec(AWQ, "h100")).to_json()
    hf = struct_pb2.Struct()
    hf.update(AWQ)
    typed = selection_pb2.DeploymentSpec(
        quantization_config=selection_pb2.QuantizationConfig(hf_config=hf),
        layer=selection_pb2.MoeLayer(**LAYER),
    )
    request = pb.SelectBackendRequest(
        spec=typed, platform=selection_pb2.PlatformSelector(preset="h100")
    )
    assert codec.select_response_to_json(stub.SelectBackend(request, timeout=5)) == expected


def test_explicit_quantization_fields(stub: Any) -> None:
    explicit = selection_pb2.ExplicitQuantization(
        method=selection_pb2.QUANT_METHOD_GPTQ, bits=4, group_size=128, symmetric=True
    )
    request = pb.SelectBackendRequest(
        spec=selection_pb2.DeploymentSpec(
            quantization_config=selection_pb2.QuantizationConfig(explicit=explicit),
            layer=selection_pb2.MoeLayer(**LAYER),
        ),
        platform=selection_pb2.PlatformSelector(preset="a100"),
    )
    response = stub.SelectBackend(request, timeout=5)
    expected = select(spec(codec.explicit_quantization_to_hf(explicit), "a100")).to_json()
    assert codec.select_response_to_json(response) == expected


def test_whole_model_config(stub: Any) -> None:
    request = pb.SelectBackendRequest(
        model_config=selection_pb2.ModelConfig(config_json=json.dumps(QWEN_CONFIG)),
        platform=selection_pb2.PlatformSelector(preset="h200"),
    )
    response = stub.SelectBackend(request, timeout=5)
    expected = select({**deployment_from_model_config(QWEN_CONFIG), "platform": "h200"})
    assert codec.select_response_to_json(response) == expected.to_json()
    assert response.backend == expected.backend


def test_explicit_platform_profile_is_a_what_if(stub: Any) -> None:
    profile = platform_pb2.PlatformProfile(
        device=platform_pb2.DEVICE_KIND_CUDA,
        capability=platform_pb2.ComputeCapability(major=9, minor=0),
        packages=platform_pb2.PackageSet(names=[]),
    )
    request = pb.SelectBackendRequest(
        spec_json=json.dumps(spec(platform=None)),
        platform=selection_pb2.PlatformSelector(profile=profile),
    )
    response = stub.SelectBackend(request, timeout=5)
    expected = select(spec(platform={"device": "cuda", "capability": "9.0", "packages": []}))
    assert codec.select_response_to_json(response) == expected.to_json()


def test_default_platform_is_the_workers_own(stub: Any) -> None:
    worker = stub.GetPlatform(pb.GetPlatformRequest(), timeout=5).worker
    assert worker.state == platform_pb2.WORKER_STATE_READY
    assert worker.platform.device == platform_pb2.DEVICE_KIND_CPU
    worker_profile = codec.platform_to_json(worker.platform)
    request = pb.SelectBackendRequest(spec_json=json.dumps(spec(platform=None)))
    by_index = pb.SelectBackendRequest(
        spec_json=json.dumps(spec(platform=None)),
        platform=selection_pb2.PlatformSelector(worker_index=0),
    )
    try:
        expected: Any = select(spec(platform=worker_profile)).to_json()
    except SelectionError as exc:
        expected = exc
    for message in (request, by_index):
        if isinstance(expected, SelectionError):
            with pytest.raises(grpc.RpcError) as caught:
                stub.SelectBackend(message, timeout=5)
            assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        else:
            response = stub.SelectBackend(message, timeout=5)
            assert codec.select_response_to_json(response) == expected
            assert response.server_platform == worker.platform


def test_invalid_spec_is_invalid_argument_with_field_violations(stub: Any) -> None:
    bad = {"hf_quantization_config": GPTQ, "layer": {"num_experts": 8}, "platform": "h100"}
    with pytest.raises(grpc.RpcError) as caught:
        stub.SelectBackend(pb.SelectBackendRequest(spec_json=json.dumps(bad)), timeout=5)
    code, details = rich_error(caught.value)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    fields = {v.field for v in unpack(details, error_details_pb2.BadRequest).field_violations}
    assert {"layer.top_k", "layer.hidden_size", "layer.intermediate_size"} <= fields
    info = unpack(details, error_details_pb2.ErrorInfo)
    assert (info.reason, info.domain) == ("INVALID_DEPLOYMENT_SPEC", "moe-control")


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (pb.SelectBackendRequest(), "deployment"),
        (pb.SelectBackendRequest(spec_json="{not json"), "spec_json"),
        (pb.SelectBackendRequest(spec_json=json.dumps(spec(platform="nope"))), "platform"),
        (pb.SelectBackendRequest(spec_json=json.dumps(spec()), ruleset="vllm-9.99"), "ruleset"),
    ],
    ids=["no-deployment", "bad-json", "unknown-preset", "unknown-ruleset"],
)
def test_bad_requests_name_the_field(stub: Any, request_: Any, field: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.SelectBackend(request_, timeout=5)
    code, details = rich_error(caught.value)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    violations = unpack(details, error_details_pb2.BadRequest).field_violations
    assert field in {v.field for v in violations}


def test_incompatible_forced_backend_is_failed_precondition(stub: Any) -> None:
    deployment = spec(GPTQ, "h100", moe_backend="flashinfer_trtllm")
    with pytest.raises(SelectionError) as local:
        select(deployment)
    with pytest.raises(grpc.RpcError) as caught:
        stub.SelectBackend(pb.SelectBackendRequest(spec_json=json.dumps(deployment)), timeout=5)
    code, details = rich_error(caught.value)
    assert code is grpc.StatusCode.FAILED_PRECONDITION
    precondition = unpack(details, error_details_pb2.PreconditionFailure)
    assert [(v.type, v.subject, v.description) for v in precondition.violations] == [
        (c.backend, c.reason_code, c.reason) for c in local.value.candidates
    ]
    info = unpack(details, error_details_pb2.ErrorInfo)
    assert info.reason == "BACKEND_SELECTION_FAILED"
    assert info.metadata["vllm_exception"] == local.value.error.type
    failure = unpack(details, selection_pb2.SelectionFailure)
    assert codec.selection_error_from_pb(failure).to_json() == local.value.to_json()
    assert local.value.error.message in caught.value.details()


def test_no_eligible_backend_is_failed_precondition_listing_every_backend(stub: Any) -> None:
    """A CPU without AMX has no WNA16 backend: vLLM fails, and the error lists every backend
    with its reason. This host's CPU may have AMX, so the platform is explicit (in the spec,
    and as a what-if profile); test_default_platform_is_the_workers_own checks the worker's
    own platform, whichever answer vLLM gives there."""
    with pytest.raises(SelectionError) as local:
        select(spec(GPTQ, NO_AMX_CPU))
    profile = codec.platform_to_pb(PlatformProfile.from_json(NO_AMX_CPU))
    requests = [
        pb.SelectBackendRequest(spec_json=json.dumps(spec(GPTQ, NO_AMX_CPU))),
        pb.SelectBackendRequest(
            spec_json=json.dumps(spec(GPTQ, None)),
            platform=selection_pb2.PlatformSelector(profile=profile),
        ),
    ]
    expected = [(c.backend, c.reason_code, c.reason) for c in local.value.candidates]
    assert [backend for backend, _, _ in expected] == ["ZEN_CPU", "CPU"]
    assert all(code and reason for _, code, reason in expected)
    for request in requests:
        with pytest.raises(grpc.RpcError) as caught:
            stub.SelectBackend(request, timeout=5)
        code, details = rich_error(caught.value)
        assert code is grpc.StatusCode.FAILED_PRECONDITION
        precondition = unpack(details, error_details_pb2.PreconditionFailure)
        assert [(v.type, v.subject, v.description) for v in precondition.violations] == expected
        info = unpack(details, error_details_pb2.ErrorInfo)
        assert info.reason == "BACKEND_SELECTION_FAILED"
        assert info.metadata["vllm_exception"] == local.value.error.type == "NotImplementedError"
        failure = unpack(details, selection_pb2.SelectionFailure)
        assert codec.selection_error_from_pb(failure).to_json() == local.value.to_json()


def test_bytes_that_are_no_request_are_invalid_argument(server: ServerProcess) -> None:
    with server.channel() as channel:
        raw = channel.unary_unary(f"/{SERVICE}/SelectBackend")  # bytes in, bytes out
        with pytest.raises(grpc.RpcError) as caught:
            raw(b"\xff\xff\xff not protobuf", timeout=5)
    code, details = rich_error(caught.value)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    violations = unpack(details, error_details_pb2.BadRequest).field_violations
    assert "SelectBackendRequest" in violations[0].description


def test_unknown_worker_is_not_found(stub: Any) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.GetPlatform(pb.GetPlatformRequest(worker_index=7), timeout=5)
    code, details = rich_error(caught.value)
    assert code is grpc.StatusCode.NOT_FOUND
    assert unpack(details, error_details_pb2.ResourceInfo).resource_type == "worker"
    request = pb.SelectBackendRequest(
        spec_json=json.dumps(spec(platform=None)),
        platform=selection_pb2.PlatformSelector(worker_index=7),
    )
    with pytest.raises(grpc.RpcError) as caught:
        stub.SelectBackend(request, timeout=5)
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND


def test_layers_workers_and_presets(stub: Any) -> None:
    assert list(stub.ListLayers(pb.ListLayersRequest(), timeout=5).layers) == []
    with pytest.raises(grpc.RpcError) as caught:
        stub.UnloadLayer(pb.UnloadLayerRequest(layer_id="layer-1"), timeout=5)
    code, details = rich_error(caught.value)
    assert code is grpc.StatusCode.NOT_FOUND
    assert unpack(details, error_details_pb2.ResourceInfo).resource_name == "layer-1"
    workers = stub.ListWorkers(pb.ListWorkersRequest(), timeout=5)
    assert workers.ready
    assert [(w.index, w.device) for w in workers.workers] == [(0, "cpu")]
    assert workers.workers[0].pid > 0
    presets = stub.ListPlatformPresets(pb.ListPlatformPresetsRequest(), timeout=5).presets
    assert {p.name for p in presets} == set(PLATFORM_PRESETS)


def test_empty_run_and_convert_requests_are_bad_input(stub: Any) -> None:
    # Every RPC of the contract is served (RunMoE: tests/integration/test_run_moe.py): an
    # empty RunMoE request is bad input naming its first missing field.
    with pytest.raises(grpc.RpcError) as caught:
        stub.RunMoE(pb.RunMoERequest(), timeout=5)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "hidden_states" in caught.value.details()
    # ConvertWeights is served (tests/integration/test_convert*.py): a header without a
    # deployment is bad input, not an unimplemented call.
    header = pb.ConvertWeightsRequest(header=pb.ConvertWeightsHeader())
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.ConvertWeights(iter([header]), timeout=5))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "deployment" in caught.value.details()


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        body = line[len(name) + 1 : line.index("}")]
        pairs = dict(p.split("=", 1) for p in body.split(","))
        if all(pairs.get(k) == f'"{v}"' for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_move_with_the_right_labels(server: ServerProcess, stub: Any) -> None:
    assert server.metrics_url is not None

    def scrape() -> str:
        with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
            return str(response.read().decode())

    decision = select(spec(GPTQ, "a100"))
    rejected = [c for c in decision.candidates if c.verdict == "rejected"]
    assert rejected, "the scenario should reject some backend"
    selections = dict(
        name="moe_control_backend_selections_total",
        backend=str(decision.backend),
        integration=decision.quantization,
        platform="a100",
        ruleset=decision.ruleset,
    )
    handled = dict(
        name="grpc_server_handled_total",
        grpc_service=SERVICE,
        grpc_method="SelectBackend",
        grpc_type="unary",
        grpc_code="OK",
    )
    invalid = {**handled, "grpc_code": "INVALID_ARGUMENT"}
    rejection = dict(
        name="moe_control_backend_rejections_total",
        backend=rejected[0].backend,
        reason=rejected[0].reason_code,
    )
    before = scrape()
    for _ in range(3):
        stub.SelectBackend(pb.SelectBackendRequest(spec_json=json.dumps(spec())), timeout=5)
    with pytest.raises(grpc.RpcError):
        stub.SelectBackend(pb.SelectBackendRequest(spec_json="[]"), timeout=5)
    after = scrape()
    for series, delta in ((selections, 3), (handled, 3), (invalid, 1), (rejection, 3)):
        labels = dict(series)
        name = labels.pop("name")
        assert _metric(after, name, **labels) - _metric(before, name, **labels) == delta, name
    assert _metric(after, "moe_control_worker_ready", worker="0", device="cpu") == 1
    assert _metric(after, "moe_control_build_info", ruleset=DEFAULT_RULESET) == 1
    assert 'grpc_server_handling_seconds_bucket{grpc_method="SelectBackend"' in after
    for line in after.splitlines():
        if line.startswith("moe_control_backend_rejections_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            assert reason.replace("_", "").isupper(), f"reason label is not a code: {line}"


def test_cli_select_over_the_server_matches_local_mode(server: ServerProcess) -> None:
    def cli(*args: str) -> tuple[int, str]:
        done = subprocess.run(
            [sys.executable, "-m", "service.cli", *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return done.returncode, done.stdout

    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(QWEN_CONFIG, handle)
    base = ("select", "--config", handle.name, "--gpu", "a100", "--json")
    local_rc, local_out = cli(*base)
    remote_rc, remote_out = cli(*base, "--server", server.address)
    assert (local_rc, remote_rc) == (0, 0)
    remote = json.loads(remote_out)
    assert remote.pop("server_platform")["device"] == "cpu"
    assert remote == json.loads(local_out)
    assert remote["backend"] == "MARLIN"

    forced = (*base, "--moe-backend", "flashinfer_trtllm")
    local_rc, local_out = cli(*forced)
    remote_rc, remote_out = cli(*forced, "--server", server.address)
    assert local_rc == remote_rc != 0
    assert json.loads(remote_out) == json.loads(local_out)

    rc, out = cli("health", "--server", server.address, "--ready")
    assert (rc, out.strip()) == (0, "SERVING")


def test_what_would_change_is_answered_on_request_only(stub: Any) -> None:
    deployment = spec(GPTQ, {"preset": "h200", "packages": []})
    plain = stub.SelectBackend(pb.SelectBackendRequest(spec_json=json.dumps(deployment)), timeout=5)
    assert not plain.HasField("what_would_change")
    asked = stub.SelectBackend(
        pb.SelectBackendRequest(spec_json=json.dumps(deployment), what_would_change=True),
        timeout=5,
    )
    expected = select(deployment, what_would_change=True).to_json()
    assert codec.select_response_to_json(asked) == expected
    humming = [h for h in asked.what_would_change.hints if h.backend == "HUMMING"]
    assert [c.text for c in humming[0].changes] == ["install humming-kernels"]
    assert asked.platform.preset == "h200"


def test_a_failed_answer_names_its_platform_and_ruleset(stub: Any) -> None:
    request = pb.SelectBackendRequest(
        spec_json=json.dumps(spec(GPTQ, "cpu-noamx")), what_would_change=True
    )
    with pytest.raises(grpc.RpcError) as caught:
        stub.SelectBackend(request, timeout=5)
    code, details = rich_error(caught.value)
    assert code is grpc.StatusCode.FAILED_PRECONDITION
    failure = unpack(details, selection_pb2.SelectionFailure)
    assert (failure.ruleset, failure.platform.preset) == (DEFAULT_RULESET, "cpu-noamx")
    assert any(h.backend == "ZEN_CPU" for h in failure.what_would_change.hints)


def test_an_env_flag_vllm_does_not_read_is_invalid_argument_naming_it(stub: Any) -> None:
    profile = platform_pb2.PlatformProfile(
        device=platform_pb2.DEVICE_KIND_CUDA,
        capability=platform_pb2.ComputeCapability(major=9, minor=0),
        env={"FOO": "1"},
    )
    requests = [
        pb.SelectBackendRequest(
            spec_json=json.dumps(spec(platform={"preset": "h100", "env": {"FOO": "1"}}))
        ),
        pb.SelectBackendRequest(
            spec_json=json.dumps(spec(platform=None)),
            platform=selection_pb2.PlatformSelector(profile=profile),
        ),
    ]
    for request in requests:
        with pytest.raises(grpc.RpcError) as caught:
            stub.SelectBackend(request, timeout=5)
        code, details = rich_error(caught.value)
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        (violation,) = unpack(details, error_details_pb2.BadRequest).field_violations
        assert violation.field == "platform.env.FOO"
        assert "VLLM_BATCH_INVARIANT" in violation.description


CLI = (sys.executable, "-m", "service.cli")


def test_cli_over_the_server_shows_the_platform_decided_for_not_the_workers(
    server: ServerProcess,
) -> None:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(QWEN_CONFIG, handle)
    done = subprocess.run(
        [*CLI, "select", "--config", handle.name, "--gpu", "a100", "--server", server.address],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "platform: preset a100: cuda 8.0  packages: flashinfer,humming  env: none"
    assert not any("cpu" in line for line in lines if "platform" in line)
    assert "backend: MARLIN   experts class: MarlinExperts" in lines
