"""What only the primary server process knows, as the door's listings read it: the workers,
their kept layers and the decisions vLLM processes reported.

Every server process serves the door (`--server-processes`), but only the primary owns the
pool and the store of observed decisions. So GET /v1/workers, /v1/layers and /v1/observed
read them through `PrimaryState`: in the primary, `LocalState` asks the pool and the store
(the very calls the servicer's ListWorkers, ListLayers and ListObservedDecisions make); in
a replica, `ForwardedState` makes those gRPC calls to the primary's private server, the one
its gRPC forwarder uses, and a failed call comes back as the primary's own
`google.rpc.Status` (`ForwardedStatusError`), so the answer is the same from any process.
Both return the gRPC messages; the handlers turn them into the CLI's JSON one way.
"""

from __future__ import annotations

from typing import Any, Protocol

import grpc
from google.rpc import status_pb2

from service.api.codecs.observed import listing_response
from service.api.codecs.workers import layers_response, workers_response
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import observed_pb2
from service.api.names import SERVICE_NAME
from service.dataplane.observed import Observations
from service.http.errors import ForwardedStatusError
from service.pool.errors import WorkerUnavailableError
from service.pool.pool import WorkerPool

#: The trailing metadata key that carries a gRPC status's `google.rpc.Status` details.
_STATUS_DETAILS = "grpc-status-details-bin"


class PrimaryState(Protocol):
    async def workers(self) -> pb.ListWorkersResponse: ...

    async def layers(self, worker_index: int | None) -> pb.ListLayersResponse: ...

    async def observed(
        self, mismatches_only: bool
    ) -> observed_pb2.ListObservedDecisionsResponse: ...


class LocalState:
    """The primary's own pool and store (None: this process has none)."""

    def __init__(self, pool: WorkerPool | None, observations: Observations | None) -> None:
        self._pool = pool
        self._observations = observations

    def _workers(self) -> WorkerPool:
        if self._pool is None:
            raise WorkerUnavailableError("this process has no workers")
        return self._pool

    async def workers(self) -> pb.ListWorkersResponse:
        pool = self._workers()
        return workers_response(await pool.describe(), pool.ready)

    async def layers(self, worker_index: int | None) -> pb.ListLayersResponse:
        return layers_response(await self._workers().list_layers(worker_index))

    async def observed(self, mismatches_only: bool) -> observed_pb2.ListObservedDecisionsResponse:
        store = self._observations
        if store is None:  # a door without a store has observed nothing
            return listing_response([], 0)
        return listing_response(store.listing(mismatches_only=mismatches_only), store.evicted)


def _status_of(error: grpc.aio.AioRpcError) -> status_pb2.Status:
    for key, value in error.trailing_metadata() or ():
        if key == _STATUS_DETAILS and isinstance(value, bytes):
            return status_pb2.Status.FromString(value)
    return status_pb2.Status(code=error.code().value[0], message=error.details() or "")


class ForwardedState:
    """The primary's state over its private server (`channel`), with the server's token
    (the door checked the caller's already)."""

    def __init__(self, channel: grpc.aio.Channel, token: str | None) -> None:
        self._metadata = () if token is None else (("authorization", f"Bearer {token}"),)
        self._list_workers = self._method(channel, "ListWorkers", pb.ListWorkersResponse)
        self._list_layers = self._method(channel, "ListLayers", pb.ListLayersResponse)
        self._list_observed = self._method(
            channel, "ListObservedDecisions", observed_pb2.ListObservedDecisionsResponse
        )

    @staticmethod
    def _method(channel: grpc.aio.Channel, name: str, response: Any) -> Any:
        return channel.unary_unary(
            f"/{SERVICE_NAME}/{name}",
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=response.FromString,
        )

    async def _call(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, metadata=self._metadata)
        except grpc.aio.AioRpcError as error:
            raise ForwardedStatusError(_status_of(error)) from None

    async def workers(self) -> pb.ListWorkersResponse:
        answer: pb.ListWorkersResponse = await self._call(
            self._list_workers, pb.ListWorkersRequest()
        )
        return answer

    async def layers(self, worker_index: int | None) -> pb.ListLayersResponse:
        request = pb.ListLayersRequest()
        if worker_index is not None:
            request.worker_index = worker_index
        answer: pb.ListLayersResponse = await self._call(self._list_layers, request)
        return answer

    async def observed(self, mismatches_only: bool) -> observed_pb2.ListObservedDecisionsResponse:
        request = observed_pb2.ListObservedDecisionsRequest(mismatches_only=mismatches_only)
        answer: observed_pb2.ListObservedDecisionsResponse = await self._call(
            self._list_observed, request
        )
        return answer
