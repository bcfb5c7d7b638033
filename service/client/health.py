"""The standard health check from the client side, for `moe-control health`."""

from __future__ import annotations

from typing import Any

from service.client.channel import READINESS_SERVICE, Connection

#: The services this server reports health for, and what each means.
HEALTH_SERVICES: dict[str, str] = {
    "": "liveness: the process serves (the default)",
    READINESS_SERVICE: "readiness: a worker is ready (--ready)",
}


def check_health(connection: Connection, service: str = "") -> str:
    """The `grpc.health.v1` status name of `service` ("" = the whole server); with
    `connection.wait_ready`, first waits (within its timeout) until that service is
    SERVING."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with connection.session(ready_service=service) as session:
        stub: Any = health_pb2_grpc.HealthStub(session.channel)
        response = stub.Check(
            health_pb2.HealthCheckRequest(service=service), timeout=session.remaining()
        )
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


def unknown_service_message(service: str) -> str:
    """What `NOT_FOUND` from Check means, with the services there are."""
    known = "; ".join(f"{name!r} ({meaning})" for name, meaning in HEALTH_SERVICES.items())
    return f"the server reports no health for service {service!r}; it reports {known}"

