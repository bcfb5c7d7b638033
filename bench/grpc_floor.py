#!/usr/bin/env python
"""gRPC's own floor on loopback, and what our server stack adds to an empty unary call.

bench/runmoe_overhead.py measures ListPlatformPresets (answered in process, 10 µs of
handler) at 1.4 ms of client wall on the H200 host: that is the floor every RunMoE pays
before any of our work. This bench asks where it comes from. It starts, side by side on
free loopback ports, servers that differ by one layer of our stack each:

* ``bare``: ``grpc.aio.server()`` with no options and one generic handler answering the
  presets reply (the same 906 bytes);
* ``options``: + our server's channel arguments (``Settings.grpc_options``: message sizes,
  keepalive, ``so_reuseport``) and ``maximum_concurrent_rpcs``;
* ``wrapped``: + the interceptor (``InterceptorChain``: metrics, limits, error mapping),
  registered the way front.py does (generic handler path);
* ``auth``: ``wrapped`` + a bearer token (the client sends it);
* ``registered``: ``wrapped`` + SelectBackend pre-registered with grpc's core, as front.py
  has it (grpc.aio keeps a pending request per pre-registered method);
* ``front``: the real public server (``start_front``: Selection, health, reflection, the
  registrar), /metrics on, ``gc.freeze`` after start, in an otherwise idle process;
* ``serve``: the real ``moe-control serve --devices cpu`` (a worker process, its pings, the
  tuned malloc), one server process, as runmoe_overhead starts it;
* ``serve2``: the same with ``--server-processes 2`` (a replica on the port with
  SO_REUSEPORT; the call may land on either process).

``tcp`` is no gRPC at all: a Python process answering one byte with the presets reply's
906 bytes over a loopback TCP socket (TCP_NODELAY), one wake-up of each process per
round trip: the host's own price of a hand-over, to set against gRPC's.

The client is runmoe_overhead's: a sync ``grpc.insecure_channel`` with its two
message-size options and the generated stub. Each call is timed in three ways, because the
gap between calls matters: ``b2b`` (calls back to back), ``gap`` (a 2 ms sleep before each
call, about what a /metrics scrape takes) and, for the real servers, ``scrape`` (a
/metrics scrape before each call, exactly what runmoe_overhead does). Targets and modes are
alternated in rounds; medians (and p90) per target and mode are printed, with the context
switches per call of the server process (all its threads; serve2's replica not counted)
and of this client.

gRPC reads ``GRPC_EXPERIMENTS`` when it is imported, so an A/B of its switches is two
runs; the servers started here inherit it. ``-event_engine_client,-event_engine_listener,
-event_engine_for_all_other_endpoints`` moves the sockets from EventEngine's own threads back
to the thread that polls the completion queue (bench/RESULTS.md: 16 -> 8 switches per call
in the server, 8 -> 1.6 in the client).

    .venv/bin/python bench/grpc_floor.py --rounds 6 --calls 50
    python3 bench/grpc_floor.py --targets bare,serve --rounds 10   # the H200 host
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import grpc  # noqa: E402

from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb  # noqa: E402
from service.api.generated.moe_control.v1 import (  # noqa: E402
    moe_control_service_pb2_grpc as pb_grpc,
)

METHOD = "/moe_control.v1.MoeControlService/ListPlatformPresets"
TOKEN = "grpc-floor-token"
#: In-process server layers, each one adding to the one before (see the module docstring).
LAYERS = ("bare", "options", "wrapped", "auth", "registered", "front")
#: Real servers: `moe-control serve` flags beyond runmoe_overhead's.
SERVES = {"serve": [], "serve2": ["--server-processes", "2"]}
#: Servers started with `--serve` in a subprocess of this script.
SUBPROCESS = (*LAYERS, "tcp")
MODES = ("b2b", "gap", "scrape")
GAP_S = 0.002


def _presets_reply() -> pb.ListPlatformPresetsResponse:
    from service.api.servicer import SelectionServicer as Selection

    return Selection(_NoWorkers(), _metrics(), cache_bytes=0).presets


class _NoWorkers:
    """A PlatformSource with no worker: ListPlatformPresets never asks it anything."""

    generation = 0

    def profile(self, index: int) -> Any:
        raise LookupError(index)

    def default_profile(self) -> None:
        return None


def _metrics() -> Any:
    from service.metrics import Metrics

    return Metrics()


def _serve_tcp() -> None:
    """Answer each byte received with the presets reply, on one connection, until EOF."""
    reply = _presets_reply().SerializeToString()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        print(f"port {listener.getsockname()[1]}", flush=True)
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while conn.recv(1):
                conn.sendall(reply)


async def _serve_layer(layer: str) -> None:
    """Serve ListPlatformPresets with the stack up to `layer`; print the port; run until
    stdin closes."""
    from service.settings import Settings

    settings = Settings(auth_token=TOKEN if layer == "auth" else None)
    reply = _presets_reply()
    metrics_url = ""
    if layer == "front":
        from grpc_health.v1 import health
        from prometheus_client import start_http_server

        from service.api.servicer import SelectionServicer as Selection
        from service.server.front import start_front

        metrics = _metrics()
        http, _ = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
        metrics_url = f"http://127.0.0.1:{http.server_port}/metrics"
        front = await start_front(
            settings,
            port=0,
            metrics=metrics,
            selection=Selection(_NoWorkers(), metrics),
            health_servicer=health.aio.HealthServicer(),
            worker_methods=lambda registrar: None,
            reuseport=False,
        )
        server, port = front.server, front.port
        gc.collect()
        gc.freeze()
    else:

        async def presets(request: Any, context: Any) -> pb.ListPlatformPresetsResponse:
            return reply

        handler = grpc.unary_unary_rpc_method_handler(
            presets,
            request_deserializer=pb.ListPlatformPresetsRequest.FromString,
            response_serializer=pb.ListPlatformPresetsResponse.SerializeToString,
        )
        if layer == "bare":
            server = grpc.aio.server()
        else:
            server = grpc.aio.server(
                options=settings.grpc_options(),
                maximum_concurrent_rpcs=settings.max_concurrent_rpcs or None,
            )
        if layer in ("bare", "options"):
            server.add_generic_rpc_handlers(
                (
                    grpc.method_handlers_generic_handler(
                        METHOD.split("/")[1], {"ListPlatformPresets": handler}
                    ),
                )
            )
        else:
            from service.api.interceptors.chain import InterceptorChain
            from service.api.interceptors.limits import Limits

            metrics = _metrics()
            registrar = InterceptorChain(
                metrics, token=settings.token(), limits=Limits.from_settings(settings, metrics)
            ).registrar(server)
            handlers = {"ListPlatformPresets": handler}
            if layer == "registered":
                from service.api.servicer import SelectionServicer as Selection

                selection = Selection(_NoWorkers(), metrics)
                handlers = {**selection.handlers(), **handlers}
            registrar.add_registered_method_handlers(METHOD.split("/")[1], handlers)
            registrar.install()
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
    print(f"port {port} {metrics_url}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(0)


def context_switches(pid: int) -> int:
    """Context switches of every thread of `pid` so far (Linux; 0 elsewhere): each is a
    thread going to sleep or being put off a CPU, so their count per call counts the
    hand-overs between threads that a call costs."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            text = status.read_text()
        except OSError:  # the thread ended
            continue
        for line in text.splitlines():
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                total += int(line.split()[1])
    return total


class Target:
    """One server under test and a client channel to it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.metrics_url = ""
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {TOKEN}"),) if name == "auth" else ()
        )
        if name in SERVES:
            from runmoe_overhead import start_server, wait_ready

            self.process, address, self.metrics_url = start_server("cpu", SERVES[name])
        else:
            self.process = subprocess.Popen(
                [sys.executable, __file__, "--serve", name],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert self.process.stdout is not None
            line = self.process.stdout.readline().split()
            if not line or line[0] != "port":
                self.process.kill()
                raise SystemExit(f"{name}: server did not start: {line}")
            address = f"127.0.0.1:{line[1]}"
            self.metrics_url = line[2] if len(line) > 2 else ""
        self.channel: grpc.Channel | None = None
        self.call: Callable[[], Any]
        if name == "tcp":
            self.call = self._tcp_client(address)
            return
        # runmoe_overhead's client, exactly.
        self.channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", 256 << 20),
                ("grpc.max_send_message_length", 256 << 20),
            ],
        )
        grpc.channel_ready_future(self.channel).result(timeout=60)
        if name in SERVES:
            wait_ready(self.channel)
        stub: Any = pb_grpc.MoeControlServiceStub(self.channel)  # type: ignore[no-untyped-call]
        self.call = lambda: stub.ListPlatformPresets(
            pb.ListPlatformPresetsRequest(), metadata=self.metadata
        )
        for _ in range(20):
            self.call()

    def _tcp_client(self, address: str) -> Callable[[], Any]:
        host, port = address.rsplit(":", 1)
        conn = socket.create_connection((host, int(port)))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        size = _presets_reply().ByteSize()
        self._socket = conn

        def call() -> bytes:
            conn.sendall(b"x")
            got = b""
            while len(got) < size:
                got += conn.recv(size - len(got))
            return got

        for _ in range(20):
            call()
        return call

    def modes(self) -> tuple[str, ...]:
        return MODES if self.metrics_url else MODES[:2]

    def measure(self, mode: str, calls: int) -> tuple[list[float], float, float]:
        """Client wall seconds per call, and the server's and this client's context
        switches per call (b2b only: a scrape or a sleep would count its own)."""
        pids = (self.process.pid, os.getpid())
        before = [context_switches(pid) for pid in pids]
        walls = []
        for _ in range(calls):
            if mode == "gap":
                time.sleep(GAP_S)
            elif mode == "scrape":
                with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
                    response.read()
            started = time.perf_counter()
            self.call()
            walls.append(time.perf_counter() - started)
        server, client = (
            (context_switches(pid) - b) / calls for pid, b in zip(pids, before, strict=True)
        )
        return walls, server, client

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        else:
            self._socket.close()
        if self.name in SERVES:
            self.process.send_signal(signal.SIGTERM)
        else:
            assert self.process.stdin is not None
            self.process.stdin.close()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def run(targets: list[str], rounds: int, calls: int) -> str:
    started = [Target(name) for name in targets]
    walls: dict[tuple[str, str], list[float]] = {}
    switches: dict[str, list[tuple[float, float]]] = {}
    try:
        for r in range(rounds):
            # Alternate the order each round so no target always follows the same one.
            order = started if r % 2 == 0 else started[::-1]
            for target in order:
                for mode in target.modes():
                    times, server, client = target.measure(mode, calls)
                    walls.setdefault((target.name, mode), []).extend(times)
                    if mode == "b2b":
                        switches.setdefault(target.name, []).append((server, client))
    finally:
        for target in started:
            target.close()
    lines = [
        f"ListPlatformPresets client wall, medians (p90) of {rounds} x {calls} calls per cell, "
        f"ms; grpcio {grpc.__version__}, {os.cpu_count()} CPUs, load "
        + " ".join(f"{x:.1f}" for x in os.getloadavg())
        + f", GRPC_EXPERIMENTS={os.environ.get('GRPC_EXPERIMENTS', '')!r}",
        "",
        "| server | " + " | ".join(MODES) + " | switches/call server, client (b2b) |",
        "|---|" + "---|" * (len(MODES) + 1),
    ]
    for name in targets:
        cells = []
        for mode in MODES:
            values = sorted(walls.get((name, mode), []))
            if not values:
                cells.append("–")
                continue
            p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
            cells.append(f"{statistics.median(values) * 1e3:.3f} ({p90 * 1e3:.3f})")
        server, client = (statistics.median(x) for x in zip(*switches[name], strict=True))
        cells.append(f"{server:.1f}, {client:.1f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--targets", default=",".join(("tcp", *LAYERS, *SERVES)))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--out", default=os.environ.get("OUT", ""))
    parser.add_argument("--serve", choices=SUBPROCESS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve == "tcp":
        _serve_tcp()
        return 0
    if args.serve:
        asyncio.run(_serve_layer(args.serve))
        return 0
    text = run([t for t in args.targets.split(",") if t], args.rounds, args.calls)
    print(text, flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "grpc_floor.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
