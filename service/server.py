"""Wiring and life cycle of `moe-control serve`.

Start: metrics HTTP endpoint, worker processes (one per device), the gRPC server (the
service, standard health, reflection), then one line on stdout saying where it listens.
Health: liveness ("") is SERVING while the process runs; readiness (the service's name) is
SERVING only while every worker is ready.
Stop (SIGTERM, SIGINT): health goes NOT_SERVING first so balancers drain, then the server
stops accepting and gives in-flight RPCs `grace_s`, then the workers stop, then /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from prometheus_client import start_http_server

from service import __version__
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.interceptors import ServerInterceptor
from service.api.servicer import MoeControlServicer, add_to_server
from service.logs import configure_logging
from service.metrics import Metrics, enable_multiprocess
from service.replica import ReplicaSet, settings_to_json
from service.settings import Settings
from service.worker.supervisor import SupervisorConfig, WorkerHandle, WorkerPool, discover_devices

log = logging.getLogger("moe_control.server")

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["MoeControlService"].full_name
#: What server reflection lists.
REFLECTED = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where a started server listens (ports resolved when 0 was asked for)."""

    grpc_address: str
    metrics_url: str | None


def _read(path: Any) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    client_ca = _read(settings.tls_client_ca) if settings.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(_read(settings.tls_key), _read(settings.tls_cert))],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


class MoeControlServer:
    """The primary gRPC server process with its workers, metrics endpoint and replicas.

    `runtime_dir` (private to this server) turns on replicas (replica.py): with it, the
    server runs `settings.process_count()` processes on its port and listens for their
    forwarded calls on a Unix socket there; `metrics` must then be in multiprocess mode."""

    def __init__(
        self, settings: Settings, metrics: Metrics | None = None, *, runtime_dir: str | None = None
    ) -> None:
        self.settings = settings
        self.metrics = metrics if metrics is not None else Metrics()
        self.health = health.aio.HealthServicer()
        self.pool: WorkerPool | None = None
        self.server: grpc.aio.Server | None = None
        self.servicer: MoeControlServicer | None = None
        self.replicas: ReplicaSet | None = None
        self.internal: grpc.aio.Server | None = None
        self._runtime_dir = runtime_dir
        self._metrics_http: Any = None
        self._stopping = False
        self._health_tasks: set[asyncio.Task[None]] = set()
        self._restarts_counted: dict[int, int] = {}

    # -- readiness

    def _worker_changed(self, worker: WorkerHandle) -> None:
        self.metrics.set_worker_ready(worker.index, worker.device, worker.ready)
        counted = self._restarts_counted.get(worker.index, 0)
        for _ in range(worker.restarts - counted):
            self.metrics.count_worker_restart(worker.index, worker.device)
        self._restarts_counted[worker.index] = worker.restarts
        if self.replicas is not None:
            self.replicas.publish(self._state())
        task = asyncio.create_task(self._publish_readiness())
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    def _ready(self) -> bool:
        return self.pool is not None and self.pool.ready and not self._stopping

    def _state(self) -> dict[str, Any]:
        """The workers as replicas need them: readiness and each worker's profile."""
        workers = [] if self.pool is None else self.pool.workers
        return {
            "ready": self._ready(),
            "workers": [
                {
                    "device": w.device,
                    "state": str(w.state),
                    "ready": w.ready,
                    "profile": w.profile.to_json() if w.profile is not None else None,
                }
                for w in workers
            ],
        }

    async def _publish_readiness(self) -> None:
        ready = self._ready()
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ready
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.set(SERVICE_NAME, status)

    # -- life cycle

    async def start(self) -> Endpoints:
        s = self.settings
        metrics_url = None
        if s.metrics_enabled:
            self._metrics_http, _ = start_http_server(
                s.metrics_port, addr=s.metrics_host, registry=self.metrics.registry
            )
            port = self._metrics_http.server_port
            metrics_url = f"http://{_host_for_url(s.metrics_host)}:{port}/metrics"

        devices = await discover_devices(s.devices)
        self.pool = WorkerPool(
            devices,
            SupervisorConfig(
                start_timeout_s=s.worker_start_timeout_s,
                ping_interval_s=s.worker_ping_interval_s,
                ping_timeout_s=s.worker_ping_timeout_s,
                restart_backoff_s=s.worker_restart_backoff_s,
                log_level=s.log_level,
                log_format=s.log_format,
            ),
            on_change=self._worker_changed,
        )
        for worker in self.pool.workers:
            self.metrics.set_worker_ready(worker.index, worker.device, False)

        token = s.token()
        processes = s.process_count() if self._runtime_dir is not None else 1
        self.server = grpc.aio.server(
            options=s.grpc_options(reuseport=processes > 1),
            maximum_concurrent_rpcs=s.max_concurrent_rpcs or None,
        )
        self.servicer = MoeControlServicer(self.pool, self.metrics, s)
        registrar = ServerInterceptor(self.metrics, token=token).registrar(self.server)
        add_to_server(self.servicer, registrar)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, registrar)  # type: ignore[arg-type]
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(  # type: ignore[no-untyped-call]
            reflection.aio.ReflectionServicer(REFLECTED), registrar
        )
        registrar.install()
        await self.health.set(health.OVERALL_HEALTH, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)

        address = f"{s.host}:{s.port}"
        credentials = server_credentials(s)
        if credentials is None:
            port = self.server.add_insecure_port(address)
        else:
            port = self.server.add_secure_port(address, credentials)
        if port == 0:
            raise OSError(f"cannot listen on {address}")
        await self.server.start()
        self.pool.start()
        if processes > 1:
            await self._start_replicas(processes - 1, port, token)
        grpc_address = f"{_host_for_url(s.host)}:{port}"
        log.info(
            "serving",
            extra={
                "event": "serving",
                "grpc": grpc_address,
                "tls": credentials is not None,
                "mtls": s.tls_client_ca is not None,
                "auth": token is not None,
                "metrics": metrics_url,
                "devices": devices,
                "processes": processes,
                "version": __version__,
            },
        )
        return Endpoints(grpc_address, metrics_url)

    async def _start_replicas(self, count: int, port: int, token: str | None) -> None:
        """The private endpoint for forwarded calls (counted by the replica that took them,
        so not here), then the replicas, which listen on `port` too."""
        assert self._runtime_dir is not None and self.servicer is not None
        s = self.settings
        target = f"unix:{os.path.join(self._runtime_dir, 'primary.sock')}"
        self.internal = grpc.aio.server(options=s.grpc_options())
        registrar = ServerInterceptor(None, token=token).registrar(self.internal)
        add_to_server(self.servicer, registrar)
        registrar.install()
        if self.internal.add_insecure_port(target) == 0:
            raise OSError(f"cannot listen on {target}")
        await self.internal.start()
        self.replicas = ReplicaSet(
            count,
            {"settings": settings_to_json(s), "port": port, "internal": target},
            env=os.environ,
            restart_backoff_s=s.worker_restart_backoff_s,
        )
        self.replicas.publish(self._state())
        await self.replicas.start()

    async def stop(self) -> None:
        """Drain and stop, in order: health, gRPC (with grace; replicas drain at the same
        time), the replicas' private endpoint, workers, /metrics."""
        if self._stopping:
            return
        self._stopping = True
        log.info("shutting down", extra={"event": "shutdown", "grace_s": self.settings.grace_s})
        await self.health.enter_graceful_shutdown()
        replicas = None
        if self.replicas is not None:
            replicas = asyncio.create_task(self.replicas.stop(self.settings.grace_s))
        if self.server is not None:
            await self.server.stop(self.settings.grace_s)
        if replicas is not None:
            await replicas
        if self.internal is not None:
            await self.internal.stop(self.settings.grace_s)
        if self.pool is not None:
            await self.pool.stop()
        if self.servicer is not None:
            self.servicer.convert.close()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        log.info("stopped", extra={"event": "stopped"})


def settle_heap() -> None:
    """Move everything allocated during start-up (modules, descriptors, oracle tables: tens
    of thousands of objects that live as long as the process) out of the collector's way.

    Without this, each full collection walks them all: a 20-50 ms pause of the event loop
    every few thousand requests, which is what the p99 of an open-loop load showed
    (bench/RESULTS.md). Frozen objects are never collected, so this runs once, after
    start-up's garbage is gone."""
    gc.collect()
    gc.freeze()


def _host_for_url(host: str) -> str:
    if host in ("", "0.0.0.0", "[::]", "::"):
        return "localhost"
    return host


async def serve(settings: Settings) -> None:
    """Run until SIGTERM or SIGINT, then shut down gracefully."""
    with contextlib.ExitStack() as stack:
        runtime_dir = None
        metrics = None
        if settings.process_count() > 1:
            runtime_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="moe-control-"))
            metrics_dir = os.path.join(runtime_dir, "metrics")
            os.mkdir(metrics_dir)
            enable_multiprocess(metrics_dir)
            metrics = Metrics(multiprocess_dir=metrics_dir)
        await _serve(MoeControlServer(settings, metrics, runtime_dir=runtime_dir))


async def _serve(server: MoeControlServer) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        endpoints = await server.start()
        settle_heap()
        metrics = f"; metrics at {endpoints.metrics_url}" if endpoints.metrics_url else ""
        print(f"moe-control serving gRPC on {endpoints.grpc_address}{metrics}", flush=True)
        await stop.wait()
    finally:
        await server.stop()


def run(settings: Settings) -> int:
    configure_logging(settings.log_level, settings.log_format)
    try:
        asyncio.run(serve(settings))
    except OSError as exc:
        log.error("cannot serve: %s", exc, extra={"event": "startup_failed"})
        print(f"moe-control: cannot serve: {exc}", file=sys.stderr)
        return 1
    return 0
