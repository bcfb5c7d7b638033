"""The primary's view of its workers, told to everyone who needs it on every change.

Readiness (the service's name in grpc.health.v1) is SERVING while at least one worker is
ready (a node keeps serving on its healthy GPUs while one worker restarts:
`WorkerPool.ready`) and the server is not stopping. Each change also sets the workers'
gauges, counts their restarts and, with replicas, sends them the new state.
"""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health, health_pb2

from service.api.names import SERVICE_NAME
from service.metrics import Metrics
from service.pool.handle import WorkerHandle
from service.pool.pool import WorkerPool
from service.server.replica import ReplicaSet, workers_state

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Readiness:
    """The health servicer, the worker metrics and the replicas, kept up with the pool."""

    def __init__(self, health_servicer: health.aio.HealthServicer, metrics: Metrics) -> None:
        self.health = health_servicer
        self.metrics = metrics
        self.pool: WorkerPool | None = None
        self.replicas: ReplicaSet | None = None
        self.stopping = False
        #: Set the first time the server is ready (what `moe-control serve` announces).
        self.became_ready = asyncio.Event()
        self._restarts_counted: dict[int, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, pool: WorkerPool) -> None:
        """Alive and not ready yet, every worker's series created (not ready, no restarts),
        until the pool says more."""
        self.pool = pool
        self.metrics.prepare_workers((worker.index, worker.device) for worker in pool.workers)
        await self.health.set(health.OVERALL_HEALTH, SERVING)
        await self.health.set(SERVICE_NAME, NOT_SERVING)

    @property
    def ready(self) -> bool:
        return self.pool is not None and self.pool.ready and not self.stopping

    def publish(self) -> None:
        """Send the replicas (if any) the workers' state."""
        if self.replicas is not None:
            workers = [] if self.pool is None else self.pool.workers
            self.replicas.publish(workers_state(workers, ready=self.ready))

    def worker_changed(self, worker: WorkerHandle) -> None:
        """The pool's `on_change`: a worker started, stopped, died or restarted."""
        self.metrics.set_worker_ready(worker.index, worker.device, worker.ready)
        counted = self._restarts_counted.get(worker.index, 0)
        for _ in range(worker.restarts - counted):
            self.metrics.count_worker_restart(worker.index, worker.device)
        self._restarts_counted[worker.index] = worker.restarts
        self.publish()
        if self.ready:
            self.became_ready.set()
        task = asyncio.create_task(
            self.health.set(SERVICE_NAME, SERVING if self.ready else NOT_SERVING)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
