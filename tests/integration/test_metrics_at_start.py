"""`curl /metrics` on a fresh server, before any call: the selection, rejection, failure,
handled and restart series are there at zero, with HELP and TYPE, from every process (two:
prometheus_client's multiprocess mode, which reports only the series a process created)."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest
from grpc_health.v1 import health
from prometheus_client.parser import text_string_to_metric_families

from integration.serverproc import ServerProcess, launch
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.server.reflection import REFLECTION_SERVICES
from tests.test_metrics import expected_at_start

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def fresh() -> Iterator[tuple[ServerProcess, str]]:
    server = launch("--server-processes", "2")
    try:
        assert server.metrics_url is not None
        # Scraped as soon as the server says it serves: no gRPC call, not even health.
        with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
            yield server, response.read().decode()
    finally:
        server.stop()


def families(exposition: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def test_every_decision_series_is_at_zero(fresh: tuple[ServerProcess, str]) -> None:
    _, exposition = fresh
    found = families(exposition)
    for name, label_sets in expected_at_start().items():
        assert f"# HELP {name} " in exposition and f"# TYPE {name} counter" in exposition
        series = {frozenset(labels.items()): value for labels, value in found[name]}
        assert set(series) == label_sets, name
        assert not any(series.values()), name


def test_every_method_is_handled_ok_at_zero(fresh: tuple[ServerProcess, str]) -> None:
    _, exposition = fresh
    assert "# TYPE grpc_server_handled_total counter" in exposition
    ok = {
        (labels["grpc_service"], labels["grpc_method"]): value
        for labels, value in families(exposition)["grpc_server_handled_total"]
        if labels["grpc_code"] == "OK"
    }
    service = pb.DESCRIPTOR.services_by_name["MoeControlService"]
    expected = {(service.full_name, method.name) for method in service.methods}
    expected |= {(health.SERVICE_NAME, "Check"), (health.SERVICE_NAME, "Watch")}
    expected |= {(name, "ServerReflectionInfo") for name in REFLECTION_SERVICES}
    assert set(ok) == expected
    assert not any(ok.values())


def test_each_workers_restarts_and_readiness_are_there(fresh: tuple[ServerProcess, str]) -> None:
    _, exposition = fresh
    found = families(exposition)
    assert "# TYPE moe_control_worker_restarts_total counter" in exposition
    restarts = found["moe_control_worker_restarts_total"]
    assert [labels["worker"] for labels, _ in restarts] == ["0"]
    assert [value for _, value in restarts] == [0.0]
    assert [labels["worker"] for labels, _ in found["moe_control_worker_ready"]] == ["0"]
