"""The door served by uvicorn on a real loopback socket: each accepted connection has
Nagle's algorithm off (TCP_NODELAY), so keep-alive answers are not held back for the
client's delayed ACK; and each answer goes out in one write (head and body joined)."""

from __future__ import annotations

import asyncio
import socket

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.http.serve import start_http
from service.settings import Settings

from .conftest import make_client


def test_accepted_connections_have_nagle_off() -> None:
    async def scenario() -> list[int]:
        test_client, _ = make_client()
        door = await start_http(test_client.app, Settings(http_port=0))  # type: ignore[arg-type]
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
            flags = [
                conn.transport.get_extra_info("socket").getsockopt(
                    socket.IPPROTO_TCP, socket.TCP_NODELAY
                )
                for conn in door.server.server_state.connections
            ]
            writer.close()
            return flags
        finally:
            await door.stop()

    flags = asyncio.run(scenario())
    assert flags and all(flags), flags


def test_uvicorn_parses_with_httptools() -> None:
    """httptools (a dependency) is the parser uvicorn picks: half h11's CPU per request."""

    async def scenario() -> type:
        test_client, _ = make_client()
        door = await start_http(test_client.app, Settings(http_port=0))  # type: ignore[arg-type]
        try:
            return door.server.config.http_protocol_class  # type: ignore[no-any-return]
        finally:
            await door.stop()

    assert issubclass(asyncio.run(scenario()), HttpToolsProtocol)
