"""Errors -> statuses: a handler's domain error ends its call with the status (code,
message, `google.rpc.Status` details) that the table in `service.api.errors` gives it;
anything the table does not know is INTERNAL, logged in full. A handler that aborted by
itself keeps its own status.

A unary request whose bytes are not its method's message would otherwise be answered by
grpc itself (UNKNOWN) before any handler ran; this interceptor's deserializer lets it
through and answers INVALID_ARGUMENT naming the field "request" instead, after auth.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError
from google.rpc import code_pb2
from grpc_status import rpc_status

from service.api.errors import status_for
from service.api.interceptors.handlers import Context, Method, Stream, Unary
from service.formats.errors import ConvertInputError

log = logging.getLogger("moe_control.api")


class _Undecodable:
    """What a unary request that is not its method's protobuf deserializes to."""

    def __init__(self, error: DecodeError) -> None:
        self.error = ConvertInputError("request", f"cannot be parsed: {error}")


async def abort_for(exc: Exception, context: Context) -> NoReturn:
    """End the call with the status `exc` maps to (raises grpc.aio.AbortError)."""
    status = status_for(exc)
    if status.code == code_pb2.INTERNAL:
        log.error("unhandled error in an RPC", exc_info=exc)
    await context.abort_with_status(rpc_status.to_status(status))
    raise AssertionError("abort returned")  # pragma: no cover - abort always raises


class ErrorStatus:
    """Maps the errors raised inside it (auth is outside: it answers by itself)."""

    @staticmethod
    def request_deserializer(
        deserializer: Callable[[bytes], Any] | None,
    ) -> Callable[[bytes], Any] | None:
        """A unary method's deserializer that hands undecodable bytes on as such."""
        if deserializer is None:
            return None

        def deserialize(data: bytes) -> Any:
            try:
                return deserializer(data)
            except DecodeError as exc:
                return _Undecodable(exc)

        return deserialize

    def unary(self, method: Method, inner: Unary) -> Unary:
        async def mapped(request: Any, context: Context) -> Any:
            try:
                if type(request) is _Undecodable:
                    raise request.error
                return await inner(request, context)
            except grpc.aio.AbortError:  # the handler aborted by itself
                raise
            except Exception as exc:
                await abort_for(exc, context)

        return mapped

    def stream(self, method: Method, inner: Stream) -> Stream:
        async def mapped(request: Any, context: Context) -> AsyncIterator[Any]:
            try:
                async for item in inner(request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await abort_for(exc, context)

        return mapped
