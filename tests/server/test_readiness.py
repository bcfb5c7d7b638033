"""Readiness follows the pool: SERVING while a worker is ready and the server is not
stopping; each change sets the worker gauges, counts restarts once each and sends the
replicas the workers' state (the message `WorkerView` reads)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from grpc_health.v1 import health, health_pb2

from service.api.names import SERVICE_NAME
from service.metrics import Metrics
from service.server.readiness import Readiness
from service.server.replica import WorkerView


@dataclass
class FakeWorker:
    index: int
    device: str
    ready: bool = False
    restarts: int = 0
    state: str = "starting"
    profile: Any = None


@dataclass
class FakePool:
    workers: list[FakeWorker]

    @property
    def ready(self) -> bool:
        return any(w.ready for w in self.workers)


@dataclass
class FakeReplicas:
    published: list[dict[str, Any]] = field(default_factory=list)

    def publish(self, state: dict[str, Any]) -> None:
        self.published.append(state)


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


async def readiness_through_a_restart() -> tuple[list[int], Metrics, FakeReplicas]:
    metrics = Metrics()
    servicer = health.aio.HealthServicer()
    readiness = Readiness(servicer, metrics)
    pool = FakePool([FakeWorker(0, "cpu"), FakeWorker(1, "cpu")])
    readiness.replicas = replicas = FakeReplicas()
    await readiness.start(pool)  # type: ignore[arg-type]
    statuses = []

    async def readiness_status() -> int:
        await asyncio.sleep(0)  # the health update runs as a task
        request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        return (await servicer.Check(request, None)).status  # type: ignore[arg-type]

    statuses.append(await readiness_status())
    first, second = pool.workers
    first.ready, first.state = True, "ready"
    readiness.worker_changed(first)  # type: ignore[arg-type]
    statuses.append(await readiness_status())
    first.ready, first.restarts, first.state = False, 2, "restarting"
    readiness.worker_changed(first)  # type: ignore[arg-type]
    readiness.worker_changed(first)  # type: ignore[arg-type]  # the same restarts again
    statuses.append(await readiness_status())
    first.ready = second.ready = True
    readiness.stopping = True
    readiness.worker_changed(second)  # type: ignore[arg-type]
    statuses.append(await readiness_status())
    return statuses, metrics, replicas


def test_readiness_follows_the_workers_and_tells_the_replicas() -> None:
    statuses, metrics, replicas = asyncio.run(readiness_through_a_restart())
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    assert statuses == [not_serving, serving, not_serving, not_serving]  # stopping: never
    labels = {"worker": "0", "device": "cpu"}
    assert sample(metrics, "moe_control_worker_restarts_total", **labels) == 2
    assert sample(metrics, "moe_control_worker_ready", **labels) == 0  # as last told
    assert sample(metrics, "moe_control_worker_ready", worker="1", device="cpu") == 1
    assert [state["ready"] for state in replicas.published] == [True, False, False, False]
    view = WorkerView()
    view.update(replicas.published[0])
    assert view.ready and view.generation == 1
    assert replicas.published[1]["workers"][0] == {
        "device": "cpu",
        "state": "restarting",
        "ready": False,
        "profile": None,
    }


def test_every_workers_series_exist_before_its_first_change() -> None:
    async def started() -> Metrics:
        metrics = Metrics()
        readiness = Readiness(health.aio.HealthServicer(), metrics)
        await readiness.start(FakePool([FakeWorker(0, "cpu"), FakeWorker(1, "cuda:0")]))  # type: ignore[arg-type]
        return metrics

    metrics = asyncio.run(started())
    for worker, device in (("0", "cpu"), ("1", "cuda:0")):
        # increase() sees a worker's first restart only when the series was there before it
        assert (
            sample(metrics, "moe_control_worker_restarts_total", worker=worker, device=device) == 0
        )
        assert sample(metrics, "moe_control_worker_ready", worker=worker, device=device) == 0
