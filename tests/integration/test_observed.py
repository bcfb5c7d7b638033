"""ReportDecisions and ListObservedDecisions on a real server (a primary and a replica, so a
report may land on either and the one store is the primary's): authenticated like every
RPC, bounded, kept in --state-dir across a restart, listed by `moe-control observed`; a
release newer than every ruleset compared with the newest, marked, counted and said."""

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
from service.oracle.releases import DEFAULT_RULESET, RELEASES
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


def test_a_release_newer_than_every_ruleset_is_marked_counted_and_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    newest = RELEASES[DEFAULT_RULESET]
    major, minor = (int(part) for part in newest.below.split(".")[:2])
    newer = f"{major}.{minor + 1}.0+cu130"
    metrics_port = _free_port()
    args = ("--auth-token", TOKEN, "--server-processes", "2", "--http-port", str(_free_port()))
    with (
        serving(*args, "--metrics-port", str(metrics_port)) as server,
        server.channel() as channel,
    ):
        stub: Any = pb_grpc.MoeControlServiceStub(channel)
        request = report()
        request.process.vllm_version = newer
        assert stub.ReportDecisions(request, timeout=10, metadata=AUTH).accepted == 1
        assert stub.ReportDecisions(report(), timeout=10, metadata=AUTH).accepted == 1
        listing = stub.ListObservedDecisions(
            observed_pb2.ListObservedDecisionsRequest(), timeout=10, metadata=AUTH
        )
        by_release = {d.vllm_version: d for d in listing.deployments}
        ahead, modelled = by_release[newer], by_release[report().process.vllm_version]
        assert ahead.release_not_modelled and not modelled.release_not_modelled
        assert ahead.ruleset == DEFAULT_RULESET and ahead.HasField("predicted")
        assert not ahead.first_difference  # the report decides as the newest ruleset does
        assert ahead.note.startswith(f"vLLM {newer} is not modelled: compared with ")

        flags = ["--server", server.address, "--token", TOKEN, "--timeout", "30"]
        assert main(["observed", *flags]) == 0
        text = capsys.readouterr().out
        assert text.splitlines()[0].endswith(f"; releases not modelled: {newer}")
        assert f"{newer} (not modelled)" in text and "release not modelled " in text
        assert server.http_url is not None
        served = _get(f"{server.http_url}/v1/observed")["deployments"]
        assert {d["vllm_version"]: d["release_not_modelled"] for d in served} == {
            newer: True,
            report().process.vllm_version: False,
        }
        # the metric counts it by the ruleset compared with, on the primary's /metrics
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as r:
            exposition = r.read().decode()
        sample = (
            "moe_control_observed_unmodelled_releases_total"
            f'{{outcome="agrees",ruleset="{DEFAULT_RULESET}"}} 1.0'
        )
        assert sample in exposition.splitlines()
