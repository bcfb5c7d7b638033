"""Forwarding at the byte level (what a replica does for calls that need the workers):
every call shape, metadata, statuses with details, and a target that ends a client stream
early while the caller is still writing."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc

from service.server.forward import Forwarder, caller_metadata, service_methods

SERVICE = "t.Target"
DETAILS_KEY = "grpc-status-details-bin"


async def unary(request: bytes, context: Any) -> bytes:
    token = dict(context.invocation_metadata()).get("authorization", "")
    if request == b"fail":
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such thing", ((DETAILS_KEY, b"why"),))
    return b"u:" + request + b":" + token.encode()


async def server_stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
    for i in range(3):
        yield request + str(i).encode()


async def client_stream(requests: AsyncIterator[bytes], context: Any) -> bytes:
    seen = 0
    async for _ in requests:
        seen += 1
        if seen == 2:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "bad chunk", ((DETAILS_KEY, b"2"),)
            )
    return str(seen).encode()


async def bidi(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    seen = 0
    async for request in requests:
        seen += 1
        if seen == 2:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "bad chunk", ((DETAILS_KEY, b"2"),)
            )
        yield request[:4]


SHAPES = {
    "Unary": (False, False, grpc.unary_unary_rpc_method_handler(unary)),
    "ServerStream": (False, True, grpc.unary_stream_rpc_method_handler(server_stream)),
    "ClientStream": (True, False, grpc.stream_unary_rpc_method_handler(client_stream)),
    "Bidi": (True, True, grpc.stream_stream_rpc_method_handler(bidi)),
}


def chunks(count: int, size: int = 64 * 1024) -> Iterator[bytes]:
    for _ in range(count):
        yield b"x" * size


def drive(front: str) -> dict[str, Any]:
    """The caller: a plain (sync) client, as the CLI and the tests are."""
    out: dict[str, Any] = {}
    auth = (("authorization", "Bearer t"),)
    with grpc.insecure_channel(front) as channel:

        def path(name: str) -> str:
            return f"/{SERVICE}/{name}"

        out["unary"] = channel.unary_unary(path("Unary"))(b"hi", metadata=auth, timeout=5)
        try:
            channel.unary_unary(path("Unary"))(b"fail", timeout=5)
        except grpc.RpcError as error:
            call: Any = error
            out["fail"] = (call.code(), call.details(), dict(call.trailing_metadata()))
        out["stream"] = list(channel.unary_stream(path("ServerStream"))(b"s", timeout=5))
        out["client_one"] = channel.stream_unary(path("ClientStream"))(iter([b"a"]), timeout=5)
        codes: Counter[tuple[str, str]] = Counter()
        for name in ("ClientStream", "Bidi"):
            for _ in range(40):
                try:
                    if name == "Bidi":
                        list(channel.stream_stream(path(name))(chunks(64), timeout=10))
                    else:
                        channel.stream_unary(path(name))(chunks(64), timeout=10)
                except grpc.RpcError as error:
                    call = error
                    codes[(name, f"{call.code().name} {call.details()}")] += 1
        out["early_ends"] = codes
    return out


async def run() -> dict[str, Any]:
    target = grpc.aio.server()
    handlers = {name: handler for name, (_, _, handler) in SHAPES.items()}
    target.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    target_port = target.add_insecure_port("127.0.0.1:0")
    await target.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{target_port}")
    shapes = {f"/{SERVICE}/{name}": (rs, ss) for name, (rs, ss, _) in SHAPES.items()}
    front = grpc.aio.server()
    front.add_generic_rpc_handlers((Forwarder(channel, shapes),))
    front_port = front.add_insecure_port("127.0.0.1:0")
    await front.start()
    try:
        return await asyncio.to_thread(drive, f"127.0.0.1:{front_port}")
    finally:
        await front.stop(None)
        await channel.close()
        await target.stop(None)


def test_every_call_shape_statuses_and_early_ends_pass_through() -> None:
    out = asyncio.run(run())
    assert out["unary"] == b"u:hi:Bearer t"
    assert out["fail"] == (grpc.StatusCode.NOT_FOUND, "no such thing", {DETAILS_KEY: b"why"})
    assert out["stream"] == [b"s0", b"s1", b"s2"]
    assert out["client_one"] == b"1"
    # grpc.aio, as the forwarding client, turns about a third of these into INTERNAL
    # "Internal error from Core" when left to itself.
    assert out["early_ends"] == {
        ("ClientStream", "INVALID_ARGUMENT bad chunk"): 40,
        ("Bidi", "INVALID_ARGUMENT bad chunk"): 40,
    }


def test_only_the_callers_own_metadata_is_carried_on() -> None:
    class Context:
        def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
            return (
                (":authority", "x"),
                ("user-agent", "grpc-python"),
                ("grpc-accept-encoding", "gzip"),
                ("authorization", "Bearer t"),
                ("x-request-id", "7"),
            )

    assert caller_metadata(Context()) == (("authorization", "Bearer t"), ("x-request-id", "7"))  # type: ignore[arg-type]


def test_the_contract_methods_and_their_shapes() -> None:
    methods = service_methods(exclude=("SelectBackend", "ListPlatformPresets"))
    prefix = "/moe_control.v1.MoeControlService/"
    assert methods[prefix + "ConvertWeights"] == (True, True)
    assert methods[prefix + "ListWorkers"] == (False, False)
    assert prefix + "SelectBackend" not in methods


def test_a_replica_answers_the_oracle_reads_itself_and_forwards_the_rest() -> None:
    from service.server.front import LOCAL_METHODS

    forwarded = service_methods(exclude=LOCAL_METHODS)
    prefix = "/moe_control.v1.MoeControlService/"
    for local in ("SelectBackend", "ListPlatformPresets", "ListRulesets"):
        assert local in LOCAL_METHODS and prefix + local not in forwarded
    assert prefix + "ListWorkers" in forwarded and prefix + "ConvertWeights" in forwarded


def test_no_deadline_stays_no_deadline() -> None:
    from service.server.forward import remaining

    class Context:
        def __init__(self, left: float | None) -> None:
            self.left = left

        def time_remaining(self) -> float | None:
            return self.left

    assert remaining(Context(9.223372035058745e18)) is None  # a sync server's "none"
    assert remaining(Context(None)) is None  # grpc.aio's
    assert remaining(Context(4.5)) == 4.5
