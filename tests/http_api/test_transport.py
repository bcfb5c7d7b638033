"""One write per answer: `Coalescing` over a real loopback socket's transport holds an
answer's head (a plain transport sends each write at once) and sends it joined to the
body's write; an interim 100 Continue goes out at once; after the answer, the next head is
held again; closing sends a held head first. Through the real door, answers are whole."""

from __future__ import annotations

import asyncio
import socket

from service.http.serve import start_http
from service.http.transport import Coalescing
from service.settings import Settings

from .conftest import make_client

HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n"


async def _pair() -> tuple[asyncio.Transport, socket.socket, asyncio.AbstractServer]:
    loop = asyncio.get_running_loop()
    accepted: asyncio.Future[asyncio.Transport] = loop.create_future()

    class Keep(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            accepted.set_result(transport)  # type: ignore[arg-type]

    server = await loop.create_server(Keep, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    return await accepted, client, server


def _received(client: socket.socket, wait_s: float) -> bytes:
    """What arrives within `wait_s`."""
    client.settimeout(wait_s)
    try:
        return client.recv(65536)
    except TimeoutError:
        return b""


def test_a_head_goes_out_with_its_body() -> None:
    async def scenario() -> list[bytes]:
        transport, client, server = await _pair()
        coalescing = Coalescing(transport)
        seen = []
        coalescing.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # interim: at once
        seen.append(_received(client, 1.0))
        coalescing.write(HEAD)
        seen.append(_received(client, 0.2))  # held
        coalescing.write(b"body")
        seen.append(_received(client, 1.0))
        coalescing.answered()
        coalescing.write(HEAD)  # the next answer's head: held again
        seen.append(_received(client, 0.2))
        coalescing.close()  # sends it, then closes
        seen.append(_received(client, 1.0))
        client.close()
        server.close()
        return seen

    assert asyncio.run(scenario()) == [
        b"HTTP/1.1 100 Continue\r\n\r\n",
        b"",
        HEAD + b"body",
        b"",
        HEAD,
    ]


def test_the_door_answers_keep_alive_requests_whole() -> None:
    async def scenario() -> list[bytes]:
        test_client, _ = make_client()
        door = await start_http(test_client.app, Settings(http_port=0))  # type: ignore[arg-type]
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
            answers = []
            for path in (b"/healthz", b"/v1/rulesets", b"/nowhere"):
                writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                body = await asyncio.wait_for(reader.readexactly(length), 5)
                answers.append(head.split(b"\r\n")[0] + b" " + body[:20])
            writer.close()
            return answers
        finally:
            await door.stop()

    first, second, third = asyncio.run(scenario())
    assert first == b'HTTP/1.1 200 OK {"status":"SERVING"}'
    assert second.startswith(b"HTTP/1.1 200 OK [")
    assert third.startswith(b"HTTP/1.1 404 Not Found {")
