"""Wiring and life cycle of `moe-control serve`.

Processes: this one, the primary, owns the workers (one per device), /metrics and the life
cycle; `--server-processes` N adds N-1 replicas (replica.py). Every process listens on the
public port (api/front.py); the replicas forward what needs a worker to the primary's
private server on a Unix socket.
Start: /metrics, workers, the public server, the private one and the replicas (with more
than one process), then one line on stdout saying where it listens.
Health: liveness ("") is SERVING while the process runs; readiness (the service's name) is
SERVING while at least one worker is ready (a node keeps serving on its healthy GPUs while
one worker restarts: WorkerPool.ready), in every process.
Stop (SIGTERM, SIGINT): health goes NOT_SERVING first so balancers drain, then the public
servers (this one and the replicas', in parallel) stop accepting and give in-flight RPCs
`grace_s`, then the private server, the workers and /metrics stop.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2
from prometheus_client import start_http_server

from service import __version__
from service.api.front import REFLECTED, Front, start_front
from service.api.interceptors import ServerInterceptor
from service.api.limits import Limits
from service.api.servicer import SERVICE_NAME, MoeControlServicer, add_to_server
from service.logs import configure_logging
from service.metrics import Metrics, enable_multiprocess
from service.process import tune_malloc
from service.replica import ReplicaSet, settings_to_json
from service.settings import Settings
from service.worker.supervisor import SupervisorConfig, WorkerHandle, WorkerPool, discover_devices

log = logging.getLogger("moe_control.server")

__all__ = ["REFLECTED", "SERVICE_NAME", "Endpoints", "MoeControlServer", "run", "serve"]


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where a started server listens (ports resolved when 0 was asked for)."""

    grpc_address: str
    metrics_url: str | None


class MoeControlServer:
    """The primary server process: workers, /metrics, the public server, and with replicas
    the private server they forward to.

    `runtime_dir` holds the private socket (a fresh temporary directory when not given);
    with more than one process, `metrics` must be in multiprocess mode (see `serve`)."""

    def __init__(
        self, settings: Settings, metrics: Metrics | None = None, *, runtime_dir: str | None = None
    ) -> None:
        self.settings = settings
        self.metrics = metrics if metrics is not None else Metrics()
        self.health = health.aio.HealthServicer()
        self.pool: WorkerPool | None = None
        self.internal: grpc.aio.Server | None = None
        self.front: Front | None = None
        self.servicer: MoeControlServicer | None = None
        self.replicas: ReplicaSet | None = None
        self._own_dir = None if runtime_dir is not None else make_runtime_dir()
        self._runtime_dir: str = runtime_dir or self._own_dir or ""
        self._metrics_http: Any = None
        self._stopping = False
        self._restarts_counted: dict[int, int] = {}
        self._health_tasks: set[asyncio.Task[None]] = set()

    # -- readiness

    def _worker_changed(self, worker: WorkerHandle) -> None:
        self.metrics.set_worker_ready(worker.index, worker.device, worker.ready)
        counted = self._restarts_counted.get(worker.index, 0)
        for _ in range(worker.restarts - counted):
            self.metrics.count_worker_restart(worker.index, worker.device)
        self._restarts_counted[worker.index] = worker.restarts
        if self.replicas is not None:
            self.replicas.publish(self._state())
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self._ready()
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        task = asyncio.create_task(self.health.set(SERVICE_NAME, status))
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

        devices = await discover_devices(s.devices, cpu_workers=s.cpu_workers)
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
        await self.health.set(health.OVERALL_HEALTH, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)

        token = s.token()
        processes = s.process_count()
        servicer = self.servicer = MoeControlServicer(self.pool, self.metrics, s)
        # One set of per-method limits for the public server and the private endpoint of
        # the replicas' forwarded calls: conversions and forwards are bounded server-wide.
        limits = Limits.from_settings(s, self.metrics)
        self.front = await start_front(
            s,
            port=s.port,
            metrics=self.metrics,
            selection=servicer.selection,
            health_servicer=self.health,
            worker_methods=lambda registrar: add_to_server(servicer, registrar),
            reuseport=processes > 1,
            limits=limits,
        )
        self.pool.start()
        if processes > 1:
            # The private server for the replicas' forwarded calls, which the replica that
            # took a call counted already (so this one counts nothing; the token is checked
            # again).
            target = f"unix:{os.path.join(self._runtime_dir, 'primary.sock')}"
            self.internal = grpc.aio.server(options=s.grpc_options())
            registrar = ServerInterceptor(None, token=token, limits=limits).registrar(self.internal)
            add_to_server(servicer, registrar)
            registrar.install()
            if self.internal.add_insecure_port(target) == 0:
                raise OSError(f"cannot listen on {target}")
            await self.internal.start()
            self.replicas = ReplicaSet(
                processes - 1,
                {"settings": settings_to_json(s), "port": self.front.port, "internal": target},
                env=os.environ,
                restart_backoff_s=s.worker_restart_backoff_s,
            )
            self.replicas.publish(self._state())
            await self.replicas.start()
        grpc_address = f"{_host_for_url(s.host)}:{self.front.port}"
        log.info(
            "serving",
            extra={
                "event": "serving",
                "grpc": grpc_address,
                "tls": self.front.tls,
                "mtls": s.tls_client_ca is not None,
                "auth": token is not None,
                "metrics": metrics_url,
                "devices": devices,
                "processes": processes,
                "version": __version__,
            },
        )
        return Endpoints(grpc_address, metrics_url)

    async def stop(self) -> None:
        """Drain and stop, in order: health, the public servers (with grace; the replicas
        drain at the same time), the private server, workers, /metrics."""
        if self._stopping:
            return
        self._stopping = True
        grace = self.settings.grace_s
        log.info("shutting down", extra={"event": "shutdown", "grace_s": grace})
        await self.health.enter_graceful_shutdown()
        replicas = None
        if self.replicas is not None:
            replicas = asyncio.create_task(self.replicas.stop(grace))
        if self.front is not None:
            await self.front.server.stop(grace)
        if replicas is not None:
            await replicas
        if self.internal is not None:
            await self.internal.stop(grace)
        if self.pool is not None:
            await self.pool.stop()
        if self.servicer is not None:
            self.servicer.convert.close()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
        log.info("stopped", extra={"event": "stopped"})


#: The private runtime directories (Unix socket, multiprocess metrics) are named
#: moe-control-run-<pid of the primary>-<random>.
RUNTIME_PREFIX = "moe-control-run-"


def make_runtime_dir(base: str | None = None) -> str:
    """A private (0700) directory for this server's socket and metrics files. A server that
    was killed (SIGKILL, OOM) could not remove its own, so those of dead servers are swept
    first."""
    sweep_runtime_dirs(base)
    return tempfile.mkdtemp(prefix=f"{RUNTIME_PREFIX}{os.getpid()}-", dir=base)


def sweep_runtime_dirs(base: str | None = None) -> list[str]:
    """Remove the runtime directories whose server process is gone; returns them."""
    removed = []
    for path in Path(base or tempfile.gettempdir()).glob(RUNTIME_PREFIX + "*"):
        pid = path.name[len(RUNTIME_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)) or path.stat().st_uid != os.getuid():
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
    runtime_dir = make_runtime_dir()
    try:
        metrics = None
        if settings.process_count() > 1:
            metrics_dir = os.path.join(runtime_dir, "metrics")
            os.mkdir(metrics_dir)
            enable_multiprocess(metrics_dir)
            metrics = Metrics(multiprocess_dir=metrics_dir)
        await _serve(MoeControlServer(settings, metrics, runtime_dir=runtime_dir))
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
        print(f"moe-control serving gRPC on {endpoints.grpc_address}{metrics}", flush=True)
        await stop.wait()
    finally:
        await server.stop()


def run(settings: Settings) -> int:
    # Before any thread starts. Every RunMoE at large M moves tens of MiB through fresh
    # buffers here; under glibc's default thresholds each was mapped or grown, faulted in,
    # zeroed and given back per call (bench/RESULTS.md, memory.py's "server" row;
    # --no-malloc-tuning leaves glibc's defaults).
    if settings.malloc_tuning:
        tune_malloc("server")
    configure_logging(settings.log_level, settings.log_format)
    try:
        asyncio.run(serve(settings))
    except OSError as exc:
        log.error("cannot serve: %s", exc, extra={"event": "startup_failed"})
        print(f"moe-control: cannot serve: {exc}", file=sys.stderr)
        return 1
    return 0
