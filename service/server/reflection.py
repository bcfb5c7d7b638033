"""Server reflection in both versions clients speak, from one implementation and one pool.

grpcio-reflection serves only `grpc.reflection.v1alpha`. Version 1 (`grpc.reflection.v1`,
generated from protos/grpc/) has the same messages with the same field numbers, so its
servicer converts each request to v1alpha through the wire form, lets grpcio-reflection's
servicer answer it, and converts each answer back: both versions list the same services and
read the same descriptor pool (protobuf's default one, where every generated module
registers itself).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any, cast

from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

from service.api.generated.grpc.reflection.v1 import reflection_pb2 as v1_pb2
from service.api.generated.grpc.reflection.v1 import reflection_pb2_grpc as v1_pb2_grpc

#: The full names of the two reflection services, from their descriptors.
V1_SERVICE_NAME: str = v1_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name
V1ALPHA_SERVICE_NAME: str = reflection.SERVICE_NAME
REFLECTION_SERVICES = (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)


class ReflectionV1Servicer(v1_pb2_grpc.ServerReflectionServicer):
    """`grpc.reflection.v1.ServerReflection`, answered by a v1alpha servicer."""

    def __init__(self, v1alpha: reflection.aio.ReflectionServicer) -> None:
        self._v1alpha = v1alpha

    async def ServerReflectionInfo(  # noqa: N802 (the generated method name)
        self, request_iterator: AsyncIterator[v1_pb2.ServerReflectionRequest], context: Any
    ) -> AsyncIterator[v1_pb2.ServerReflectionResponse]:
        async def as_v1alpha() -> AsyncIterator[v1alpha_pb2.ServerReflectionRequest]:
            async for request in request_iterator:
                yield v1alpha_pb2.ServerReflectionRequest.FromString(request.SerializeToString())

        # An async generator, which grpcio-reflection annotates as a coroutine's result.
        answers = cast(
            AsyncIterable[Any], self._v1alpha.ServerReflectionInfo(as_v1alpha(), context)
        )
        async for response in answers:
            yield v1_pb2.ServerReflectionResponse.FromString(response.SerializeToString())


def add_reflection(service_names: Iterable[str], server: Any) -> None:
    """Register both reflection services on `server` (a grpc.aio server or a registrar),
    listing `service_names` and the reflection services themselves."""
    v1alpha = reflection.aio.ReflectionServicer((*service_names, *REFLECTION_SERVICES))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(v1alpha, server)  # type: ignore[no-untyped-call]
    v1_pb2_grpc.add_ServerReflectionServicer_to_server(  # type: ignore[no-untyped-call]
        ReflectionV1Servicer(v1alpha), server
    )
