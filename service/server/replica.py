"""Replica server processes: more gRPC server processes on the same port.

One Python process serves SelectBackend on one core at most, bound by grpc's per-call work
rather than the oracle (bench/RESULTS.md). So `moe-control serve --server-processes N`
runs the primary (the process started by hand, which owns the workers, /metrics and the life
cycle) and N-1 replicas. All N listen on the gRPC port with SO_REUSEPORT, and the kernel
spreads connections among them; the HTTP door's port is bound by the primary alone and its
socket inherited by every replica, which accept on it (service.ports says why).

A replica runs the same public server as the primary (front.py): it answers
SelectBackend, ListPlatformPresets, ListRulesets, health and reflection itself and forwards
every other MoeControlService call, as bytes (forward.py), to the primary's private server
on a Unix socket, which serves it without counting it again. It serves the HTTP/JSON door
too (service.http), on the primary's door's socket (inherited), from the same selection
and limits; what only the primary knows, the door asks of that private server
(`ForwardedState`). Its view of
the workers (readiness, profiles) is what the primary writes to its stdin, one JSON object
a line, on every worker change; readiness is the primary's. Metrics use prometheus_client's
multiprocess mode (metrics.py), so /metrics counts every process's calls.

Life cycle: the primary starts the replicas after it listens and prints its one line only
when they all listen too; restarts one that dies (back-off as for workers); on SIGTERM it
signals them first, so all processes turn NOT_SERVING together and drain in parallel, and
keeps the private socket open until they are gone. A replica whose stdin closes (the primary
died) shuts itself down rather than keep the port.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from service.api.interceptors.chain import InterceptorChain
from service.api.interceptors.limits import Limits
from service.api.names import SERVICE_NAME
from service.api.servicer import MoeControlServicer, add_to_server
from service.api.servicer import SelectionServicer as Selection
from service.dataplane.offload import Offload
from service.http.serve import HttpDoor, open_http
from service.http.state import ForwardedState
from service.logs import configure_logging
from service.metrics import MULTIPROC_ENV, Metrics
from service.oracle import PlatformProfile
from service.pool.errors import WorkerNotFoundError, WorkerUnavailableError
from service.pool.handle import WorkerHandle
from service.process import settle_heap, tune_malloc
from service.server.forward import ForwardedMeasure, Forwarder, service_methods
from service.server.front import LOCAL_METHODS, start_front
from service.settings import MIB, Settings

log = logging.getLogger("moe_control.replica")

#: What a replica runs (`python -m`): this module (its name as the primary imports it).
_MODULE = __name__
#: A replica must listen within this.
START_TIMEOUT_S = 60.0
MAX_BACKOFF_S = 30.0


def settings_to_json(settings: Settings) -> dict[str, Any]:
    """Settings as the mapping `Settings.load` reads back (paths as text, unset left out)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if value is not None:
            out[f.name] = str(value) if isinstance(value, Path) else value
    return out


# ---------------------------------------------------------------------------------------
# The primary's side


def workers_state(workers: Sequence[WorkerHandle], *, ready: bool) -> dict[str, Any]:
    """The workers as replicas need them (`WorkerView.update` reads it): readiness and
    each worker's profile."""
    return {
        "ready": ready,
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


async def start_private_server(
    settings: Settings, servicer: MoeControlServicer, limits: Limits, target: str
) -> grpc.aio.Server:
    """The primary's server for the replicas' forwarded calls, on the Unix socket `target`."""
    server = grpc.aio.server(options=settings.grpc_options())
    # No metrics: the replica that took a call counted it already. The token is checked
    # again, and the limits are the public server's, so they hold server-wide.
    registrar = InterceptorChain(None, token=settings.token(), limits=limits).registrar(server)
    add_to_server(servicer, registrar)
    registrar.install()
    if server.add_insecure_port(target) == 0:
        raise OSError(f"cannot listen on {target}")
    await server.start()
    return server


class ReplicaSet:
    """The primary's replicas: started, fed the workers' state, restarted, stopped."""

    def __init__(
        self,
        count: int,
        config: Mapping[str, Any],
        *,
        env: Mapping[str, str],
        restart_backoff_s: float = 1.0,
        pass_fds: Sequence[int] = (),
    ) -> None:
        self.count = count
        #: Descriptors every replica inherits (the HTTP door's listening socket).
        self._pass_fds = tuple(pass_fds)
        self._config = json.dumps({"config": dict(config)}).encode() + b"\n"
        self._env = dict(env)
        self._backoff_s = restart_backoff_s
        self._state: bytes | None = None
        self._processes: dict[int, asyncio.subprocess.Process] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self.restarts = 0

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes.values() if p.returncode is None]

    async def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start every replica and wait until each listens (OSError when one cannot)."""
        started = await asyncio.gather(
            *(self._spawn(i, timeout) for i in range(self.count)), return_exceptions=True
        )
        failures = [r for r in started if isinstance(r, BaseException)]
        if failures:
            await self.stop(0)
            raise OSError(f"replica server processes did not start: {failures[0]}")
        self._tasks = [
            asyncio.create_task(self._supervise(i), name=f"replica-{i}") for i in range(self.count)
        ]

    def publish(self, state: Mapping[str, Any]) -> None:
        """Tell every replica the workers' state (kept for replicas started later)."""
        self._state = json.dumps({"state": dict(state)}).encode() + b"\n"
        for process in self._processes.values():
            _write(process, self._state)

    async def stop(self, grace_s: float) -> None:
        """SIGTERM every replica (they drain like the primary) and wait for them."""
        self._stopping = True
        for process in self._processes.values():
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
        for process in self._processes.values():
            try:
                await asyncio.wait_for(process.wait(), grace_s + 5.0)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _spawn(self, index: int, timeout: float) -> None:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            _MODULE,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=self._env,
            pass_fds=self._pass_fds,
        )
        self._processes[index] = process
        _write(process, self._config)
        if self._state is not None:
            _write(process, self._state)
        assert process.stdout is not None
        try:
            line = await asyncio.wait_for(process.stdout.readline(), timeout)
        except TimeoutError:
            line = b""
        if not line.startswith(b'{"event": "listening"'):
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            raise OSError(f"replica {index} did not listen ({_exit(process.returncode)})")

    async def _supervise(self, index: int) -> None:
        backoff = self._backoff_s
        while not self._stopping:
            process = self._processes[index]
            started = time.monotonic()
            await process.wait()
            if self._stopping:
                return
            self.restarts += 1
            log.warning(
                "replica server process died; restarting",
                extra={
                    "event": "replica_restart",
                    "replica": index,
                    "reason": _exit(process.returncode),
                    "backoff_s": backoff,
                },
            )
            if time.monotonic() - started > 60.0:
                backoff = self._backoff_s
            await asyncio.sleep(backoff)
            backoff = min(max(backoff * 2, 0.1), MAX_BACKOFF_S)
            if self._stopping:
                return
            try:
                await self._spawn(index, START_TIMEOUT_S)
            except OSError as exc:
                log.error("replica restart failed: %s", exc, extra={"event": "replica_failed"})


def _write(process: asyncio.subprocess.Process, line: bytes) -> None:
    if process.stdin is not None and process.returncode is None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, RuntimeError):
            process.stdin.write(line)


def _exit(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


# ---------------------------------------------------------------------------------------
# The replica's side


class WorkerView:
    """The workers as the primary last described them (a PlatformSource for Selection)."""

    def __init__(self) -> None:
        self.generation = 0
        self.ready = False
        self._workers: list[dict[str, Any]] = []
        self._profiles: list[PlatformProfile | None] = []

    def update(self, state: Mapping[str, Any]) -> None:
        workers = state.get("workers") or []
        self._workers = [dict(w) for w in workers]
        self._profiles = [
            PlatformProfile.from_json(w["profile"]) if w.get("profile") else None
            for w in self._workers
        ]
        self.ready = bool(state.get("ready"))
        self.generation += 1

    def profile(self, index: int) -> PlatformProfile:
        if not 0 <= index < len(self._workers):
            raise WorkerNotFoundError(index, len(self._workers))
        worker = self._workers[index]
        profile = self._profiles[index]
        if not worker.get("ready") or profile is None:
            raise WorkerUnavailableError(
                f"worker {index} ({worker.get('device')}) is {worker.get('state')}; its "
                "platform is not known until it is ready (name a preset or a platform for a "
                "what-if answer)"
            )
        return profile

    def default_profile(self) -> PlatformProfile | None:
        if not self._workers or not self._workers[0].get("ready"):
            return None
        return self._profiles[0]


async def _serve(config: Mapping[str, Any], reader: asyncio.StreamReader) -> int:
    settings = Settings.load(config["settings"], environ={})
    if settings.malloc_tuning:
        # A replica forwards the same big RunMoE messages as the primary (process.py's
        # "server" row and bench/RESULTS.md say why); before its threads start.
        tune_malloc("server")
    metrics = Metrics(multiprocess_dir=os.environ[MULTIPROC_ENV])
    view = WorkerView()
    health_servicer = health.aio.HealthServicer()
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    await health_servicer.set(health.OVERALL_HEALTH, serving)
    await health_servicer.set(SERVICE_NAME, not_serving)
    limits = [
        ("grpc.max_receive_message_length", settings.max_send_message_bytes),
        ("grpc.max_send_message_length", settings.max_receive_message_bytes),
    ]
    channel = grpc.aio.insecure_channel(config["internal"], options=limits)
    forwarder = Forwarder(channel, service_methods(exclude=LOCAL_METHODS))
    selection = Selection(
        view,
        metrics,
        cache_bytes=settings.select_cache_mib * MIB,
        offload=Offload.from_settings(settings),
    )
    selection.measured = ForwardedMeasure(channel)  # the primary measures and caches
    # One set of per-method limits for this process's gRPC server and HTTP door.
    call_limits = Limits.from_settings(settings, metrics)
    stop = asyncio.Event()
    http: HttpDoor | None = None
    try:
        front = await start_front(
            settings,
            port=int(config["port"]),
            metrics=metrics,
            selection=selection,
            health_servicer=health_servicer,
            worker_methods=lambda registrar: registrar.add_generic_rpc_handlers((forwarder,)),
            reuseport=True,
            limits=call_limits,
        )
        http_fd = config.get("http_fd")
        if http_fd is not None:
            http = await open_http(
                settings,
                metrics=metrics,
                selection=selection,
                state=ForwardedState(channel, settings.token()),
                ready=lambda: view.ready and not stop.is_set(),
                limits=call_limits,
                sock=socket.socket(fileno=int(http_fd)),
            )
    except (OSError, RuntimeError) as exc:  # grpc answers a port it cannot bind with the latter
        print(json.dumps({"event": "failed", "reason": str(exc)}), flush=True)
        return 1
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def follow() -> None:
        """Apply the primary's state lines; their end (EOF) means the primary is gone."""
        while True:
            line = await reader.readline()
            if not line:
                stop.set()
                return
            state = json.loads(line).get("state")
            if isinstance(state, dict) and not stop.is_set():
                view.update(state)
                await health_servicer.set(SERVICE_NAME, serving if view.ready else not_serving)

    follower = asyncio.create_task(follow())
    settle_heap()
    print(json.dumps({"event": "listening", "pid": os.getpid(), "port": front.port}), flush=True)
    await stop.wait()
    await health_servicer.enter_graceful_shutdown()
    if http is not None:
        await asyncio.gather(front.server.stop(settings.grace_s), http.stop())
    else:
        await front.server.stop(settings.grace_s)
    follower.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await follower
    await channel.close()
    selection.offload.close()
    return 0


async def _main() -> int:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    first = await reader.readline()
    if not first:
        return 1
    config = json.loads(first)["config"]
    given = config["settings"]
    configure_logging(given.get("log_level", "INFO"), given.get("log_format", "json"))
    return await _serve(config, reader)


def main() -> int:
    """`python -m service.server.replica`: started by the primary, configured on stdin."""
    return asyncio.run(_main())


if __name__ == "__main__":
    sys.exit(main())
