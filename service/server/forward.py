"""Forward calls to another server at the byte level: how a replica server process
(replica.py) serves the methods that need the workers, which only the primary process owns.

Messages are passed through as bytes (no parsing on the way), in all four call shapes, with
the caller's metadata (the bearer token included) and remaining deadline; the target's
status, message and trailing metadata (the `google.rpc.Status` details) come back as they
were, so a client cannot tell which process it reached. grpc.aio's client can lose the
target's status of a client stream that the target ends early (`_FirstStatus`). A
replica's MEASURED selections go the same way (`ForwardedMeasure`): the primary has the
workers and the timing cache.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc

from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.names import method_path

#: Metadata the transport sets by itself (forwarding it is refused or wrong).
_TRANSPORT_KEYS = frozenset({"user-agent", "te", "content-type", "host"})

Context = grpc.aio.ServicerContext[Any, Any]


def caller_metadata(context: Context) -> tuple[tuple[str, str | bytes], ...]:
    """The invocation metadata a forwarded call carries on: the caller's own keys."""
    return tuple(
        (key, value)
        for key, value in context.invocation_metadata() or ()
        if not key.startswith((":", "grpc-")) and key not in _TRANSPORT_KEYS
    )


#: A deadline further out than this is no deadline (grpc's sync server reports about 2**63
#: seconds for a call without one; passed on as a timeout, that overflows into the past).
_FOREVER_S = 1e9


def remaining(context: Any) -> float | None:
    """The caller's remaining deadline, as a timeout to pass on (None: it set none)."""
    left = context.time_remaining()
    return None if left is None or left > _FOREVER_S else float(left)


def service_methods(
    service: str = "MoeControlService", *, exclude: Iterable[str] = ()
) -> dict[str, tuple[bool, bool]]:
    """'/pkg.Service/Method' -> (request_streaming, response_streaming), from the contract."""
    descriptor = pb.DESCRIPTOR.services_by_name[service]
    skip = set(exclude)
    return {
        f"/{descriptor.full_name}/{method.name}": (method.client_streaming, method.server_streaming)
        for method in descriptor.methods
        if method.name not in skip
    }


#: What grpc.aio reports when a client write loses the race with the target ending the call.
_LOST_RACE = "Internal error from Core"
#: How long to wait for the target's status to replace that report.
_RACE_WAIT_S = 1.0


class _FirstStatus:
    """The first status an outgoing call got: the target's.

    A client-streaming call that the target ends early (a bad chunk: INVALID_ARGUMENT) can
    still have a write of ours in flight; grpc.aio fails that write and then overwrites the
    call's status with INTERNAL "Internal error from Core" (for many such calls: bench/RESULTS.md,
    tests/server/test_forward.py). Which comes first varies: when the target's status came
    first, a done callback (run once, at the first status) has kept it; when the failed
    write came first, the target's status replaces it on arrival, and `abort_like` waits
    for that. The status accessors are coroutines that finish at once when the status is
    there; the callback runs them to completion on the spot."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.value: tuple[grpc.StatusCode, str, tuple[Any, ...]] | None = None
        call.add_done_callback(self._done)

    def _done(self, call: Any) -> None:
        with contextlib.suppress(_NotReadyError):
            code = _finish(call.code())
            details = _finish(call.details())
            trailing = _finish(call.trailing_metadata())
            self.value = (code, details or "", tuple(trailing or ()))


class _NotReadyError(Exception):
    pass


def _finish(coroutine: Any) -> Any:
    """The result of a coroutine that completes without waiting (else _NotReadyError)."""
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return stop.value
    coroutine.close()
    raise _NotReadyError


async def abort_like(
    error: grpc.aio.AioRpcError, context: Context, first: _FirstStatus | None = None
) -> None:
    """End the call with the target's status, message and trailing metadata."""
    code, details = error.code(), error.details() or ""
    trailing = tuple(error.trailing_metadata() or ())
    if first is not None:
        if first.value is not None and first.value[1] != _LOST_RACE:
            code, details, trailing = first.value
        elif code is grpc.StatusCode.INTERNAL and details == _LOST_RACE:
            # The write failed first; the target's status replaces that report on arrival.
            code, details, trailing = await _replacement(first.call, code, details, trailing)
    await context.abort(code, details, trailing)


async def _replacement(
    call: Any, code: grpc.StatusCode, details: str, trailing: tuple[Any, ...]
) -> tuple[grpc.StatusCode, str, tuple[Any, ...]]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _RACE_WAIT_S
    while loop.time() < deadline:
        await asyncio.sleep(0.002)
        if await call.details() != _LOST_RACE:
            return await call.code(), await call.details(), tuple(await call.trailing_metadata())
    return code, details, trailing


class Forwarder(grpc.GenericRpcHandler):
    """A generic handler answering `methods` by calling the same method on `channel`."""

    def __init__(self, channel: grpc.aio.Channel, methods: dict[str, tuple[bool, bool]]) -> None:
        self._channel = channel
        self._handlers = {
            method: self._handler(method, *shape) for method, shape in methods.items()
        }

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        return self._handlers.get(handler_call_details.method)

    def _handler(
        self, method: str, request_streaming: bool, response_streaming: bool
    ) -> grpc.RpcMethodHandler[Any, Any]:
        channel = self._channel
        if not request_streaming and not response_streaming:
            unary: Any = channel.unary_unary(method)

            async def unary_unary(request: bytes, context: Context) -> bytes:
                try:
                    response: bytes = await unary(
                        request,
                        metadata=caller_metadata(context),
                        timeout=remaining(context),
                    )
                except grpc.aio.AioRpcError as error:
                    await abort_like(error, context)
                    raise  # abort raised already; this keeps the type checker informed
                return response

            return grpc.unary_unary_rpc_method_handler(unary_unary)

        if not request_streaming:
            server_stream: Any = channel.unary_stream(method)

            async def unary_stream(request: bytes, context: Context) -> AsyncIterator[bytes]:
                call = server_stream(
                    request, metadata=caller_metadata(context), timeout=remaining(context)
                )
                try:
                    async for item in call:
                        yield item
                except grpc.aio.AioRpcError as error:
                    await abort_like(error, context)
                finally:
                    call.cancel()

            return grpc.unary_stream_rpc_method_handler(unary_stream)

        if not response_streaming:
            client_stream: Any = channel.stream_unary(method)

            async def stream_unary(requests: AsyncIterator[bytes], context: Context) -> bytes:
                call = client_stream(
                    requests, metadata=caller_metadata(context), timeout=remaining(context)
                )
                first = _FirstStatus(call)
                try:
                    response: bytes = await call
                except grpc.aio.AioRpcError as error:
                    await abort_like(error, context, first)
                    raise
                finally:
                    call.cancel()
                return response

            return grpc.stream_unary_rpc_method_handler(stream_unary)

        bidi: Any = channel.stream_stream(method)

        async def stream_stream(
            requests: AsyncIterator[bytes], context: Context
        ) -> AsyncIterator[bytes]:
            call = bidi(requests, metadata=caller_metadata(context), timeout=remaining(context))
            first = _FirstStatus(call)
            try:
                async for item in call:
                    yield item
            except grpc.aio.AioRpcError as error:
                await abort_like(error, context, first)
            finally:
                call.cancel()

        return grpc.stream_stream_rpc_method_handler(stream_stream)


class ForwardedMeasure:
    """A replica's MEASURED answers: the primary's, over the private socket (the primary
    has the workers and the cache)."""

    METHOD = method_path("SelectBackend")

    def __init__(self, channel: Any) -> None:
        self._call = channel.unary_unary(self.METHOD)

    async def answer_bytes(
        self, data: bytes, request: pb.SelectBackendRequest, context: Any
    ) -> bytes:
        try:
            payload: bytes = await self._call(
                data, metadata=caller_metadata(context), timeout=remaining(context)
            )
        except grpc.aio.AioRpcError as error:
            await abort_like(error, context)
            raise
        return payload
