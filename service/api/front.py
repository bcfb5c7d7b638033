"""The front server of each server process: the public port, a sync grpc server.

Why sync: SelectBackend is pure CPU and answers from a cache, so grpc's own per-call work
is most of its cost. grpc's sync server needs fewer instructions per call than grpc.aio
(callgrind: a bare echo 0.35 M against 0.47 M; SelectBackend with its cache and metrics
0.41 M against 0.60 M), and at 3,000 calls/s on one core its p99 stayed lower (handlers run
in threads, so one slow call does not hold up the event loop for all). Its forwarding
client also reports the target's status where grpc.aio's loses it (forward.py). Details
and the measurements in bench/RESULTS.md.

Handlers run in a thread pool; long calls (health Watch, forwarded conversions) hold a
thread each, so the pool may grow to `max_concurrent_rpcs` threads (started only when
needed; idle ones cost nothing).

What it serves itself: SelectBackend and ListPlatformPresets (selection.py), standard health
and reflection. Everything else of MoeControlService needs the workers and is forwarded
(forward.py) to the primary process's grpc.aio server on a private Unix socket, which owns
the workers and whose handlers stay asynchronous.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from service.api.forward import Forwarder, service_methods
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.interceptors import ServerInterceptor
from service.api.selection import Selection
from service.metrics import Metrics
from service.settings import Settings

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["MoeControlService"].full_name
#: What server reflection lists.
REFLECTED = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
#: MoeControlService methods the front answers itself (the rest go to the primary).
LOCAL_METHODS = ("SelectBackend", "ListPlatformPresets")
#: Threads when max_concurrent_rpcs is 0 (no limit).
MAX_THREADS = 1024


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
    server: grpc.Server
    port: int
    channel: grpc.Channel
    tls: bool

    def stop(self, grace: float) -> Any:
        """Stop accepting; calls in flight get `grace` seconds. Returns a threading.Event."""
        event = self.server.stop(grace)
        return event

    def close(self) -> None:
        self.channel.close()


def build_front(
    settings: Settings,
    *,
    port: int,
    metrics: Metrics,
    selection: Selection,
    health_servicer: health.HealthServicer,
    internal_target: str,
    reuseport: bool,
) -> Front:
    """Create, bind and start the front server on `settings.host`:`port` (OSError when the
    address cannot be bound)."""
    limit = settings.max_concurrent_rpcs or None
    server = grpc.server(
        ThreadPoolExecutor(max_workers=limit or MAX_THREADS, thread_name_prefix="grpc-front"),
        options=settings.grpc_options(reuseport=reuseport),
        maximum_concurrent_rpcs=limit,
    )
    channel = grpc.insecure_channel(
        internal_target,
        options=[
            ("grpc.max_receive_message_length", settings.max_send_message_bytes),
            ("grpc.max_send_message_length", settings.max_receive_message_bytes),
        ],
    )
    registrar = ServerInterceptor(metrics, token=settings.token()).registrar(server)
    registrar.add_registered_method_handlers(SERVICE_NAME, selection.handlers())
    forwarded = service_methods(exclude=LOCAL_METHODS)
    registrar.add_generic_rpc_handlers((Forwarder(channel, forwarded),))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, registrar)  # type: ignore[arg-type]
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(  # type: ignore[no-untyped-call]
        reflection.ReflectionServicer(REFLECTED), registrar
    )
    registrar.install()
    address = f"{settings.host}:{port}"
    credentials = server_credentials(settings)
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError:  # grpc's sync server raises where the aio one returns 0
        bound = 0
    if bound == 0:
        channel.close()
        raise OSError(f"cannot listen on {address}")
    server.start()
    return Front(server, bound, channel, credentials is not None)
