"""The interceptor chain applied at registration: both dispatch routes, auth, error mapping
and metrics, on a real in-process grpc.aio server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from service.api.interceptors.chain import InterceptorChain
from service.metrics import Metrics
from service.oracle import InvalidSpecError

SERVICE = "test.Echo"


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def echo(request: bytes, context: Any) -> bytes:
    return b"echo:" + request


async def other(request: bytes, context: Any) -> bytes:
    return b"other:" + request


async def bad(request: bytes, context: Any) -> bytes:
    raise InvalidSpecError.single("layer.top_k", "required")


def unary(handler: Callable[..., Any]) -> grpc.RpcMethodHandler[Any, Any]:
    return grpc.unary_unary_rpc_method_handler(handler)


async def serve_and_call(
    *,
    registered: Callable[[str], bool],
    token: str | None = None,
    metadata: tuple[tuple[str, str], ...] = (),
) -> tuple[dict[str, Any], Metrics]:
    metrics = Metrics()
    server = grpc.aio.server()
    registrar = InterceptorChain(metrics, token=token).registrar(server)
    first = {"Echo": unary(echo), "Bad": unary(bad)}
    registrar.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, first),))
    registrar.add_registered_method_handlers(SERVICE, first)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), registrar)  # type: ignore[arg-type]
    registrar.install(registered)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    results: dict[str, Any] = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for method in ("Echo", "Bad", "Missing"):
                try:
                    call = channel.unary_unary(f"/{SERVICE}/{method}")
                    results[method] = await call(b"x", metadata=metadata, timeout=5)
                except grpc.aio.AioRpcError as error:
                    results[method] = error.code()
            check = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            results["health"] = check.status
    finally:
        await server.stop(None)
    return results, metrics


@pytest.mark.parametrize("route", ["registered", "generic"])
def test_every_call_is_wrapped_on_either_dispatch_route(route: str) -> None:
    results, metrics = asyncio.run(serve_and_call(registered=lambda method: route == "registered"))
    assert results["Echo"] == b"echo:x"
    assert results["Bad"] is grpc.StatusCode.INVALID_ARGUMENT
    assert results["Missing"] is grpc.StatusCode.UNIMPLEMENTED
    labels = {"grpc_type": "unary", "grpc_service": SERVICE}
    assert (
        sample(metrics, "grpc_server_handled_total", **labels, grpc_method="Echo", grpc_code="OK")
        == 1
    )
    assert (
        sample(
            metrics,
            "grpc_server_handled_total",
            **labels,
            grpc_method="Bad",
            grpc_code="INVALID_ARGUMENT",
        )
        == 1
    )


def test_a_token_guards_everything_but_health() -> None:
    results, metrics = asyncio.run(serve_and_call(registered=lambda method: True, token="s3"))
    unauthenticated = {"grpc_method": "Echo", "grpc_code": "UNAUTHENTICATED"}
    assert (
        sample(
            metrics,
            "grpc_server_handled_total",
            grpc_type="unary",
            grpc_service=SERVICE,
            **unauthenticated,
        )
        == 1
    )
    assert results["Echo"] is grpc.StatusCode.UNAUTHENTICATED
    assert results["health"] == health_pb2.HealthCheckResponse.SERVING
    ok, _ = asyncio.run(
        serve_and_call(
            registered=lambda method: True, token="s3", metadata=(("authorization", "Bearer s3"),)
        )
    )
    assert ok["Echo"] == b"echo:x"


def test_wrappers_are_built_once_per_handler_and_may_count_nothing() -> None:
    interceptor = InterceptorChain(None)  # the replicas' forwarding target counts nothing
    handler = unary(echo)
    wrapped = interceptor.wrap(f"/{SERVICE}/Echo", handler)
    assert interceptor.wrap(f"/{SERVICE}/Echo", handler) is wrapped
    assert interceptor.wrap(f"/{SERVICE}/Echo", unary(echo)) is not wrapped  # a new handler
    assert asyncio.run(wrapped.unary_unary(b"y", None)) == b"echo:y"


class RecordingServer:
    """A real grpc.aio server that remembers which methods were handed to it as
    pre-registered methods."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self.server = server
        self.pre_registered: list[str] = []

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        self.pre_registered += [f"/{service}/{name}" for name in handlers]
        self.server.add_registered_method_handlers(service, handlers)

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.server.add_generic_rpc_handlers(handlers)


async def serve_by_default_routes() -> tuple[list[str], dict[str, Any]]:
    service = "moe_control.v1.MoeControlService"
    recording = RecordingServer(grpc.aio.server())
    registrar = InterceptorChain(Metrics()).registrar(recording)  # type: ignore[arg-type]
    handlers = {"SelectBackend": unary(echo), "ListWorkers": unary(other)}
    registrar.add_registered_method_handlers(service, handlers)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), registrar)  # type: ignore[arg-type]
    registrar.install()
    port = recording.server.add_insecure_port("127.0.0.1:0")
    await recording.server.start()
    answers: dict[str, Any] = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for name in handlers:
                answers[name] = await channel.unary_unary(f"/{service}/{name}")(b"x", timeout=5)
            check = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            answers["health"] = check.status
    finally:
        await recording.server.stop(None)
    return recording.pre_registered, answers


def test_only_selectbackend_is_pre_registered_by_default_and_the_rest_still_answer() -> None:
    pre_registered, answers = asyncio.run(serve_by_default_routes())
    assert pre_registered == ["/moe_control.v1.MoeControlService/SelectBackend"]
    assert answers == {
        "SelectBackend": b"echo:x",
        "ListWorkers": b"other:x",
        "health": health_pb2.HealthCheckResponse.SERVING,
    }


async def chunks(requests: Any, context: Any) -> Any:
    async for item in requests:
        yield item
        yield item


async def sent_late() -> AsyncIterator[bytes]:
    """Two messages, sent once the server has had time to answer the call's start. A client
    write that races a server's early status makes gRPC core end the call INTERNAL ("Internal
    error from Core") now and then, whatever the handler did; a refused call's status must
    arrive first for the test to see it."""
    await asyncio.sleep(0.2)
    yield b"a"
    yield b"b"


async def serve_stream_and_undecodable(
    token: str | None, metadata: tuple[tuple[str, str], ...]
) -> tuple[dict[str, Any], Metrics]:
    from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb

    metrics = Metrics()
    server = grpc.aio.server()
    registrar = InterceptorChain(metrics, token=token).registrar(server)
    registrar.add_registered_method_handlers(
        SERVICE,
        {
            "Chunks": grpc.stream_stream_rpc_method_handler(chunks),
            "Parsed": grpc.unary_unary_rpc_method_handler(
                echo,
                request_deserializer=pb.ListWorkersRequest.FromString,
                response_serializer=lambda response: response,
            ),
        },
    )
    registrar.install(lambda method: False)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    results: dict[str, Any] = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                call = channel.stream_stream(f"/{SERVICE}/Chunks")
                results["Chunks"] = [
                    item async for item in call(sent_late(), metadata=metadata, timeout=5)
                ]
            except grpc.aio.AioRpcError as error:
                results["Chunks"] = error.code()
            try:
                parsed = channel.unary_unary(f"/{SERVICE}/Parsed")
                results["Parsed"] = await parsed(b"\xff\xff", metadata=metadata, timeout=5)
            except grpc.aio.AioRpcError as error:
                results["Parsed"] = (error.code(), error.details())
    finally:
        await server.stop(None)
    return results, metrics


def test_streams_count_their_messages_and_auth_comes_before_parsing() -> None:
    stream_labels = {"grpc_type": "bidi_stream", "grpc_service": SERVICE, "grpc_method": "Chunks"}
    results, metrics = asyncio.run(serve_stream_and_undecodable(None, ()))
    assert results["Chunks"] == [b"a", b"a", b"b", b"b"]
    assert sample(metrics, "grpc_server_msg_received_total", **stream_labels) == 2
    assert sample(metrics, "grpc_server_msg_sent_total", **stream_labels) == 4
    code, details = results["Parsed"]
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "cannot be parsed" in details

    refused, metrics = asyncio.run(serve_stream_and_undecodable("s3", ()))
    assert refused["Chunks"] is grpc.StatusCode.UNAUTHENTICATED
    assert refused["Parsed"][0] is grpc.StatusCode.UNAUTHENTICATED  # not a parse error
    assert sample(metrics, "grpc_server_msg_received_total", **stream_labels) == 0
    handled = {**stream_labels, "grpc_code": "UNAUTHENTICATED"}
    assert sample(metrics, "grpc_server_handled_total", **handled) == 1
