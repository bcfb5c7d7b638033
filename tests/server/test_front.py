"""The public server's registrations: every method it serves is on /metrics from the start,
under every status code, and reflection answers in v1 as in v1alpha from the same pool."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as v1alpha_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from service.api.generated.grpc.reflection.v1 import reflection_pb2 as v1_pb2
from service.api.generated.grpc.reflection.v1 import reflection_pb2_grpc as v1_pb2_grpc
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.interceptors.metrics import CODES
from service.api.names import SERVICE_NAME
from service.api.servicer import MoeControlServicer
from service.metrics import Metrics
from service.server.front import start_front
from service.server.reflection import REFLECTION_SERVICES
from service.settings import Settings


class Pool:
    """Enough of a WorkerPool for registration: no worker is ever asked anything."""

    generation = 0
    layer_budget_bytes = 0
    workers: tuple[Any, ...] = ()

    def default_profile(self) -> Any:
        return None


def served_methods() -> dict[str, list[str]]:
    """Every service the front serves, with its methods, from the services' descriptors."""
    descriptors = [
        pb.DESCRIPTOR.services_by_name["MoeControlService"],
        v1_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
        v1alpha_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
    ]
    methods = {d.full_name: [m.name for m in d.methods] for d in descriptors}
    methods[health.SERVICE_NAME] = ["Check", "Watch"]
    return methods


async def front_session() -> tuple[Metrics, str, dict[str, set[str]]]:
    metrics = Metrics()
    servicer = MoeControlServicer(Pool(), metrics)  # type: ignore[arg-type]
    front = await start_front(
        Settings(host="127.0.0.1"),
        port=0,
        metrics=metrics,
        selection=servicer.selection,
        health_servicer=health.aio.HealthServicer(),
        worker_methods=lambda registrar: registrar.add_registered_method_handlers(
            SERVICE_NAME, servicer.worker_handlers()
        ),
        reuseport=False,
    )
    exposition = metrics.exposition().decode()  # before any call
    listed: dict[str, set[str]] = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{front.port}") as channel:
            for version, stub, request in (
                ("v1", v1_pb2_grpc.ServerReflectionStub(channel), v1_pb2.ServerReflectionRequest),
                (
                    "v1alpha",
                    v1alpha_pb2_grpc.ServerReflectionStub(channel),
                    v1alpha_pb2.ServerReflectionRequest,
                ),
            ):
                call = stub.ServerReflectionInfo(iter([request(list_services="")]), timeout=5)
                listed[version] = {
                    service.name
                    async for answer in call
                    for service in answer.list_services_response.service
                }
    finally:
        await front.server.stop(None)
    return metrics, exposition, listed


def test_every_served_method_is_counted_at_zero_before_its_first_call() -> None:
    _, exposition, _ = asyncio.run(front_session())
    assert "# TYPE grpc_server_handled_total counter" in exposition
    found: dict[str, dict[tuple[str, ...], float]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            labels = sample.labels
            key = (labels.get("grpc_service", ""), labels.get("grpc_method", ""))
            found.setdefault(sample.name, {})[(*key, labels.get("grpc_code", ""))] = sample.value
    expected = {(service, m) for service, methods in served_methods().items() for m in methods}
    started = found["grpc_server_started_total"]
    assert {(service, method) for service, method, _ in started} == expected
    handled = found["grpc_server_handled_total"]
    assert set(handled) == {(*key, code) for key in expected for code in CODES}
    assert not any(started.values()) and not any(handled.values())


def test_reflection_lists_the_same_services_in_v1_and_v1alpha() -> None:
    _, _, listed = asyncio.run(front_session())
    assert (
        listed["v1"]
        == listed["v1alpha"]
        == {
            SERVICE_NAME,
            health.SERVICE_NAME,
            *REFLECTION_SERVICES,
        }
    )
