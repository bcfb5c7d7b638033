"""The upgrade diff over the real server on loopback: DiffRulesets over real gRPC (a
primary and a replica, each answering it itself), `moe-control diff --server` printing what
the local command prints, and POST /v1/diff over real HTTP answering the same."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from integration.serverproc import ServerProcess, launch, wait_ready
from integration.test_select_backend import rich_error, unpack
from service.api.codecs import upgrade as codec
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc
from service.api.generated.moe_control.v1 import selection_pb2
from service.oracle.upgrade import upgrade, upgrade_chain

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
LAYER = {"num_experts": 8, "top_k": 2, "hidden_size": 4096, "intermediate_size": 14336}
GELU: dict[str, Any] = {
    "id": "gelu",
    "hf_quantization_config": GPTQ,
    "layer": {**LAYER, "activation": "gelu_tanh"},
    "platform": "cpu",
}
SILU: dict[str, Any] = {**GELU, "id": "silu", "layer": {**LAYER, "activation": "silu"}}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = launch("--server-processes", "2", "--http-port", str(_free_port()))
    try:
        wait_ready(process)
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def stub(server: ServerProcess) -> Iterator[Any]:
    with server.channel() as channel:
        yield pb_grpc.MoeControlServiceStub(channel)


def test_diff_rulesets_answers_as_the_oracle_on_every_process(stub: Any) -> None:
    expected = upgrade(GELU, "vllm-0.32", "vllm-0.33")
    request = pb.DiffRulesetsRequest(
        spec_json=json.dumps(GELU), rulesets=list(upgrade_chain("0.32", "0.33"))
    )
    for _ in range(6):  # on a two-process server the calls land on the primary and the replica
        response = stub.DiffRulesets(request, timeout=10)
        assert codec.upgrade_response_to_json(response) == expected.to_json()
    assert [a.ruleset for a in response.answers] == ["vllm-0.32", "vllm-0.33"]
    assert [a.WhichOneof("answer") for a in response.answers] == ["failure", "decision"]
    assert {d.field for d in response.differences} == {d.field for d in response.changes}


def test_a_platform_selector_wins_over_the_spec_s(stub: Any) -> None:
    request = pb.DiffRulesetsRequest(
        spec_json=json.dumps(GELU),
        rulesets=["0.32", "0.33"],
        platform=selection_pb2.PlatformSelector(preset="h200"),
    )
    response = stub.DiffRulesets(request, timeout=10)
    assert all(a.decision.platform.preset == "h200" for a in response.answers)
    assert list(response.changes) == []


def test_bad_requests_are_invalid_argument_naming_the_field(stub: Any) -> None:
    request = pb.DiffRulesetsRequest(spec_json=json.dumps(GELU), rulesets=["0.33", "0.99"])
    with pytest.raises(grpc.RpcError) as caught:
        stub.DiffRulesets(request, timeout=10)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    _, details = rich_error(caught.value)
    bad = unpack(details, error_details_pb2.BadRequest)
    assert bad.field_violations[0].field == "rulesets[1]"
    with pytest.raises(grpc.RpcError) as missing:
        stub.DiffRulesets(pb.DiffRulesetsRequest(rulesets=["0.32", "0.33"]), timeout=10)
    assert missing.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", "diff", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_cli_asks_the_server_and_prints_what_it_prints_locally(
    server: ServerProcess, tmp_path: Path
) -> None:
    specs = tmp_path / "specs.jsonl"
    specs.write_text(json.dumps(GELU) + "\n" + json.dumps(SILU) + "\n")
    args = ["--from", "vllm-0.32", "--to", "vllm-0.33", "--deployment", str(specs)]
    local, remote = _cli(*args, "--json"), _cli(*args, "--json", "--server", server.address)
    assert (local.returncode, remote.returncode) == (1, 1), remote.stderr
    assert remote.stdout == local.stdout
    table = _cli(*args, "--server", server.address)
    assert table.returncode == 1 and table.stdout == _cli(*args).stdout
    unknown = _cli("--from", "0.99", "--deployment", str(specs), "--server", server.address)
    assert unknown.returncode == 2 and "--from: unknown ruleset '0.99'" in unknown.stderr


def test_the_server_gates_on_the_fields_the_cli_names(
    server: ServerProcess, stub: Any, tmp_path: Path
) -> None:
    """A deployment that differs only in the wording of the same failure passes the default
    gate and fails one on the error's text, asked of the server as answered locally."""
    reworded = {**SILU, "id": "reworded", "moe_backend": "cpu"}
    specs = tmp_path / "specs.jsonl"
    specs.write_text(json.dumps(reworded) + "\n")
    args = ["--from", "0.32", "--to", "0.33", "--deployment", str(specs)]
    for fail_on, status in (([], 0), (["--fail-on", "error"], 1)):
        local = _cli(*args, *fail_on, "--json")
        remote = _cli(*args, *fail_on, "--json", "--server", server.address)
        assert (local.returncode, remote.returncode) == (status, status), remote.stderr
        assert remote.stdout == local.stdout
    bad = _cli(*args, "--fail-on", "stage", "--server", server.address)
    assert bad.returncode == 2 and "--fail-on: unknown field 'stage'" in bad.stderr
    request = pb.DiffRulesetsRequest(
        spec_json=json.dumps(reworded), rulesets=["0.32", "0.33"], fail_on=["verdicts"]
    )
    with pytest.raises(grpc.RpcError) as caught:
        stub.DiffRulesets(request, timeout=10)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    _, details = rich_error(caught.value)
    assert unpack(details, error_details_pb2.BadRequest).field_violations[0].field == "fail_on"


def test_post_v1_diff_answers_as_the_cli(server: ServerProcess, tmp_path: Path) -> None:
    assert server.http_url is not None
    body = json.dumps({"from": "0.32", "to": "0.33", "deployment": GELU}).encode()
    request = urllib.request.Request(f"{server.http_url}/v1/diff", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
        answer = json.loads(response.read())
    specs = tmp_path / "spec.json"
    specs.write_text(json.dumps(GELU))
    cli = _cli("--from", "0.32", "--to", "0.33", "--deployment", str(specs), "--json")
    printed = json.loads(cli.stdout)
    assert printed.pop("deployment") == "gelu"
    assert answer == printed and answer["changed"] is True
