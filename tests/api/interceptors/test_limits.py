"""Per-method concurrency limits (limits.py) through the interceptor, on a real in-process
grpc.aio server on loopback whose handlers of the real method names block until released:
each limit refuses the call over it with RESOURCE_EXHAUSTED and details naming the method
and the limit, leaves other methods and health alone, and gives every slot back after
completion, errors, cancellation and deadlines."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from service.api.interceptors.chain import InterceptorChain
from service.api.interceptors.limits import SERVICE, Limits
from service.metrics import Metrics
from service.settings import Settings

LIMITS = {"SelectBackend": 3, "RunMoE": 2, "ConvertWeights": 2}


class Blocking:
    """Handlers that hold their call until `gate` opens (and count who is inside)."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.inside = 0

    async def unary(self, request: bytes, context: Any) -> bytes:
        self.inside += 1
        try:
            await self.gate.wait()
        finally:
            self.inside -= 1
        if request == b"fail":
            raise ValueError("a handler error still gives the slot back")
        return b"ok"

    async def stream(self, requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        self.inside += 1
        try:
            async for item in requests:
                yield item
        finally:
            self.inside -= 1

    async def other(self, request: bytes, context: Any) -> bytes:
        return b"other"


class Harness:
    def __init__(self, wait_s: float = 0.0) -> None:
        self.metrics = Metrics()
        settings = Settings(
            max_concurrent_select=LIMITS["SelectBackend"],
            max_concurrent_run=LIMITS["RunMoE"],
            max_concurrent_convert=LIMITS["ConvertWeights"],
            concurrency_wait_s=wait_s,
        )
        self.limits = Limits.from_settings(settings, self.metrics)
        self.handlers = Blocking()

    async def __aenter__(self) -> Harness:
        self.server = grpc.aio.server()
        registrar = InterceptorChain(self.metrics, limits=self.limits).registrar(self.server)
        h = self.handlers
        registrar.add_registered_method_handlers(
            SERVICE,
            {
                "SelectBackend": grpc.unary_unary_rpc_method_handler(h.unary),
                "RunMoE": grpc.unary_unary_rpc_method_handler(h.unary),
                "ConvertWeights": grpc.stream_stream_rpc_method_handler(h.stream),
                "ListWorkers": grpc.unary_unary_rpc_method_handler(h.other),
            },
        )
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), registrar)  # type: ignore[arg-type]
        registrar.install()
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close()
        await self.server.stop(None)

    def unary(self, method: str) -> Any:
        return self.channel.unary_unary(f"/{SERVICE}/{method}")

    def stream(self) -> Any:
        return self.channel.stream_stream(f"/{SERVICE}/ConvertWeights")

    def available(self, method: str) -> int:
        limit = self.limits.for_method(f"/{SERVICE}/{method}")
        assert limit is not None
        return limit.available

    async def settle(self, predicate: Any) -> None:
        for _ in range(200):
            if predicate():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the server did not get there")

    def refused(self, method: str, limit: str) -> float:
        value = self.metrics.registry.get_sample_value(
            "moe_control_rpc_limited_total", {"grpc_method": method, "limit": limit}
        )
        return value or 0.0


def assert_limited(error: grpc.aio.AioRpcError, method: str, limit: str, value: int) -> None:
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, error
    assert limit in (error.details() or "")
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    found: dict[str, Any] = {}
    for packed in status.details:
        for kind in (error_details_pb2.QuotaFailure, error_details_pb2.ErrorInfo):
            if packed.Is(kind.DESCRIPTOR):
                message = kind()
                packed.Unpack(message)
                found[kind.__name__] = message
    quota = found["QuotaFailure"].violations[0]
    assert quota.subject == f"/{SERVICE}/{method}"
    info = found["ErrorInfo"]
    assert info.reason == "CONCURRENCY_LIMIT"
    assert dict(info.metadata) == {
        "method": f"/{SERVICE}/{method}",
        "limit": limit,
        "value": str(value),
    }


SETTING = {
    "SelectBackend": "max_concurrent_select",
    "RunMoE": "max_concurrent_run",
}


@pytest.mark.parametrize("method", ["SelectBackend", "RunMoE"])
def test_a_unary_limit_refuses_one_over_and_leaves_the_rest_alone(method: str) -> None:
    async def scenario() -> None:
        async with Harness() as h:
            limit = LIMITS[method]
            held = [asyncio.ensure_future(h.unary(method)(b"x", timeout=10)) for _ in range(limit)]
            await h.settle(lambda: h.handlers.inside == limit)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await h.unary(method)(b"x", timeout=5)
            assert_limited(refused.value, method, SETTING[method], limit)
            assert h.refused(method, SETTING[method]) == 1
            # Other methods, the other limited class and health are untouched.
            other = "RunMoE" if method == "SelectBackend" else "SelectBackend"
            assert h.available(other) == LIMITS[other]
            assert await h.unary("ListWorkers")(b"x", timeout=5) == b"other"
            check = await health_pb2_grpc.HealthStub(h.channel).Check(  # type: ignore[no-untyped-call]
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert check.status == health_pb2.HealthCheckResponse.SERVING
            h.handlers.gate.set()
            assert await asyncio.gather(*held) == [b"ok"] * limit
            assert h.available(method) == limit
            # Completed, failed and deadline-cut calls all give their slot back.
            assert await h.unary(method)(b"x", timeout=5) == b"ok"
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await h.unary(method)(b"fail", timeout=5)
            assert failed.value.code() is grpc.StatusCode.INTERNAL
            h.handlers.gate.clear()
            cut = [h.unary(method)(b"x", timeout=0.3) for _ in range(limit)]
            for outcome in await asyncio.gather(*cut, return_exceptions=True):
                assert isinstance(outcome, grpc.aio.AioRpcError)
                assert outcome.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            await h.settle(lambda: h.handlers.inside == 0)
            await h.settle(lambda: h.available(method) == limit)

    asyncio.run(scenario())


def test_streams_hold_their_slot_until_they_end_and_cancellation_leaks_none() -> None:
    async def scenario() -> None:
        async with Harness() as h:
            limit = LIMITS["ConvertWeights"]
            # 50 rounds of: fill the limit, be refused one over, cancel every stream.
            for _ in range(25):
                calls = [h.stream()() for _ in range(limit)]
                for call in calls:
                    await call.write(b"chunk")
                    assert await call.read() == b"chunk"
                over = h.stream()()
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await over.read()
                assert_limited(refused.value, "ConvertWeights", "max_concurrent_convert", limit)
                # A unary class is unaffected by the full stream class.
                h.handlers.gate.set()
                assert await h.unary("SelectBackend")(b"x", timeout=5) == b"ok"
                h.handlers.gate.clear()
                for call in calls:
                    call.cancel()
                await h.settle(lambda: h.available("ConvertWeights") == limit)
            assert h.refused("ConvertWeights", "max_concurrent_convert") == 25
            # After 50 cancelled streams the full limit is there again, and a stream that
            # ends normally gives its slot back too.
            calls = [h.stream()() for _ in range(limit)]
            for call in calls:
                await call.write(b"again")
                assert await call.read() == b"again"
                await call.done_writing()
            for call in calls:
                assert await call.code() is grpc.StatusCode.OK
            await h.settle(lambda: h.available("ConvertWeights") == limit)
            # Streams cut by their deadline give their slots back as well.
            cut = [h.stream()(timeout=0.3) for _ in range(limit)]
            for call in cut:
                assert await call.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            await h.settle(lambda: h.available("ConvertWeights") == limit)

    asyncio.run(scenario())


def test_a_short_wait_takes_a_slot_freed_in_time() -> None:
    async def scenario() -> None:
        async with Harness(wait_s=2.0) as h:
            limit = LIMITS["RunMoE"]
            held = [
                asyncio.ensure_future(h.unary("RunMoE")(b"x", timeout=10)) for _ in range(limit)
            ]
            await h.settle(lambda: h.handlers.inside == limit)
            waiting = asyncio.ensure_future(h.unary("RunMoE")(b"x", timeout=10))
            await asyncio.sleep(0.2)
            assert not waiting.done()
            h.handlers.gate.set()
            assert await waiting == b"ok"
            await asyncio.gather(*held)
            assert h.refused("RunMoE", "max_concurrent_run") == 0
            assert h.available("RunMoE") == limit

    asyncio.run(scenario())


def test_zero_means_no_limit_and_health_is_never_limited() -> None:
    limits = Limits.from_settings(
        Settings(max_concurrent_select=0, max_concurrent_run=0, max_concurrent_convert=0), None
    )
    assert limits.by_method == {}
    default = Limits.from_settings(Settings(), None)
    assert default.for_method("/grpc.health.v1.Health/Check") is None
    assert default.for_method(f"/{SERVICE}/ListWorkers") is None
    assert default.for_method(f"/{SERVICE}/ConvertWeights") is not None
