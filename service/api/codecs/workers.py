"""The workers' and kept layers' messages: WorkerInfo from the pool's snapshots, LayerInfo
from the workers' layer descriptions."""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from service.api.codecs.selection import platform_to_pb
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import platform_pb2
from service.pool.handle import WorkerSnapshot, WorkerState

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
        message.platform.CopyFrom(platform_to_pb(worker.profile))
    if worker.ready_time is not None:
        message.ready_time.FromNanoseconds(int(worker.ready_time * 1e9))
    return message


def workers_response(workers: list[WorkerSnapshot], ready: bool) -> pb.ListWorkersResponse:
    infos = [worker_to_pb(w) for w in workers]
    return pb.ListWorkersResponse(
        workers=infos,
        ready=ready,
        ready_workers=sum(w.state == platform_pb2.WORKER_STATE_READY for w in infos),
    )


def layers_response(layers: list[dict[str, Any]]) -> pb.ListLayersResponse:
    return pb.ListLayersResponse(
        layers=[json_format.ParseDict(layer, pb.LayerInfo()) for layer in layers]
    )
