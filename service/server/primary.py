"""Wiring and life cycle of `moe-control serve`: the primary server process.

Processes: this one, the primary, owns the workers (one per device), /metrics and the life
cycle; `--server-processes` N adds N-1 replicas (replica.py). Every process listens on the
public port (front.py); the replicas forward what needs a worker to the primary's private
server on a Unix socket (forward.py).
Start: /metrics, workers, the public server, the HTTP/JSON door (`--http-port`,
service.http, a floor below this one), the private one and the replicas (with more than
one process; each serves gRPC and the HTTP door on the same ports), then one line on
stdout saying where it
listens, and one more once the server is ready (the first worker ready: readiness SERVING).
Health: liveness ("") is SERVING while the process runs; readiness (the service's name) as
readiness.py says, in every process.
Stop (SIGTERM, SIGINT): health goes NOT_SERVING first so balancers drain, then the public
servers (this one, the HTTP door and the replicas', in parallel) stop accepting and give
in-flight calls `grace_s`, then the private server, the workers and /metrics stop.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import signal
import sys
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health
from prometheus_client import start_http_server

from service import __version__
from service.api.interceptors.limits import Limits
from service.api.names import SERVICE_NAME
from service.api.servicer import MoeControlServicer
from service.http.serve import HttpDoor, open_http
from service.http.state import LocalState
from service.kernels.registry import RUNNABLE
from service.logs import configure_logging
from service.metrics import Metrics, enable_multiprocess
from service.pool.config import SupervisorConfig
from service.pool.devices import discover_devices
from service.pool.pool import WorkerPool
from service.ports import PortTakenError, check_free
from service.process import make_runtime_dir, settle_heap, tune_malloc
from service.server.front import Front, start_front
from service.server.readiness import Readiness
from service.server.replica import ReplicaSet, settings_to_json, start_private_server
from service.settings import Settings

log = logging.getLogger("moe_control.server")

__all__ = ["Endpoints", "MoeControlServer", "run", "serve"]


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where a started server listens (ports resolved when 0 was asked for)."""

    grpc_address: str
    metrics_url: str | None
    http_url: str | None = None


class MoeControlServer:
    """The primary server process: workers, /metrics, the public server, and with replicas
    the private server they forward to.

    `runtime_dir` holds the private socket (a fresh temporary directory when not given);
    with more than one process, `metrics` must be in multiprocess mode (see `serve`)."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics | None = None,
        *,
        runtime_dir: str | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics if metrics is not None else Metrics()
        # Conversions and forwards run here (a replica forwards them): their series too.
        self.metrics.prepare_kernels(RUNNABLE)
        self.health = health.aio.HealthServicer()
        self.readiness = Readiness(self.health, self.metrics)
        self.pool: WorkerPool | None = None
        self.servicer: MoeControlServicer | None = None
        self.front: Front | None = None
        self.internal: grpc.aio.Server | None = None
        self.replicas: ReplicaSet | None = None
        self.limits: Limits | None = None
        self.http: HttpDoor | None = None
        self._own_dir = None if runtime_dir is not None else make_runtime_dir()
        self._runtime_dir: str = runtime_dir or self._own_dir or ""
        self._metrics_http: Any = None

    async def start(self) -> Endpoints:
        s = self.settings
        # Every port another process holds fails the start now, before anything starts.
        self._check_ports()
        metrics_url = self._start_metrics() if s.metrics_enabled else None
        devices = await discover_devices(s.devices, cpu_workers=s.cpu_workers)
        pool = self.pool = WorkerPool(
            devices, _supervisor_config(s), on_change=self.readiness.worker_changed
        )
        await self.readiness.start(pool)
        servicer = self.servicer = MoeControlServicer(pool, self.metrics, s)
        processes = s.process_count()
        # One set of per-method limits for the public server and the private endpoint of
        # the replicas' forwarded calls: conversions and forwards are bounded server-wide.
        limits = self.limits = Limits.from_settings(s, self.metrics)
        self.front = await start_front(
            s,
            port=s.port,
            metrics=self.metrics,
            selection=servicer.selection,
            health_servicer=self.health,
            worker_methods=lambda registrar: registrar.add_registered_method_handlers(
                SERVICE_NAME, servicer.worker_handlers()
            ),
            # The replicas listen on the same port: the kernel spreads connections.
            reuseport=processes > 1,
            limits=limits,
        )
        pool.start()
        http_url = None
        if s.http_port:
            # The same selector, pool, store of observed decisions, readiness and limits as
            # the public gRPC server; before the replicas, which inherit its socket.
            self.http = await open_http(
                s,
                metrics=self.metrics,
                selection=servicer.selection,
                state=LocalState(pool, servicer.observations),
                ready=lambda: self.readiness.ready,
                limits=limits,
            )
            http_url = self.http.url(_host_for_url(s.host))
        if processes > 1:
            await self._start_replicas(processes - 1, limits)
        grpc_address = f"{_host_for_url(s.host)}:{self.front.port}"
        log.info(
            "listening",
            extra={
                "event": "listening",
                "grpc": grpc_address,
                "tls": self.front.tls,
                "mtls": s.tls_client_ca is not None,
                "auth": s.token() is not None,
                "metrics": metrics_url,
                "http": http_url,
                "devices": devices,
                "processes": processes,
                "version": __version__,
            },
        )
        return Endpoints(grpc_address, metrics_url, http_url)

    def _check_ports(self) -> None:
        s = self.settings
        check_free(s.host, s.port, "port")
        if s.http_port:
            check_free(s.host, s.http_port, "http_port")
        if s.metrics_enabled:
            check_free(s.metrics_host, s.metrics_port, "metrics_port")

    def _start_metrics(self) -> str:
        s = self.settings
        try:
            self._metrics_http, _ = start_http_server(
                s.metrics_port, addr=s.metrics_host, registry=self.metrics.registry
            )
        except OSError as exc:  # bound without SO_REUSEPORT: nobody shares it
            if exc.errno == errno.EADDRINUSE:
                raise PortTakenError(s.metrics_host, s.metrics_port, "metrics_port") from None
            raise
        port = self._metrics_http.server_port
        return f"http://{_host_for_url(s.metrics_host)}:{port}/metrics"

    async def _start_replicas(self, count: int, limits: Limits) -> None:
        assert self.servicer is not None and self.front is not None
        s = self.settings
        target = f"unix:{os.path.join(self._runtime_dir, 'primary.sock')}"
        self.internal = await start_private_server(s, self.servicer, limits, target)
        config = {
            "settings": settings_to_json(s),
            "port": self.front.port,
            "internal": target,
            # The HTTP door's listening socket, inherited by every replica (None: off).
            "http_fd": self.http.listener.fileno() if self.http is not None else None,
        }
        self.replicas = self.readiness.replicas = ReplicaSet(
            count,
            config,
            env=os.environ,
            restart_backoff_s=s.worker_restart_backoff_s,
            pass_fds=() if self.http is None else (self.http.listener.fileno(),),
        )
        self.readiness.publish()
        await self.replicas.start()

    async def stop(self) -> None:
        """Drain and stop, in order: health, the public servers (with grace; the replicas
        drain at the same time), the private server, workers, /metrics."""
        if self.readiness.stopping:
            return
        self.readiness.stopping = True
        grace = self.settings.grace_s
        log.info("shutting down", extra={"event": "shutdown", "grace_s": grace})
        await self.health.enter_graceful_shutdown()
        replicas = None
        if self.replicas is not None:
            replicas = asyncio.create_task(self.replicas.stop(grace))
        http = None
        if self.http is not None:
            http = asyncio.create_task(self.http.stop())
        if self.front is not None:
            await self.front.server.stop(grace)
        if http is not None:
            await http
        if replicas is not None:
            await replicas
        if self.internal is not None:
            await self.internal.stop(grace)
        if self.pool is not None:
            await self.pool.stop()
        if self.servicer is not None:
            self.servicer.convert.close()
            self.servicer.selection.offload.close()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
        log.info("stopped", extra={"event": "stopped"})


def _supervisor_config(s: Settings) -> SupervisorConfig:
    return SupervisorConfig(
        start_timeout_s=s.worker_start_timeout_s,
        ping_interval_s=s.worker_ping_interval_s,
        ping_timeout_s=s.worker_ping_timeout_s,
        restart_backoff_s=s.worker_restart_backoff_s,
        log_level=s.log_level,
        log_format=s.log_format,
        worker_env=s.worker_environ(),
    )


def _host_for_url(host: str) -> str:
    if host in ("", "0.0.0.0", "[::]", "::"):
        return "localhost"
    return host


async def serve(settings: Settings) -> None:
    """Run until SIGTERM or SIGINT, then shut down gracefully."""
    runtime_dir = make_runtime_dir()
    try:
        metrics = None
        if settings.process_count() > 1:
            # Every process writes its counts here; /metrics sums them.
            metrics_dir = os.path.join(runtime_dir, "metrics")
            os.mkdir(metrics_dir)
            enable_multiprocess(metrics_dir)
            metrics = Metrics(multiprocess_dir=metrics_dir)
        server = MoeControlServer(settings, metrics, runtime_dir=runtime_dir)
        await _serve(server)
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)


async def _serve(server: MoeControlServer) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        endpoints = await server.start()
        settle_heap()
        metrics = f"; metrics at {endpoints.metrics_url}" if endpoints.metrics_url else ""
        if endpoints.http_url:
            metrics += f"; HTTP at {endpoints.http_url}"
        # Two lines: where it listens (liveness SERVING: probes and --wait-ready clients can
        # connect), then when it is ready (readiness SERVING: calls that need a worker work).
        print(f"moe-control listening for gRPC on {endpoints.grpc_address}{metrics}", flush=True)
        announce = asyncio.create_task(_announce_ready(server))
        await stop.wait()
        announce.cancel()
    finally:
        await server.stop()


async def _announce_ready(server: MoeControlServer) -> None:
    await server.readiness.became_ready.wait()
    workers = [] if server.pool is None else server.pool.workers
    ready = sum(1 for worker in workers if worker.ready)
    log.info("ready", extra={"event": "ready", "ready_workers": ready, "workers": len(workers)})
    print(f"moe-control ready: {ready} of {len(workers)} workers ready", flush=True)


def run(settings: Settings) -> int:
    """Serve until stopped (the HTTP/JSON door too, unless `--http-port` is 0). A port
    another process holds raises PortTakenError before anything starts."""
    # Before any thread starts: the big messages' buffers are kept for the next call
    # (process.py's "server" row; --no-malloc-tuning leaves glibc's defaults).
    if settings.malloc_tuning:
        tune_malloc("server")
    configure_logging(settings.log_level, settings.log_format)
    try:
        asyncio.run(serve(settings))
    except PortTakenError as exc:  # a setting's fault, as a bad value is: the caller says
        log.error("cannot serve: %s", exc, extra={"event": "startup_failed", "port": exc.port})
        raise
    except OSError as exc:
        log.error("cannot serve: %s", exc, extra={"event": "startup_failed"})
        print(f"moe-control: cannot serve: {exc}", file=sys.stderr)
        return 1
    return 0
