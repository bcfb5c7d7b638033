"""A server owns its ports: a second server told to listen on a port the first holds exits
2 at once naming that port and its setting, and the first goes on serving every request,
over gRPC and HTTP, from its primary and its replica."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import pytest

from integration.serverproc import ServerProcess
from integration.test_http_processes import _free_port
from integration.test_replicas import SPEC, channels, established_on, replica_pids
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc
from service.oracle import select

pytestmark = pytest.mark.timeout(300)

Factory = Callable[..., ServerProcess]
#: Separate connections per door: all landing on one of two processes has odds 2**-15.
CONNECTIONS = 16


def second_server(*args: str) -> subprocess.CompletedProcess[str]:
    """`moe-control serve` run to its end (it must not start)."""
    command = [
        sys.executable,
        "-m",
        "service.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--devices",
        "cpu",
        "--server-processes",
        "2",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def select_over_grpc(server: ServerProcess) -> list[str]:
    """One SelectBackend on each of `CONNECTIONS` connections: the backends answered."""
    request = pb.SelectBackendRequest(spec_json=json.dumps(SPEC))
    with channels(server, CONNECTIONS) as opened:
        backends = [
            pb_grpc.MoeControlServiceStub(channel).SelectBackend(request, timeout=10).backend
            for channel in opened
        ]
        assert established_on(server.process.pid, server.port) > 0
        for pid in replica_pids(server):
            assert established_on(pid, server.port) > 0, "no gRPC connection reached a replica"
    return backends


def select_over_http(server: ServerProcess) -> list[int]:
    """One POST /v1/select on each of `CONNECTIONS` connections: the statuses."""
    assert server.http_url is not None
    url = urlsplit(server.http_url)
    statuses = []
    for _ in range(CONNECTIONS):
        connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=10)
        try:
            connection.request("POST", "/v1/select", body=json.dumps(SPEC).encode())
            response = connection.getresponse()
            response.read()
            statuses.append(response.status)
        finally:
            connection.close()
    return statuses


def test_a_taken_port_stops_a_second_server_and_the_first_serves_on(
    server_factory: Factory,
) -> None:
    http_port, metrics_port = _free_port(), _free_port()
    first = server_factory(
        "--server-processes",
        "2",
        "--http-port",
        str(http_port),
        "--metrics-port",
        str(metrics_port),
    )
    assert len(replica_pids(first)) == 1

    taken: list[tuple[str, tuple[str, ...]]] = [
        ("--port", ("--port", str(first.port), "--http-port", "0", "--metrics-port", "0")),
        ("--http-port", ("--port", "0", "--http-port", str(http_port), "--metrics-port", "0")),
        (
            "--metrics-port",
            ("--port", "0", "--http-port", "0", "--metrics-port", str(metrics_port)),
        ),
    ]
    for flag, args in taken:
        second = second_server(*args)
        assert second.returncode == 2, (flag, second.stdout, second.stderr)
        assert "listening" not in second.stdout
        port = args[args.index(flag) + 1]
        env = "MOE_CONTROL_" + flag[2:].replace("-", "_").upper()
        assert f"port {port} ({flag}, {env}) is taken" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr

    expected = select(SPEC).backend
    assert select_over_grpc(first) == [expected] * CONNECTIONS
    assert select_over_http(first) == [200] * CONNECTIONS


def test_every_process_of_one_server_shares_its_http_socket(server_factory: Factory) -> None:
    """The replica accepts HTTP connections on the primary's socket (inherited): the port
    has one listening socket, which both processes serve."""
    http_port = _free_port()
    server = server_factory("--server-processes", "2", "--http-port", str(http_port))
    listening = _listening_inodes(http_port)
    assert len(listening) == 1, listening
    assert select_over_http(server) == [200] * CONNECTIONS


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]  # noqa: SIM115 - read once
        except OSError:
            continue
        for line in lines:
            fields: list[Any] = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                inodes.add(fields[9])
    return inodes
