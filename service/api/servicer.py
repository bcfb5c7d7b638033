"""The MoeControlService servicer: each method is codec -> domain -> codec.

Errors are domain exceptions; the interceptor (interceptors.py) turns them into statuses.
"""

# ruff: noqa: N802 - method names are the contract's RPC names

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf import json_format

from service.api import codec
from service.api.convert import ConvertWeightsHandler
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc
from service.api.generated.moe_control.v1 import platform_pb2
from service.api.measured import MeasuredPolicy
from service.api.run_moe import RunMoEHandler
from service.api.selection import MIB, Selection
from service.metrics import Metrics
from service.pool.handle import WorkerSnapshot, WorkerState
from service.pool.pool import WorkerPool
from service.settings import Settings

Context = grpc.aio.ServicerContext[Any, Any]
SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["MoeControlService"].full_name

_STATES = {
    WorkerState.STARTING: platform_pb2.WORKER_STATE_STARTING,
    WorkerState.READY: platform_pb2.WORKER_STATE_READY,
    WorkerState.RESTARTING: platform_pb2.WORKER_STATE_RESTARTING,
    WorkerState.STOPPED: platform_pb2.WORKER_STATE_STOPPED,
}


def worker_to_pb(worker: WorkerSnapshot) -> platform_pb2.WorkerInfo:
    message = platform_pb2.WorkerInfo(
        index=worker.index,
        device=worker.device,
        state=_STATES[worker.state],
        pid=worker.pid,
        restarts=worker.restarts,
        device_name=worker.device_name,
        total_memory_bytes=worker.total_memory_bytes,
        torch_version=worker.torch_version,
        last_exit_reason=worker.last_exit_reason,
        layer_bytes=worker.layer_bytes,
        layer_budget_bytes=worker.layer_budget_bytes,
        layer_ids=list(worker.layer_ids),
    )
    if worker.profile is not None:
        message.platform.CopyFrom(codec.platform_to_pb(worker.profile))
    if worker.ready_time is not None:
        message.ready_time.FromNanoseconds(int(worker.ready_time * 1e9))
    return message


class MoeControlServicer(pb_grpc.MoeControlServiceServicer):
    def __init__(
        self, workers: WorkerPool, metrics: Metrics, settings: Settings | None = None
    ) -> None:
        self._workers = workers
        self._metrics = metrics
        settings = settings or Settings()
        workers.layer_budget_bytes = settings.layer_budget_mib * MIB
        self.selection = Selection(workers, metrics, cache_bytes=settings.select_cache_mib * MIB)
        self.selection.measured = MeasuredPolicy(workers, settings.state_dir)
        self.convert = ConvertWeightsHandler(workers, metrics, settings)
        self.run_moe = RunMoEHandler(workers, metrics, settings, self.convert.segments)

    async def SelectBackend(
        self, request: pb.SelectBackendRequest, context: Context
    ) -> pb.SelectBackendResponse:
        return await self.selection.answer_async(request)

    async def ConvertWeights(
        self, request_iterator: AsyncIterator[pb.ConvertWeightsRequest], context: Context
    ) -> AsyncIterator[pb.ConvertWeightsResponse]:
        async for response in self.convert(request_iterator, context):
            yield response

    async def RunMoE(self, request: pb.RunMoERequest, context: Context) -> pb.RunMoEResponse:
        return await self.run_moe(request)

    async def run_moe_bytes(self, request: pb.RunMoERequest, context: Context) -> bytes:
        """RunMoE as registered: the reply serialized by hand from the output's segment
        (RunMoEHandler.answer_bytes), sparing whole copies of the output."""
        return await self.run_moe.answer_bytes(request)

    async def GetPlatform(
        self, request: pb.GetPlatformRequest, context: Context
    ) -> pb.GetPlatformResponse:
        index = request.worker_index if request.HasField("worker_index") else 0
        worker = self._workers.worker(index).snapshot()
        return pb.GetPlatformResponse(worker=worker_to_pb(worker))

    async def ListPlatformPresets(
        self, request: pb.ListPlatformPresetsRequest, context: Context
    ) -> pb.ListPlatformPresetsResponse:
        return self.selection.presets

    async def ListWorkers(
        self, request: pb.ListWorkersRequest, context: Context
    ) -> pb.ListWorkersResponse:
        workers = [worker_to_pb(w) for w in await self._workers.describe()]
        return pb.ListWorkersResponse(
            workers=workers,
            ready=self._workers.ready,
            ready_workers=sum(w.state == platform_pb2.WORKER_STATE_READY for w in workers),
        )

    async def ListLayers(
        self, request: pb.ListLayersRequest, context: Context
    ) -> pb.ListLayersResponse:
        index = request.worker_index if request.HasField("worker_index") else None
        layers = await self._workers.list_layers(index)
        return pb.ListLayersResponse(
            layers=[json_format.ParseDict(layer, pb.LayerInfo()) for layer in layers]
        )

    async def UnloadLayer(
        self, request: pb.UnloadLayerRequest, context: Context
    ) -> pb.UnloadLayerResponse:
        freed = await self._workers.unload_layer(request.layer_id)
        return pb.UnloadLayerResponse(freed_bytes=freed)


def add_to_server(servicer: MoeControlServicer, server: Any) -> None:
    """Register the service on `server` (a grpc.aio server, or a HandlerRegistrar in front
    of one). This is the primary's private server; the public fronts serve SelectBackend
    and the preset list themselves (front.py)."""
    pb_grpc.add_MoeControlServiceServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    # Replaces the generated RunMoE (a later registration wins: HandlerRegistrar): the
    # handler answers with the reply's bytes, which go out as they are.
    server.add_registered_method_handlers(
        SERVICE_NAME,
        {
            "RunMoE": grpc.unary_unary_rpc_method_handler(
                servicer.run_moe_bytes,
                request_deserializer=pb.RunMoERequest.FromString,
                response_serializer=_as_bytes,
            )
        },
    )


def _as_bytes(reply: bytes) -> bytes:
    """The serializer of a handler that serializes its replies itself."""
    return reply
