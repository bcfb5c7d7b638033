"""The server's one interceptor: bearer-token auth, per-method concurrency limits (limits.py),
domain error -> status mapping, metrics.

All four wrap every RPC the same way, so they are one wrapper around each method handler,
for the handlers of a grpc.aio server (coroutines) and of a sync grpc server alike. It is
applied when the handlers are registered (`ServerInterceptor.registrar`), which works the
same for both kinds of server and for the handlers that the servicer registers itself at
the byte level (selection.py), and leaves grpc nothing to run per call but the wrapper.
Health checks are exempt from auth so Kubernetes probes and load balancers need no
credentials.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from typing import Any, TypeAlias

import grpc
from google.protobuf.message import DecodeError
from grpc_status import rpc_status

from service.api.errors import UnauthenticatedError, status_for
from service.api.limits import Limit, Limits, SlotHolder
from service.formats.errors import ConvertInputError
from service.metrics import Metrics

log = logging.getLogger("moe_control.api")

HEALTH_SERVICE = "grpc.health.v1.Health"
#: Services callable without a token.
AUTH_EXEMPT_SERVICES = frozenset({HEALTH_SERVICE})

DENY = "missing or wrong bearer token (metadata 'authorization: Bearer <token>')"
#: The methods handed to grpc's core as pre-registered methods; every other one is found
#: through a generic handler (one dict lookup per call). grpc.aio keeps a pending request
#: per pre-registered method, and its accept loop passes all of them to `asyncio.wait` for
#: every call it accepts, so each one costs every call of every method: a cached
#: SelectBackend took 0.586 M instructions with the 11 methods of the public server
#: pre-registered and 0.524 M with only itself (callgrind, bench/RESULTS.md). Only the
#: method called at high rates is worth a pending request of its own.
PRE_REGISTERED = frozenset({"/moe_control.v1.MoeControlService/SelectBackend"})
_OK = grpc.StatusCode.OK.name
_CANCELLED = grpc.StatusCode.CANCELLED.name
_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"  # generic in the stubs only


class _Undecodable:
    """What a unary request that is not its method's protobuf deserializes to: grpc would
    answer UNKNOWN (aio) or INTERNAL (sync) before any handler ran, so the wrappers below
    answer INVALID_ARGUMENT (field "request") instead (found by tests/reliability)."""

    def __init__(self, error: DecodeError) -> None:
        self.error = ConvertInputError("request", f"cannot be parsed: {error}")


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            return _Undecodable(exc)

    return deserialize


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


class _Uncounted:
    """Stands in for a counter child where calls are counted elsewhere."""

    def inc(self, amount: float = 1) -> None:
        pass


class _UncountedMethod:
    """The metrics of a method whose calls another process counts (see replica.py)."""

    started = received = sent = _Uncounted()

    def handled(self, code: str, seconds: float) -> None:
        pass


def _grpc_type(handler: Handler) -> str:
    if handler.request_streaming and handler.response_streaming:
        return "bidi_stream"
    if handler.request_streaming:
        return "client_stream"
    if handler.response_streaming:
        return "server_stream"
    return "unary"


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _split(method: str) -> tuple[str, str]:
    """'/pkg.Service/Method' -> ('pkg.Service', 'Method')."""
    if method.count("/") >= 2:
        _, service, name = method.split("/", 2)
        return service, name
    return "", method


class ServerInterceptor:
    """Auth (optional), concurrency limits (optional), errors and metrics around every
    method of the server.

    `metrics=None` leaves the gRPC server metrics alone: the private endpoint that replicas
    forward calls to (replica.py) must not count a call the replica already counted.
    `limits` caps the methods it names (limits.py); after auth, before the handler. Only
    the handlers of a grpc.aio server are limited (the semaphores are asyncio's)."""

    def __init__(
        self, metrics: Metrics | None, *, token: str | None = None, limits: Limits | None = None
    ) -> None:
        self._metrics = metrics
        self._limits = limits
        self._token_digest = _digest(token) if token else None
        self._wrapped: dict[str, tuple[Handler, Handler]] = {}

    def registrar(self, server: grpc.aio.Server | grpc.Server) -> HandlerRegistrar:
        """A stand-in for `server` in `add_*Servicer_to_server` calls; see HandlerRegistrar."""
        return HandlerRegistrar(server, self)

    def wrap(self, method: str, handler: Handler) -> Handler:
        """`handler` with auth, error mapping and metrics around it (built once per method)."""
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(method, handler)
        self._wrapped[method] = (handler, wrapped)
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
        stats: _MethodMetrics | _UncountedMethod,
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

    def _wrap(self, method: str, handler: Handler) -> Handler:
        service, name = _split(method)
        grpc_type = _grpc_type(handler)
        stats: _MethodMetrics | _UncountedMethod = (
            _MethodMetrics(self._metrics, grpc_type, service, name)
            if self._metrics is not None
            else _UncountedMethod()
        )
        check_auth = self._token_digest is not None and service not in AUTH_EXEMPT_SERVICES
        behaviour = (
            handler.unary_unary
            or handler.unary_stream
            or handler.stream_unary
            or handler.stream_stream
        )
        is_async = inspect.iscoroutinefunction(behaviour) or inspect.isasyncgenfunction(behaviour)
        if not is_async:
            return self._wrap_sync(handler, stats, check_auth)
        limit: Limit | None = self._limits.for_method(method) if self._limits else None
        semaphore = limit.semaphore if limit is not None else None

        if not handler.request_streaming and not handler.response_streaming:
            inner: Any = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                start = time.perf_counter()
                stats.started.inc()
                try:
                    if check_auth and not self._authorized(context):
                        raise UnauthenticatedError(DENY)
                    if type(request) is _Undecodable:
                        raise request.error
                    if semaphore is None:
                        response = await inner(request, context)
                    else:
                        if semaphore.locked():
                            await limit.wait_or_refuse(method)  # type: ignore[union-attr]
                        else:
                            await semaphore.acquire()  # free: returns without suspending
                        try:
                            response = await inner(request, context)
                        finally:
                            semaphore.release()
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
                request_deserializer=_tolerant(handler.request_deserializer),
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
            holder: SlotHolder | None = None
            try:
                if check_auth and not self._authorized(context):
                    raise UnauthenticatedError(DENY)
                if limit is not None:
                    # The slot is held until the stream ends, however it ends: the finally
                    # below, or the call's end where the generator is not closed yet.
                    await limit.acquire(method)
                    holder = SlotHolder(limit)
                    context.add_done_callback(holder.release)  # type: ignore[arg-type]  # stubs: a class, not a callable
                async for item in call(request, context):
                    yield item
            except asyncio.CancelledError:
                stats.handled(_CANCELLED, time.perf_counter() - start)
                raise
            except grpc.aio.AbortError:  # the handler aborted by itself
                stats.handled(_code_of(context), time.perf_counter() - start)
                raise
            except Exception as exc:
                if holder is not None:
                    holder.release()
                await self._abort(exc, context, stats, start)
            finally:
                if holder is not None:
                    holder.release()
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

    # -- handlers of a sync grpc.Server (run in its thread pool)

    def _wrap_sync(
        self, handler: Handler, stats: _MethodMetrics | _UncountedMethod, check_auth: bool
    ) -> Handler:
        """The same wrapper for a sync handler: errors end the call through the sync
        context's abort (which raises), Passthrough ends it with the status it carries."""
        request_streaming = handler.request_streaming
        response_streaming = handler.response_streaming
        original: Any = (
            handler.unary_unary
            or handler.unary_stream
            or handler.stream_unary
            or handler.stream_stream
        )
        authorized = self._authorized

        def fail(exc: Exception, context: Any, start: float) -> None:
            """Count and end the call for `exc`; always raises."""
            if isinstance(exc, Passthrough):
                stats.handled(exc.code.name, time.perf_counter() - start)
                context.set_trailing_metadata(exc.trailing)
                context.abort(exc.code, exc.details)
            code = context.code()
            if type(exc) is Exception and isinstance(code, grpc.StatusCode):
                stats.handled(code.name, time.perf_counter() - start)  # the handler aborted
                raise exc
            status = status_for(exc)
            name = _CODE_NAMES.get(status.code, "UNKNOWN")
            if name == "INTERNAL":
                log.error("unhandled error in an RPC", exc_info=exc)
            stats.handled(name, time.perf_counter() - start)
            context.abort_with_status(rpc_status.to_status(status))

        def counted(requests: Iterator[Any]) -> Iterator[Any]:
            for item in requests:
                stats.received.inc()
                yield item

        def begin(request: Any, context: Any) -> Any:
            stats.started.inc()
            if check_auth and not authorized(context):
                raise UnauthenticatedError(DENY)
            if request_streaming:
                return counted(request)
            stats.received.inc()
            if type(request) is _Undecodable:
                raise request.error
            return request

        if not response_streaming:

            def unary_response(request: Any, context: Any) -> Any:
                start = time.perf_counter()
                try:
                    response = original(begin(request, context), context)
                except Exception as exc:
                    fail(exc, context, start)
                stats.sent.inc()
                stats.handled(_OK, time.perf_counter() - start)
                return response

            factory = (
                grpc.stream_unary_rpc_method_handler
                if request_streaming
                else grpc.unary_unary_rpc_method_handler
            )
            return factory(
                unary_response,
                request_deserializer=(
                    handler.request_deserializer
                    if request_streaming
                    else _tolerant(handler.request_deserializer)
                ),
                response_serializer=handler.response_serializer,
            )

        def stream_response(request: Any, context: Any) -> Iterator[Any]:
            start = time.perf_counter()
            try:
                for item in original(begin(request, context), context):
                    stats.sent.inc()
                    yield item
            except GeneratorExit:  # the caller went away
                stats.handled(_CANCELLED, time.perf_counter() - start)
                raise
            except Exception as exc:
                fail(exc, context, start)
            stats.handled(_OK, time.perf_counter() - start)

        factory = (
            grpc.stream_stream_rpc_method_handler
            if request_streaming
            else grpc.unary_stream_rpc_method_handler
        )
        return factory(
            stream_response,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class Passthrough(Exception):  # noqa: N818 - a status to pass on, not an error of ours
    """End the call with exactly this status (what forward.py raises with the status the
    target answered): no mapping, counted under its own code."""

    def __init__(
        self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, Any], ...] = ()
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.trailing = trailing


class _WrappedGenericHandler(grpc.GenericRpcHandler):
    """A generic handler whose answers come wrapped (only found methods are remembered, so
    made-up method names cannot grow the cache)."""

    def __init__(self, inner: grpc.GenericRpcHandler, interceptor: ServerInterceptor) -> None:
        self._inner = inner
        self._interceptor = interceptor

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Handler | None:
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        return self._interceptor.wrap(handler_call_details.method, handler)


class HandlerRegistrar:
    """Stands in for a `grpc.aio.Server` in the generated `add_*Servicer_to_server`
    functions (and anything else that registers handlers), wrapping each handler on its way
    in. Registered (pre-resolved) methods are collected per service and handed over by
    `install()`, so a later registration of the same method replaces an earlier one (the
    servicer's bytes-level SelectBackend replaces the generated one) instead of registering
    the method with the core twice."""

    def __init__(
        self, server: grpc.aio.Server | grpc.Server, interceptor: ServerInterceptor
    ) -> None:
        self._server = server
        self._interceptor = interceptor
        self._registered: dict[str, dict[str, Handler]] = {}
        self._generic: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, Handler]) -> None:
        self._registered.setdefault(service, {}).update(handlers)

    def install(self, registered: Callable[[str], bool] = PRE_REGISTERED.__contains__) -> None:
        """Hand the collected methods to the server: those `registered(full_method)` accepts
        (by default the PRE_REGISTERED ones) as pre-registered methods, the rest through a
        generic handler that is asked before the generic handlers registered here (the
        generated code registers each method both ways; the registered form is the one that
        counts)."""
        generic: dict[str, Handler] = {}
        for service, handlers in self._registered.items():
            chosen: dict[str, Handler] = {}
            for name, handler in handlers.items():
                method = f"/{service}/{name}"
                wrapped = self._interceptor.wrap(method, handler)
                if registered(method):
                    chosen[name] = wrapped
                else:
                    generic[method] = wrapped
            if chosen:
                self._server.add_registered_method_handlers(service, chosen)
        wrapped_generic = [_WrappedGenericHandler(h, self._interceptor) for h in self._generic]
        self._server.add_generic_rpc_handlers((_ByMethod(generic), *wrapped_generic))
        self._registered.clear()
        self._generic.clear()


class _ByMethod(grpc.GenericRpcHandler):
    def __init__(self, handlers: dict[str, Handler]) -> None:
        self._handlers = handlers

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Handler | None:
        return self._handlers.get(handler_call_details.method)


def _code_of(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    return _CODE_NAMES.get(code, "UNKNOWN")
