"""The HTTP/JSON door of a server with several processes (`--server-processes 2`): the
primary and the replica both listen on the HTTP port and answer it themselves, so
connections land on either; every answer is the same whichever process took it, and what
only the primary knows (its workers, their layers, the decisions reported to it) is the
primary's, asked of it by the replica. Metrics sum both processes' requests."""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from urllib.parse import urlsplit

import pytest

from integration.serverproc import ServerProcess
from integration.test_replicas import established_on, replica_pids, sample, scrape
from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc
from service.oracle import select
from tests.api.codecs.test_observed import report

pytestmark = pytest.mark.timeout(300)

Factory = Callable[..., ServerProcess]
TOKEN = "door-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SPEC: dict[str, Any] = {
    "id": "fleet",
    "hf_quantization_config": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "sym": True,
        "desc_act": False,
    },
    "layer": {"num_experts": 60, "top_k": 4, "hidden_size": 2048, "intermediate_size": 1408},
    "platform": "a100",
}
#: Connections opened: all landing on one of two processes has odds 2**-15.
CONNECTIONS = 16


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def connections(server: ServerProcess) -> Iterator[list[http.client.HTTPConnection]]:
    """`CONNECTIONS` keep-alive connections to the HTTP door, each open."""
    assert server.http_url is not None
    url = urlsplit(server.http_url)
    with ExitStack() as stack:
        opened = []
        for _ in range(CONNECTIONS):
            connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=10)
            connection.connect()
            stack.callback(connection.close)
            opened.append(connection)
        yield opened


def call(
    connection: http.client.HTTPConnection,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    connection.request(
        "GET" if data is None else "POST",
        path,
        body=data,
        headers=AUTH if headers is None else headers,
    )
    response = connection.getresponse()
    return response.status, json.loads(response.read())


def test_every_process_answers_http_alike_and_state_is_the_primarys(
    server_factory: Factory,
) -> None:
    http_port = _free_port()
    server = server_factory(
        "--server-processes", "2", "--auth-token", TOKEN, "--http-port", str(http_port)
    )
    (replica,) = replica_pids(server)
    with server.channel() as channel:  # one decision reported, into the primary's store
        stub: Any = pb_grpc.MoeControlServiceStub(channel)
        metadata = (("authorization", f"Bearer {TOKEN}"),)
        assert stub.ReportDecisions(report(), timeout=10, metadata=metadata).accepted == 1
    expected_select = {"id": "fleet", **select(SPEC, what_would_change=True).to_json()}
    answers: dict[str, list[Any]] = {}
    with connections(server) as opened:
        for connection in opened:
            for name, path, body in (
                ("select", "/v1/select", SPEC),
                ("workers", "/v1/workers", None),
                ("layers", "/v1/layers", None),
                ("no_such_worker", "/v1/layers?worker_index=7", None),
                ("observed", "/v1/observed", None),
                ("readyz", "/readyz", None),
            ):
                answers.setdefault(name, []).append(call(connection, path, body))
            answers.setdefault("no_token", []).append(call(connection, "/v1/workers", headers={}))
        assert established_on(server.process.pid, http_port) > 0
        assert established_on(replica, http_port) > 0, "no HTTP connection reached the replica"

    for name, got in answers.items():
        assert all(answer == got[0] for answer in got), f"{name} differs between processes"
    assert answers["select"][0] == (200, expected_select)
    status, workers = answers["workers"][0]
    assert status == 200 and workers["ready"] and workers["ready_workers"] == 1
    assert workers["workers"][0]["pid"] not in (server.process.pid, replica)  # the worker's
    assert answers["layers"][0] == (200, [])  # no layer kept
    status, error = answers["no_such_worker"][0]
    assert status == 404 and error["error"]["status"] == "NOT_FOUND"
    assert error["error"]["details"][0]["resource_name"] == "7"
    status, observed = answers["observed"][0]
    assert status == 200 and len(observed["deployments"]) == 1
    assert answers["readyz"][0] == (200, {"status": "SERVING"})
    assert answers["no_token"][0][0] == 401

    text = scrape(server)
    n = float(CONNECTIONS)
    requests = "moe_control_http_requests_total"
    assert sample(text, requests, method="POST", route="/v1/select", code="200") == n
    assert sample(text, requests, method="GET", route="/v1/layers", code="404") == n
    assert sample(text, requests, method="GET", route="/v1/workers", code="401") == n
