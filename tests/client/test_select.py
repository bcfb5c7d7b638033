"""remote_select's failures, as the CLI prints them: a refused spec as the local CLI's
`{"invalid": [...]}` (exit 2), anything else as a server error (exit 3), from a real
in-process server answering with the service's own error table; and its calls go through
the shared `Connection`/`Session`: retried on UNAVAILABLE carrying RetryInfo, bounded by the
session's deadline (DEADLINE_EXCEEDED, exit 3)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from service.api.errors import status_for
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.names import SERVICE_NAME
from service.client.channel import Connection
from service.client.errors import RemoteSelectionError
from service.client.select import EXIT_BAD_INPUT, EXIT_SERVER_ERROR, remote_select
from service.oracle import InvalidSpecError

SERVICE = SERVICE_NAME
#: SelectBackend calls the fake server has seen, by the marker in their spec.
CALLS: dict[str, int] = {}


def _restarting() -> status_pb2.Status:
    """UNAVAILABLE with the RetryInfo a server sends while its worker restarts."""
    info = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(nanos=50_000_000))
    detail = any_pb2.Any()
    detail.Pack(info)
    return status_pb2.Status(
        code=code_pb2.UNAVAILABLE, message="worker 0 is restarting", details=[detail]
    )


async def _refuse(request: bytes, context: Any) -> bytes:
    for marker in (b"bad", b"flaky", b"slow"):
        if marker in request:
            CALLS[marker.decode()] = CALLS.get(marker.decode(), 0) + 1
    if b"bad" in request:
        error = InvalidSpecError.single("layer.top_k", "required")
        await context.abort_with_status(rpc_status.to_status(status_for(error)))
    if b"flaky" in request:
        if CALLS["flaky"] <= 2:
            await context.abort_with_status(rpc_status.to_status(_restarting()))
        return bytes(pb.SelectBackendResponse(backend="MARLIN").SerializeToString())
    if b"slow" in request:
        await asyncio.sleep(5)
    await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is ready")
    raise AssertionError("abort returned")


@pytest.fixture
def target() -> Iterator[str]:
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict[str, Any] = {}

    async def main() -> None:
        server = grpc.aio.server()
        handler = grpc.unary_unary_rpc_method_handler(_refuse)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"SelectBackend": handler}),)
        )
        holder["port"] = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        holder["stop"] = asyncio.Event()
        started.set()
        await holder["stop"].wait()
        await server.stop(None)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),))
    thread.start()
    started.wait(10)
    try:
        yield f"127.0.0.1:{holder['port']}"
    finally:
        loop.call_soon_threadsafe(holder["stop"].set)
        thread.join(10)
        loop.close()


def test_a_refused_spec_is_the_local_clis_invalid_shape(target: str) -> None:
    with pytest.raises(RemoteSelectionError) as refused:
        remote_select(target, {"bad": True}, timeout=10)
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.exit_code == EXIT_BAD_INPUT
    assert refused.value.result == {
        "invalid": [{"field": "layer.top_k", "description": "required"}]
    }


def test_other_failures_are_server_errors(target: str) -> None:
    with pytest.raises(RemoteSelectionError) as failed:
        remote_select(target, {"model": "x"}, timeout=10)
    assert failed.value.exit_code == EXIT_SERVER_ERROR
    assert failed.value.result["error"] == {
        "stage": "server",
        "type": "UNAVAILABLE",
        "message": "no worker is ready",
    }


def test_unavailable_with_retry_info_is_retried(target: str) -> None:
    CALLS.pop("flaky", None)
    result = remote_select(Connection(target, timeout=10), {"flaky": True})
    assert result["backend"] == "MARLIN"
    assert CALLS["flaky"] == 3  # two refusals, then the answer


def test_unavailable_without_retry_info_is_not_retried(target: str) -> None:
    CALLS.pop("bad", None)
    with pytest.raises(RemoteSelectionError):
        remote_select(target, {"bad": True}, timeout=10)
    assert CALLS["bad"] == 1


def test_one_session_asks_many_questions_under_its_deadline(target: str) -> None:
    CALLS.pop("flaky", None)
    with Connection(target, timeout=10).session() as session:
        first = remote_select(session, {"flaky": 1})
        second = remote_select(session, {"flaky": 2})
    assert first["backend"] == second["backend"] == "MARLIN"
    assert CALLS["flaky"] == 4


def test_the_session_deadline_bounds_the_call(target: str) -> None:
    with pytest.raises(RemoteSelectionError) as late:
        remote_select(Connection(target, timeout=0.3), {"slow": True})
    assert late.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert late.value.exit_code == EXIT_SERVER_ERROR
    assert late.value.result["error"]["type"] == "DEADLINE_EXCEEDED"
