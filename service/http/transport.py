"""One write per answer: uvicorn's httptools protocol over a transport that joins the
writes of one loop step.

uvicorn writes an answer's head (status line and headers), then its body, as two
`transport.write` calls; with Nagle's algorithm off (serve.py) each is a `send` system call
of its own, and those two calls were the largest share of the door's CPU. The ASGI app
sends both in one step of the event loop (nothing in between waits), so `Coalescing` keeps
the writes of a step and hands them to the socket joined, once, when the loop next runs
its ready callbacks: one `send` an answer. Closing hands over what is kept first; the
rest of the transport (flow control, extra info, ...) is the socket's own.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class Coalescing:
    """A transport that joins the writes of one loop step into one."""

    __slots__ = ("_kept", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._kept: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._kept:
            self._loop.call_soon(self.flush)
        self._kept.append(data)

    def flush(self) -> None:
        """Hand what is kept to the socket, in one write."""
        if not self._kept:
            return
        data = self._kept[0] if len(self._kept) == 1 else b"".join(self._kept)
        self._kept.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol writing through `Coalescing`."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(Coalescing(transport, self.loop))  # type: ignore[arg-type]
