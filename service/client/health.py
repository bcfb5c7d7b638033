"""The standard health check from the client side, for `moe-control health`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from service.client.channel import open_channel


def check_health(
    target: str,
    service: str = "",
    *,
    tls_ca: str | Path | None = None,
    tls_cert: str | Path | None = None,
    tls_key: str | Path | None = None,
    timeout: float = 5.0,
) -> str:
    """The `grpc.health.v1` status name of `service` ("" = the whole server)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with open_channel(target, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key) as channel:
        stub: Any = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))
