"""ReportDecisions and ListObservedDecisions on a real server (a primary and a replica, so a
report may land on either and the one store is the primary's): authenticated like every
RPC, bounded, kept in --state-dir across a restart, listed by `moe-control observed`."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from integration.serverproc import ServerProcess, launch, wait_ready
from service.api.codecs import observed as codec
from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc
from service.api.generated.moe_control.v1 import observed_pb2
from service.cli import main
from tests.api.codecs.test_observed import report

pytestmark = pytest.mark.timeout(600)

TOKEN = "fleet-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


@contextmanager
def serving(*args: str) -> Iterator[ServerProcess]:
    server = launch(*args)
    try:
        wait_ready(server, timeout=120)  # a busy CI machine starts the CPU worker slowly
        yield server
    finally:
        server.stop()


def test_reports_are_authenticated_bounded_kept_and_listed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("--auth-token", TOKEN, "--state-dir", str(tmp_path), "--server-processes", "2")
    with serving(*args) as server, server.channel() as channel:
        stub: Any = pb_grpc.MoeControlServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ReportDecisions(report(), timeout=10)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        for _ in range(3):  # over both processes, into the primary's one store
            assert stub.ReportDecisions(report(), timeout=10, metadata=AUTH).accepted == 1
        with pytest.raises(grpc.RpcError) as too_many:
            stub.ReportDecisions(report(codec.MAX_BATCH + 1), timeout=10, metadata=AUTH)
        assert too_many.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        status = rpc_status.from_call(too_many.value)  # type: ignore[arg-type]
        assert status is not None
        bad = error_details_pb2.BadRequest()
        assert any(d.Unpack(bad) for d in status.details)
        assert [v.field for v in bad.field_violations] == ["decisions"]
        listing = stub.ListObservedDecisions(
            observed_pb2.ListObservedDecisionsRequest(), timeout=10, metadata=AUTH
        )
    (deployment,) = listing.deployments
    assert deployment.count == 3 and deployment.ruleset == "vllm-0.33"
    assert not deployment.first_difference

    with serving(*args, "--http-port", str(_free_port())) as again:
        flags = ["--server", again.address, "--token", TOKEN, "--timeout", "30"]
        assert main(["observed", *flags, "--json"]) == 0
        (kept,) = json.loads(capsys.readouterr().out)["deployments"]
        assert kept["count"] == 3 and kept["key"] == deployment.key
        assert main(["observed", *flags]) == 0
        assert capsys.readouterr().out.startswith("1 observed deployments, 0 mismatched")
        assert main(["observed", *flags, "--mismatches"]) == 0
        assert capsys.readouterr().out.startswith("0 observed deployments")
        # GET /v1/observed answers what `observed --json` prints, behind the same token
        assert _get(f"{again.http_url}/v1/observed")["deployments"] == [kept]
        assert _get(f"{again.http_url}/v1/observed?mismatches=true")["deployments"] == []
        with pytest.raises(urllib.error.HTTPError) as anonymous:
            urllib.request.urlopen(f"{again.http_url}/v1/observed", timeout=30)
        assert anonymous.value.code == 401


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _get(url: str) -> Any:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())
