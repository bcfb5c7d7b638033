"""The server's one interceptor: bearer-token auth, domain error -> status mapping, metrics.

All three wrap every RPC the same way, so they are one wrapper, built once per method and
cached (the per-call path is a dict lookup plus the wrapper itself). Health checks are exempt
from auth so Kubernetes probes and load balancers need no credentials.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc_status import rpc_status

from service.api.errors import UnauthenticatedError, status_for
from service.metrics import Metrics

log = logging.getLogger("moe_control.api")

HEALTH_SERVICE = "grpc.health.v1.Health"
#: Services callable without a token.
AUTH_EXEMPT_SERVICES = frozenset({HEALTH_SERVICE})

_OK = grpc.StatusCode.OK.name
_CANCELLED = grpc.StatusCode.CANCELLED.name
_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


class _MethodMetrics:
    """Label children of one method, resolved once."""

    def __init__(self, metrics: Metrics, grpc_type: str, service: str, method: str) -> None:
        labels = (grpc_type, service, method)
        self.started = metrics.grpc_started.labels(*labels)
        self.seconds = metrics.grpc_handling_seconds.labels(*labels)
        self.received = metrics.grpc_msg_received.labels(*labels)
        self.sent = metrics.grpc_msg_sent.labels(*labels)
        self._handled = metrics.grpc_handled
        self._labels = labels
        self._by_code: dict[str, Any] = {}

    def handled(self, code: str, seconds: float) -> None:
        child = self._by_code.get(code)
        if child is None:
            child = self._handled.labels(*self._labels, code)
            self._by_code[code] = child
        child.inc()
        self.seconds.observe(seconds)


def _grpc_type(handler: grpc.RpcMethodHandler[Any, Any]) -> str:
    if handler.request_streaming and handler.response_streaming:
        return "bidi_stream"
    if handler.request_streaming:
        return "client_stream"
    if handler.response_streaming:
        return "server_stream"
    return "unary"


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class ServerInterceptor(grpc.aio.ServerInterceptor):
    """Auth (optional), errors and metrics around every method of the server."""

    def __init__(self, metrics: Metrics, *, token: str | None = None) -> None:
        self._metrics = metrics
        self._token_digest = _digest(token) if token else None
        self._handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method: str = handler_call_details.method
        wrapped = self._handlers.get(method)
        if wrapped is None:
            handler = await continuation(handler_call_details)
            if handler is None:
                return handler  # unknown method: the server answers UNIMPLEMENTED
            wrapped = self._wrap(method, handler)
            self._handlers[method] = wrapped
        return wrapped

    # -----------------------------------------------------------------------------------

    def _authorized(self, context: grpc.aio.ServicerContext[Any, Any]) -> bool:
        assert self._token_digest is not None
        for key, value in context.invocation_metadata() or ():
            if key == "authorization" and isinstance(value, str):
                scheme, _, token = value.partition(" ")
                if scheme.lower() == "bearer" and token:
                    return hmac.compare_digest(_digest(token.strip()), self._token_digest)
        return False

    @staticmethod
    async def _abort(
        exc: Exception,
        context: grpc.aio.ServicerContext[Any, Any],
        stats: _MethodMetrics,
        start: float,
    ) -> None:
        """End the call with the status (and details) `exc` maps to; raises AbortError.

        The call is counted first: the client sees the status as soon as abort sends it."""
        status = status_for(exc)
        name = _CODE_NAMES.get(status.code, "UNKNOWN")
        if name == "INTERNAL":
            log.error("unhandled error in an RPC", exc_info=exc)
        stats.handled(name, time.perf_counter() - start)
        await context.abort_with_status(rpc_status.to_status(status))

    def _wrap(
        self, method: str, handler: grpc.RpcMethodHandler[Any, Any]
    ) -> grpc.RpcMethodHandler[Any, Any]:
        _, service, name = method.split("/", 2) if method.count("/") >= 2 else ("", "", method)
        grpc_type = _grpc_type(handler)
        stats = _MethodMetrics(self._metrics, grpc_type, service, name)
        check_auth = self._token_digest is not None and service not in AUTH_EXEMPT_SERVICES
        deny = "missing or wrong bearer token (metadata 'authorization: Bearer <token>')"

        if not handler.request_streaming and not handler.response_streaming:
            inner: Any = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                start = time.perf_counter()
                stats.started.inc()
                try:
                    if check_auth and not self._authorized(context):
                        raise UnauthenticatedError(deny)
                    response = await inner(request, context)
                except asyncio.CancelledError:
                    stats.handled(_CANCELLED, time.perf_counter() - start)
                    raise
                except grpc.aio.AbortError:  # the handler aborted by itself
                    stats.handled(_code_of(context), time.perf_counter() - start)
                    raise
                except Exception as exc:
                    await self._abort(exc, context, stats, start)
                stats.handled(_OK, time.perf_counter() - start)
                return response

            return grpc.unary_unary_rpc_method_handler(
                unary_unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )

        async def counted(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
            async for item in requests:
                stats.received.inc()
                yield item

        original: Any = handler.stream_stream or handler.stream_unary or handler.unary_stream

        async def call(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            """Run the handler as an async iterator of responses, whatever its style."""
            if check_auth and not self._authorized(context):
                raise UnauthenticatedError(deny)
            if handler.request_streaming:
                request = counted(request)
            else:
                stats.received.inc()
            if handler.response_streaming and inspect.isasyncgenfunction(original):
                async for item in original(request, context):
                    stats.sent.inc()
                    yield item
            else:
                # A coroutine: a unary response, or a stream written with context.write().
                result = await original(request, context)
                if not handler.response_streaming:
                    stats.sent.inc()
                    yield result

        async def guarded(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            start = time.perf_counter()
            stats.started.inc()
            try:
                async for item in call(request, context):
                    yield item
            except asyncio.CancelledError:
                stats.handled(_CANCELLED, time.perf_counter() - start)
                raise
            except grpc.aio.AbortError:  # the handler aborted by itself
                stats.handled(_code_of(context), time.perf_counter() - start)
                raise
            except Exception as exc:
                await self._abort(exc, context, stats, start)
            stats.handled(_OK, time.perf_counter() - start)

        if handler.response_streaming:
            factory = (
                grpc.stream_stream_rpc_method_handler
                if handler.request_streaming
                else grpc.unary_stream_rpc_method_handler
            )
            return factory(
                guarded,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )

        async def stream_unary(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            result = None
            async for item in guarded(requests, context):
                result = item
            return result

        return grpc.stream_unary_rpc_method_handler(
            stream_unary,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _code_of(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    return _CODE_NAMES.get(code, "UNKNOWN")
