"""Choosing a release over real gRPC: ListRulesets from a real server (a primary and a
replica, each answering it itself), reflection seeing it, SelectBackend's ruleset field and
the spec's in every spelling, an unknown one INVALID_ARGUMENT listing the known, and
`moe-control rulesets --server`."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2
from google.rpc import error_details_pb2

from integration.serverproc import SERVICE, ServerProcess
from integration.test_select_backend import rich_error, spec, unpack
from service.api.codecs import rulesets as codec
from service.api.generated.grpc.reflection.v1 import reflection_pb2 as v1_pb2
from service.api.generated.grpc.reflection.v1 import reflection_pb2_grpc as v1_pb2_grpc
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.cli import main
from service.oracle.releases import RELEASES
from service.oracle.rulesets import listing


def test_list_rulesets_answers_the_oracles_rulesets(stub: Any) -> None:
    # Several calls: on a two-process server they land on the primary and the replica.
    for _ in range(6):
        response = stub.ListRulesets(pb.ListRulesetsRequest(), timeout=5)
        assert codec.rulesets_from_pb(response) == listing()
    assert [r.name for r in response.rulesets] == list(RELEASES)
    info = response.rulesets[-1]
    assert (info.name, info.first_version, info.below_version) == ("vllm-0.34", "0.34.0", "0.35")
    assert (info.torch_version, info.humming_kernels_version, info.is_default) == (
        "2.14.0",
        "0.1.19",
        True,
    )


def test_reflection_describes_list_rulesets(server: ServerProcess) -> None:
    with server.channel() as channel:
        stub = v1_pb2_grpc.ServerReflectionStub(channel)
        request = v1_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE)
        (answer,) = stub.ServerReflectionInfo(iter([request]), timeout=5)
    files = {
        f.name: f
        for f in map(
            descriptor_pb2.FileDescriptorProto.FromString,
            answer.file_descriptor_response.file_descriptor_proto,
        )
    }
    service = files["moe_control/v1/moe_control_service.proto"].service[0]
    (method,) = [m for m in service.method if m.name == "ListRulesets"]
    assert method.output_type == ".moe_control.v1.ListRulesetsResponse"
    messages = {m.name for m in files["moe_control/v1/selection.proto"].message_type}
    assert "RulesetInfo" in messages


@pytest.mark.parametrize("name", ["vllm-0.33", "0.33", "0.33.0", "v0.33.0", "0.33.1"])
def test_the_field_and_the_spec_take_every_spelling(stub: Any, name: str) -> None:
    by_field = pb.SelectBackendRequest(spec_json=json.dumps(spec(platform="h200")), ruleset=name)
    assert stub.SelectBackend(by_field, timeout=5).ruleset == "vllm-0.33"
    by_spec = pb.SelectBackendRequest(spec_json=json.dumps(spec(platform="h200", ruleset=name)))
    answer = stub.SelectBackend(by_spec, timeout=5)
    assert (answer.ruleset, answer.backend) == ("vllm-0.33", "HUMMING")


@pytest.mark.parametrize(
    "request_",
    [
        pb.SelectBackendRequest(spec_json=json.dumps(spec()), ruleset="0.26"),
        pb.SelectBackendRequest(spec_json=json.dumps(spec(ruleset="vllm-0.26"))),
    ],
    ids=["field", "spec"],
)
def test_an_unknown_ruleset_is_invalid_argument_listing_the_known(stub: Any, request_: Any) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.SelectBackend(request_, timeout=5)
    code, details = rich_error(caught.value)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    violations = unpack(details, error_details_pb2.BadRequest).field_violations
    (violation,) = [v for v in violations if v.field == "ruleset"]
    assert "unknown ruleset" in violation.description
    assert "vllm-0.33 (vLLM >=0.33.0,<0.34)" in violation.description


def test_a_release_answers_by_its_own_rules_and_refuses_a_flag_it_does_not_read(
    stub: Any,
) -> None:
    h200 = pb.SelectBackendRequest(spec_json=json.dumps(spec(platform="h200")), ruleset="0.30")
    assert stub.SelectBackend(h200, timeout=5).backend == "MARLIN"  # no prioritize_humming
    zen = {"preset": "cpu", "packages": ["zentorch"], "env": {"VLLM_CPU_INT4_W4A8": "0"}}
    assert (
        stub.SelectBackend(
            pb.SelectBackendRequest(spec_json=json.dumps(spec(platform=zen)), ruleset="0.31"),
            timeout=5,
        ).backend
        == "CPU"
    )
    with pytest.raises(grpc.RpcError) as caught:
        stub.SelectBackend(
            pb.SelectBackendRequest(spec_json=json.dumps(spec(platform=zen)), ruleset="0.30"),
            timeout=5,
        )
    code, details = rich_error(caught.value)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    violations = unpack(details, error_details_pb2.BadRequest).field_violations
    assert [v.field for v in violations] == ["platform.env.VLLM_CPU_INT4_W4A8"]
    assert "vllm-0.30 does not read this flag" in violations[0].description


def test_cli_rulesets_over_the_server_is_the_local_listing(
    server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["rulesets", "--json"]) == 0
    local = json.loads(capsys.readouterr().out)
    assert main(["rulesets", "--server", server.address, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == local == listing()
    assert main(["rulesets", "--server", server.address]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"{next(iter(RELEASES))}\n  vllm: ")
    assert "\nvllm-0.32\n  vllm: >=0.32.0,<0.33\n  torch: 2.13.0\n" in text
    assert "\nvllm-0.33\n  vllm: >=0.33.0,<0.34\n  torch: 2.14.0\n" in text
    assert "\nvllm-0.34 (default)\n  vllm: >=0.34.0,<0.35\n  torch: 2.14.0\n" in text
    assert "  humming-kernels: 0.1.19\n" in text
