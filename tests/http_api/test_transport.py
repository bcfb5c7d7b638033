"""One write per answer: `Coalescing` over a real loopback socket's transport keeps the
writes of one loop step (a plain transport would have sent each at once), then sends them
joined and in order once the loop runs again; closing sends what is kept first."""

from __future__ import annotations

import asyncio
import socket

from service.http.transport import Coalescing


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
    """What arrives within `wait_s` (blocking this thread: the loop does not run)."""
    client.settimeout(wait_s)
    try:
        return client.recv(65536)
    except TimeoutError:
        return b""


def test_writes_of_one_step_go_out_joined_when_the_loop_runs_again() -> None:
    async def scenario() -> list[bytes]:
        transport, client, server = await _pair()
        transport.write(b"plain")  # the socket's own transport sends at once
        seen = [_received(client, 1.0)]
        coalescing = Coalescing(transport, asyncio.get_running_loop())
        coalescing.write(b"HTTP/1.1 200 OK\r\n\r\n")
        coalescing.write(b"body")
        seen.append(_received(client, 0.2))  # kept: the step has not ended
        await asyncio.sleep(0)  # the loop runs its ready callbacks: the flush
        seen.append(_received(client, 1.0))
        coalescing.write(b"last")
        coalescing.close()  # hands over what is kept, then closes
        seen.append(_received(client, 1.0))
        client.close()
        server.close()
        return seen

    assert asyncio.run(scenario()) == [b"plain", b"", b"HTTP/1.1 200 OK\r\n\r\nbody", b"last"]
