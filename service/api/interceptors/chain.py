"""The interceptors composed around each method's handler, once, when it is registered.

Outermost first: metrics (when counted here), auth (when a token is configured), error ->
status, concurrency limits (when the server has them), then the handler (with the metrics'
message counting next to it for streaming methods). An interceptor with nothing to do for a
method leaves it alone, so a method pays only for the concerns that apply to it. Only
grpc.aio handlers (coroutines and async generators) are wrapped: every server here is a
grpc.aio server.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from typing import Any

import grpc

from service.api.interceptors.auth import BearerAuth
from service.api.interceptors.handlers import Context, Handler, Interceptor, Method, Stream
from service.api.interceptors.limits import ConcurrencyLimits, Limits
from service.api.interceptors.metrics import CallMetrics
from service.api.interceptors.registrar import HandlerRegistrar
from service.api.interceptors.status import ErrorStatus
from service.metrics import Metrics


class InterceptorChain:
    """Every concern configured for a server, to wrap its handlers with.

    `metrics=None` leaves the gRPC server metrics alone: the private endpoint that replicas
    forward calls to must not count a call the replica already counted. `token`: require
    it (health exempt). `limits`: the per-method concurrency limits."""

    def __init__(
        self, metrics: Metrics | None, *, token: str | None = None, limits: Limits | None = None
    ) -> None:
        self._metrics = CallMetrics(metrics) if metrics is not None else None
        self._status = ErrorStatus()
        chain: list[Interceptor] = [] if self._metrics is None else [self._metrics]
        if token:
            chain.append(BearerAuth(token))
        chain.append(self._status)
        if limits is not None:
            chain.append(ConcurrencyLimits(limits))
        self._chain = tuple(reversed(chain))  # innermost first
        self._wrapped: dict[str, tuple[Handler, Handler]] = {}

    def registrar(self, server: grpc.aio.Server) -> HandlerRegistrar:
        """A stand-in for `server` in `add_*Servicer_to_server` calls; see HandlerRegistrar."""
        return HandlerRegistrar(server, self.wrap)

    def wrap(self, method: str, handler: Handler) -> Handler:
        """`handler` inside the chain (built once per method and handler)."""
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(Method.of(method, handler), handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _wrap(self, method: Method, handler: Handler) -> Handler:
        if not method.request_streaming and not method.response_streaming:
            unary: Any = handler.unary_unary
            for interceptor in self._chain:
                unary = interceptor.unary(method, unary)
            return grpc.unary_unary_rpc_method_handler(
                unary,
                request_deserializer=self._status.request_deserializer(
                    handler.request_deserializer
                ),
                response_serializer=handler.response_serializer,
            )
        stream = _as_stream(method, handler)
        if self._metrics is not None:
            stream = self._metrics.messages(method, stream)
        for interceptor in self._chain:
            stream = interceptor.stream(method, stream)
        if not method.response_streaming:
            return grpc.stream_unary_rpc_method_handler(
                _last_of(stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        factory = (
            grpc.stream_stream_rpc_method_handler
            if method.request_streaming
            else grpc.unary_stream_rpc_method_handler
        )
        return factory(
            stream,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _as_stream(method: Method, handler: Handler) -> Stream:
    """A streaming handler as an async iterator of responses, whatever its style: an async
    generator as it is; a coroutine (a unary response, or a stream written with
    context.write()) yielding its unary response, if any."""
    original: Any = handler.stream_stream or handler.stream_unary or handler.unary_stream
    if method.response_streaming and inspect.isasyncgenfunction(original):
        return original  # type: ignore[no-any-return]

    async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
        result = await original(request, context)
        if not method.response_streaming:
            yield result

    return stream


def _last_of(stream: Stream) -> Any:
    """A client-stream handler answering the one response `stream` yields."""

    async def stream_unary(requests: Any, context: Context) -> Any:
        result = None
        async for item in stream(requests, context):
            result = item
        return result

    return stream_unary
