"""One write per answer: uvicorn's httptools protocol over a transport that holds an
answer's head until its body.

uvicorn writes an answer's head (status line and headers, one write), then its body; with
Nagle's algorithm off (serve.py) each write is a `send` system call of its own, and those
two calls were the largest share of the door's CPU. `Coalescing` keeps the head and sends
it joined to the write that follows it, the body's (an answer without a body writes an
empty one), so an answer is one `send`. Only a final answer's head is held (an interim
`100 Continue` must reach the client before it sends the body) and only one per answer:
the protocol says when an answer is complete. Closing sends a held head first; the rest of
the transport (flow control, extra info, ...) is the socket's own.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

#: How every answer's head starts, and an interim (1xx) one's.
_STATUS_LINE = b"HTTP/1.1 "
_INTERIM = b"HTTP/1.1 1"


class Coalescing:
    """A transport that sends an answer's head with the write after it."""

    __slots__ = ("_answering", "_head", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._head: bytes | None = None
        #: Between an answer's head and its end: every write is the body's.
        self._answering = False

    def write(self, data: bytes) -> None:
        head = self._head
        if head is not None:
            self._head = None
            self._transport.write(head + data)
        elif (
            not self._answering and data.startswith(_STATUS_LINE) and not data.startswith(_INTERIM)
        ):
            self._head = data
            self._answering = True
        else:
            self._transport.write(data)

    def answered(self) -> None:
        """The answer is complete: the next status line is the next answer's head."""
        self.flush()
        self._answering = False

    def flush(self) -> None:
        """Send a held head now."""
        head, self._head = self._head, None
        if head is not None and not self._transport.is_closing():
            self._transport.write(head)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol writing through `Coalescing`."""

    transport: Any

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(Coalescing(transport))  # type: ignore[arg-type]

    def on_response_complete(self) -> None:
        self.transport.answered()
        super().on_response_complete()
