"""The public gRPC server of each server process (the primary's and each replica's).

One grpc.aio server on the public port. It always serves SelectBackend, ListPlatformPresets
and ListRulesets itself, from the process's SelectionServicer (servicer.py), and standard
health and reflection (v1 and v1alpha, reflection.py). The other MoeControlService methods
need the workers: the primary registers its servicer's worker methods
(`MoeControlServicer.worker_handlers`); a replica registers a Forwarder (forward.py) that
passes them to the primary's private server on a Unix socket. Each method is registered
once.

Why grpc.aio and not grpc's sync server with a thread pool: both were built and measured
(bench/RESULTS.md). On a cache hit they cost the same CPU per call; on a cache miss (a full
decision in the handler) the sync server cost more, its handler threads contending for the
GIL.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from service.api.interceptors.chain import InterceptorChain
from service.api.interceptors.limits import Limits
from service.api.interceptors.registrar import HandlerRegistrar
from service.api.names import SERVICE_NAME
from service.api.servicer import SelectionServicer
from service.metrics import Metrics
from service.ports import check_free
from service.server.reflection import add_reflection
from service.settings import Settings

#: What server reflection lists (beside the reflection services themselves).
REFLECTED = (SERVICE_NAME, health.SERVICE_NAME)
#: MoeControlService methods every process answers itself (the rest need the workers).
LOCAL_METHODS = SelectionServicer.METHODS


def _read(path: Path) -> bytes:
    return path.read_bytes()


def server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    client_ca = _read(settings.tls_client_ca) if settings.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(_read(settings.tls_key), _read(settings.tls_cert))],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


@dataclass
class Front:
    server: grpc.aio.Server
    port: int
    tls: bool


async def start_front(
    settings: Settings,
    *,
    port: int,
    metrics: Metrics,
    selection: SelectionServicer,
    health_servicer: health.aio.HealthServicer,
    worker_methods: Any,
    reuseport: bool,
    limits: Limits | None = None,
) -> Front:
    """Create, bind and start the public server on `settings.host`:`port` (PortTakenError
    when another process listens there, OSError when it cannot be bound otherwise).
    `worker_methods(registrar)` registers the handlers of the methods that need the
    workers: the servicer in the primary, a Forwarder in a replica. `limits`: the
    per-method concurrency limits (default: this process's own, from `settings`; the
    primary passes the ones its private endpoint shares)."""
    if limits is None:
        limits = Limits.from_settings(settings, metrics)
    server = grpc.aio.server(
        options=settings.grpc_options(reuseport=reuseport),
        maximum_concurrent_rpcs=settings.max_concurrent_rpcs or None,
    )
    registrar: HandlerRegistrar = InterceptorChain(
        metrics, token=settings.token(), limits=limits
    ).registrar(server)
    registrar.add_registered_method_handlers(SERVICE_NAME, selection.handlers())
    worker_methods(registrar)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, registrar)  # type: ignore[arg-type]
    add_reflection(REFLECTED, registrar)
    registrar.install()
    address = f"{settings.host}:{port}"
    credentials = server_credentials(settings)
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError:  # how grpcio says it could not bind
        bound = 0
    if bound == 0:
        # Taken (PortTakenError names --port), else some other reason.
        check_free(settings.host, port, "port")
        raise OSError(f"cannot listen on {address}")
    await server.start()
    return Front(server, bound, credentials is not None)
