"""The shapes the interceptors wrap, and what they know of the method they wrap.

Every handler reaches an interceptor in one of two shapes: `Unary` (a coroutine answering
one request) or `Stream` (an async iterator of responses; the chain turns a client-stream
or a `context.write` handler into one and back). An interceptor takes the `Method` and the
inner behaviour and returns the wrapped one, or the inner one itself where it has nothing
to do for that method, which then costs nothing per call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

import grpc

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"  # generic in the stubs only
Unary: TypeAlias = Callable[[Any, Any], Awaitable[Any]]
Stream: TypeAlias = Callable[[Any, Any], AsyncIterator[Any]]


@dataclass(frozen=True, slots=True)
class Method:
    """One method of the server: '/pkg.Service/Name' and its call shape."""

    full_name: str
    service: str
    name: str
    request_streaming: bool
    response_streaming: bool

    @classmethod
    def of(cls, full_name: str, handler: Handler) -> Method:
        service, name = "", full_name
        if full_name.count("/") >= 2:
            _, service, name = full_name.split("/", 2)
        return cls(full_name, service, name, handler.request_streaming, handler.response_streaming)

    @property
    def grpc_type(self) -> str:
        """The `grpc_type` label of the standard gRPC server metrics."""
        if self.request_streaming and self.response_streaming:
            return "bidi_stream"
        if self.request_streaming:
            return "client_stream"
        if self.response_streaming:
            return "server_stream"
        return "unary"


class Interceptor(Protocol):
    """One concern around a method's handler."""

    def unary(self, method: Method, inner: Unary) -> Unary: ...

    def stream(self, method: Method, inner: Stream) -> Stream: ...


_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


def code_name(context: Context) -> str:
    """The name of the status a call was ended with (by an abort)."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    return _CODE_NAMES.get(code, "UNKNOWN")
