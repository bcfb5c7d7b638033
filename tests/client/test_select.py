"""remote_select's failures, as the CLI prints them: a refused spec as the local CLI's
`{"invalid": [...]}` (exit 2), anything else as a server error (exit 3), from a real
in-process server answering with the service's own error table."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_status import rpc_status

from service.api.errors import status_for
from service.client.errors import RemoteSelectionError
from service.client.select import EXIT_BAD_INPUT, EXIT_SERVER_ERROR, remote_select
from service.oracle import InvalidSpecError

SERVICE = "moe_control.v1.MoeControlService"


async def _refuse(request: bytes, context: Any) -> bytes:
    if b"bad" in request:
        error = InvalidSpecError.single("layer.top_k", "required")
        await context.abort_with_status(rpc_status.to_status(status_for(error)))
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
