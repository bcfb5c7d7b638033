"""Load benchmark of the HTTP/JSON door on loopback: POST /v1/select's throughput and
latency, gRPC SelectBackend measured against the same server in the same run (the peer
figure), and POST /v1/select:matrix for configs x GPUs x rulesets.

Starts `moe-control serve` on free loopback ports (the server's own default process count
on the CPUs it is pinned to, as load_bench.py does; every one serves the HTTP door), checks
the first HTTP answer equals the library's decision, then:

1. drives POST /v1/select from `--client-processes` asyncio processes, each over its share
   of `--connections` keep-alive HTTP/1.1 connections (a minimal client on raw sockets:
   a few microseconds per call, so the figure is the server's), open loop at `--rate`
   (latency from each call's scheduled send time) or closed loop with `--rate 0`;
2. runs bench/load_bench.py against the same server with the same rate, connections,
   duration and pinning (gRPC SelectBackend, the same request);
3. times the matrix: `--matrix-configs` configs (the bundled examples and variants of them)
   x the first `--matrix-gpus` presets x every ruleset, `--matrix-rounds` times.

`--server-cpus` / `--client-cpus` pin the server (its children inherit it) and the clients.
`--profile FILE` runs the server's primary under cProfile and prints where its time went.

    .venv/bin/python bench/http_bench.py --rate 2000 --duration 10
    .venv/bin/python bench/http_bench.py --server-cpus 0,1 --client-cpus 2-5 --rate 2000

Figures and commands are in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import pstats
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from _common import (  # bench/_common.py (bench/ is on sys.path)
    cpu_list,
    load_summary,
    run_clients,
    start_pinned,
    tree_cpu_seconds,
    wait_for_start,
)
from _serve import listening, serve_command
from load_bench import SPEC

from service.oracle import select

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = [
    *sorted((ROOT / "service" / "http" / "static" / "examples").glob("*.json")),
    ROOT / "docs" / "examples" / "qwen2-moe-gptq-config.json",
]
#: Variants that make the matrix's rows differ as a fleet's would: (name suffix, the
#: quantization_config fields laid over the example's).
VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("g64", {"group_size": 64}),
    ("8bit", {"bits": 8}),
    ("actorder", {"desc_act": True}),
)


# ---------------------------------------------------------------------------------------
# The server


def start_server(
    extra: list[str], cpus: set[int] | None, profile: str | None
) -> tuple[subprocess.Popen[str], str, str]:
    # `serve_command` turns the HTTP door off (`--http-port 0`); a later flag wins.
    port = free_port()
    command = serve_command(
        "--log-level", "WARNING", "--http-port", str(port), *extra, processes=None
    )
    if profile:
        module = command.index("-m")
        command[module : module + 2] = ["-m", "cProfile", "-o", profile, "-m", "service.cli"]
    process = start_pinned(command, cpus)
    assert process.stdout is not None
    match = listening(process.stdout.readline())
    if match is None or match.group(3) is None:
        process.kill()
        raise SystemExit("server did not start with its HTTP door")
    return process, match.group(1), match.group(3)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def post(base: str, path: str, body: Any, timeout: float = 60) -> Any:
    request = urllib.request.Request(f"{base}{path}", data=json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def wait_ready(base: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/readyz", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit("the server never became ready")


# ---------------------------------------------------------------------------------------
# A client process: keep-alive HTTP/1.1 on raw asyncio streams


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def call(self, request: bytes) -> int:
        """Sends `request`, reads the whole answer; its status."""
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        await self.reader.readexactly(length)
        return status


def http_request(host: str, path: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _drive(job: dict[str, Any], start_at: Any, ready: Any) -> dict[str, Any]:
    url = urlsplit(job["base"])
    request = http_request(url.netloc, "/v1/select", job["body"])
    connections = [
        Connection(*await asyncio.open_connection(url.hostname, url.port))
        for _ in range(job["connections"])
    ]
    idle: asyncio.Queue[Connection] = asyncio.Queue()
    for connection in connections:
        idle.put_nowait(connection)
    for i in range(job["warmup"]):
        await connections[i % len(connections)].call(request)
    ready.set()
    await wait_for_start(start_at)

    latencies: list[float] = []
    errors: dict[str, int] = {}
    deadline = time.perf_counter() + job["duration"]

    async def one(scheduled: float) -> None:
        connection = await idle.get()
        try:
            status = await connection.call(request)
        finally:
            idle.put_nowait(connection)
        if status != 200:
            errors[str(status)] = errors.get(str(status), 0) + 1
            return
        latencies.append(time.perf_counter() - scheduled)

    async def closed_loop() -> None:
        async def stream() -> None:
            while time.perf_counter() < deadline:
                await one(time.perf_counter())

        await asyncio.gather(*(stream() for _ in connections))

    async def open_loop() -> None:
        interval = 1.0 / job["rate"]
        pending: set[asyncio.Task[None]] = set()
        next_send = time.perf_counter()
        while time.perf_counter() < deadline:
            delay = next_send - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(next_send))
            pending.add(task)
            task.add_done_callback(pending.discard)
            next_send += interval
        await asyncio.gather(*pending)

    cpu_before = time.process_time()
    started = time.perf_counter()
    await (open_loop() if job["rate"] else closed_loop())
    elapsed = time.perf_counter() - started
    cpu = time.process_time() - cpu_before
    for connection in connections:
        connection.writer.close()
    return {"latencies": latencies, "errors": errors, "elapsed": elapsed, "cpu": cpu}


def http_load(args: argparse.Namespace, base: str, server_pid: int) -> dict[str, Any]:
    spec = {**SPEC, "platform": args.preset}
    expected = select(spec, what_would_change=True).to_json()
    if post(base, "/v1/select", spec) != expected:
        raise SystemExit("the HTTP answer differs from the library's")
    k = args.client_processes
    jobs = [
        {
            "base": base,
            "body": json.dumps(spec).encode(),
            "connections": max(1, args.connections // k + (i < args.connections % k)),
            "rate": args.rate / k,
            "warmup": args.warmup // k,
            "duration": args.duration,
            "cpus": sorted(cpu_list(args.client_cpus) or ()),
        }
        for i in range(k)
    ]
    parts, server_cpu = run_clients(_drive, jobs, server_pid, args.duration)
    return {
        "mode": f"open loop at {args.rate:g}/s" if args.rate else "closed loop",
        "connections": args.connections,
        "client_processes": k,
        **load_summary(parts, server_cpu),
    }


def grpc_load(args: argparse.Namespace, target: str, server_pid: int) -> dict[str, Any]:
    """bench/load_bench.py against the same server, the same load."""
    command = [
        sys.executable,
        str(Path(__file__).with_name("load_bench.py")),
        "--target",
        target,
        "--server-pid",
        str(server_pid),
        "--rate",
        str(args.rate),
        "--concurrency",
        str(max(args.connections, 64)),
        "--channels",
        str(args.connections),
        "--client-processes",
        str(args.client_processes),
        "--duration",
        str(args.duration),
        "--warmup",
        str(args.warmup),
        "--preset",
        args.preset,
        "--json",
    ]
    if args.client_cpus:
        command += ["--client-cpus", args.client_cpus]
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=600)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


# ---------------------------------------------------------------------------------------
# The matrix


def matrix_configs(count: int) -> list[dict[str, Any]]:
    """`count` configs: the bundled examples, then variants of each in turn."""
    bases = [(path.stem, json.loads(path.read_text())) for path in EXAMPLES]
    configs = [{"name": name, "config": config} for name, config in bases]
    for suffix, overlay in VARIANTS:
        for name, config in bases:
            varied = copy.deepcopy(config)
            varied["quantization_config"].update(overlay)
            configs.append({"name": f"{name}-{suffix}", "config": varied})
    return configs[:count]


def matrix_timing(args: argparse.Namespace, base: str, server_pid: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"{base}/v1/platforms", timeout=10) as response:
        gpus = [p["name"] for p in json.loads(response.read())][: args.matrix_gpus]
    with urllib.request.urlopen(f"{base}/v1/rulesets", timeout=10) as response:
        rulesets = [r["name"] for r in json.loads(response.read())]
    configs = matrix_configs(args.matrix_configs)
    body = {"configs": configs, "gpus": gpus, "rulesets": rulesets}
    times = []
    cpu = []
    cells = 0
    for _ in range(args.matrix_rounds):
        cpu_before = tree_cpu_seconds(server_pid)
        started = time.perf_counter()
        answer = post(base, "/v1/select:matrix", body)
        times.append(time.perf_counter() - started)
        cpu.append(tree_cpu_seconds(server_pid) - cpu_before)
        cells = len(answer["cells"])
    warm = sorted(times[1:]) or times
    return {
        "configs": len(configs),
        "gpus": len(gpus),
        "rulesets": len(rulesets),
        "cells": cells,
        "first_ms": round(times[0] * 1e3, 1),
        "median_ms": round(statistics.median(warm) * 1e3, 1),
        "max_ms": round(max(warm) * 1e3, 1),
        "us_per_cell_median": round(statistics.median(warm) / cells * 1e6, 1),
        # the server's CPU (its process tree, /proc: clock ticks, so ±10 ms a round)
        "server_cpu_ms_median": round(statistics.median(cpu[1:] or cpu) * 1e3, 1),
        "rounds": len(times),
    }


# ---------------------------------------------------------------------------------------


def select_reference(preset: str, rounds: int = 2000) -> float:
    """The library's parse + decision of the bench's request, median µs in this process:
    how fast this machine is at the moment of the run (bench/RESULTS.md's oracle table took
    about 42 µs on a quiet dev box)."""
    spec = {**SPEC, "platform": preset}
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        select(spec)
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1e6, 1)


def print_profile(path: str, top: int = 25) -> None:
    stats = pstats.Stats(path)
    stats.sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=2000.0, help="calls/s in all (0: closed)")
    parser.add_argument("--connections", type=int, default=16, help="connections in all")
    parser.add_argument("--client-processes", type=int, default=1, help="client processes")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds")
    parser.add_argument("--warmup", type=int, default=1000, help="unmeasured calls first")
    parser.add_argument("--preset", default="a100", help="platform preset of the requests")
    parser.add_argument("--server-cpus", help="pin the server to these CPUs, e.g. 0,1")
    parser.add_argument("--client-cpus", help="pin the clients to these CPUs, e.g. 2-5")
    parser.add_argument("--no-grpc", action="store_true", help="skip the gRPC peer run")
    parser.add_argument("--matrix-configs", type=int, default=10)
    parser.add_argument("--matrix-gpus", type=int, default=20)
    parser.add_argument("--matrix-rounds", type=int, default=10)
    parser.add_argument("--profile", help="run the server under cProfile, stats to this file")
    parser.add_argument("--json", action="store_true", help="print the result as JSON only")
    parser.add_argument("server_args", nargs="*", help="extra `serve` flags (after --)")
    args = parser.parse_args(argv)
    process, target, base = start_server(args.server_args, cpu_list(args.server_cpus), args.profile)
    result: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "server_cpus": args.server_cpus or "any",
        "client_cpus": args.client_cpus or "any",
        "load_average_1m": round(os.getloadavg()[0], 2),
        "select_in_process_us": select_reference(args.preset),
    }
    try:
        wait_ready(base)
        result["http_select"] = http_load(args, base, process.pid)
        if not args.no_grpc:
            result["grpc_select"] = grpc_load(args, target, process.pid)
        result["matrix"] = matrix_timing(args, base, process.pid)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
    if args.profile:
        print_profile(args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
