"""Forward calls to another server at the byte level: how the front server of each process
(front.py) serves the methods that need the workers, which only the primary process's
grpc.aio server owns (on a private Unix socket).

Messages pass through as bytes (no parsing on the way), in all four call shapes, with the
caller's metadata (the bearer token included) and remaining deadline; the target's status,
message and trailing metadata (the `google.rpc.Status` details) come back as they were
(`Passthrough`), so a client cannot tell which process it reached. Handlers run in the
front's threads with the sync client: unlike grpc.aio's client, it reports the target's
status when the target ends a client stream early while a write is in flight (grpc.aio
reports INTERNAL "Internal error from Core" for a third of those; tests/api/test_forward.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import grpc

from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.interceptors import Passthrough

#: Metadata the transport sets by itself (forwarding it is refused or wrong).
_TRANSPORT_KEYS = frozenset({"user-agent", "te", "content-type", "host"})


def caller_metadata(context: Any) -> tuple[tuple[str, str | bytes], ...]:
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


def _passthrough(error: grpc.RpcError) -> Passthrough:
    call: Any = error  # a grpc.Call as well
    return Passthrough(call.code(), call.details() or "", tuple(call.trailing_metadata() or ()))


class Forwarder(grpc.GenericRpcHandler):
    """A generic handler answering `methods` by calling the same method on `channel`."""

    def __init__(self, channel: grpc.Channel, methods: dict[str, tuple[bool, bool]]) -> None:
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
        if not response_streaming:
            unary: Any = (
                channel.stream_unary(method) if request_streaming else channel.unary_unary(method)
            )

            def unary_response(request: Any, context: Any) -> bytes:
                future = unary.future(
                    request, metadata=caller_metadata(context), timeout=remaining(context)
                )
                context.add_callback(future.cancel)  # the caller went away: so does the call
                try:
                    response: bytes = future.result()
                except grpc.RpcError as error:
                    raise _passthrough(error) from None
                return response

            factory = (
                grpc.stream_unary_rpc_method_handler
                if request_streaming
                else grpc.unary_unary_rpc_method_handler
            )
            return factory(unary_response)

        streaming: Any = (
            channel.stream_stream(method) if request_streaming else channel.unary_stream(method)
        )

        def stream_response(request: Any, context: Any) -> Iterator[bytes]:
            call = streaming(request, metadata=caller_metadata(context), timeout=remaining(context))
            context.add_callback(call.cancel)
            try:
                yield from call
            except grpc.RpcError as error:
                raise _passthrough(error) from None

        factory = (
            grpc.stream_stream_rpc_method_handler
            if request_streaming
            else grpc.unary_stream_rpc_method_handler
        )
        return factory(stream_response)
