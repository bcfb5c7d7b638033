"""Load benchmark of SelectBackend over real gRPC on loopback.

Starts `moe-control serve` as a subprocess on free loopback ports (or uses `--target`, which
must be a loopback address), then drives it from asyncio clients: `--concurrency` calls in
flight in all, over `--channels` connections (default: one per in-flight call, as that many
separate callers would), from `--client-processes` processes (the Python client costs about
as much CPU per call as the server; one process cannot load a multi-process server). Closed
loop by default; `--rate` sends at a fixed total rate instead and measures latency from each
call's scheduled send time, so a stalled server cannot hide its queue. Bounded by
`--requests` and `--duration`; loopback only.

Besides client-side throughput and latency percentiles it reports the server's CPU time per
call (every process of the server: primary, replicas, worker), the figure that does not
depend on how much CPU the client took. `--server-cpus` / `--client-cpus` pin the server
(its children inherit it) and the clients to CPU lists, so they do not share cores.

    .venv/bin/python bench/load_bench.py --rate 3000 --duration 20
    .venv/bin/python bench/load_bench.py --server-cpus 0,1 --client-cpus 2-7 \\
        --client-processes 4 --rate 3000 -- --server-processes 2

Figures and commands are in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import grpc
from _common import (  # bench/_common.py (bench/ is on sys.path)
    cpu_list,
    load_summary,
    run_clients,
    start_pinned,
    wait_for_start,
)
from _serve import listening, serve_command

from service.api.codecs import selection as codec
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.oracle import select

METHOD = "/moe_control.v1.MoeControlService/SelectBackend"
SPEC = {
    "hf_quantization_config": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": False,
        "sym": True,
    },
    "layer": {"num_experts": 60, "top_k": 4, "hidden_size": 2048, "intermediate_size": 1408},
}


def _loopback(target: str) -> bool:
    host = target.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def specs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """`--distinct` different requests (experts count varies), as many models would ask."""
    out = []
    for i in range(args.distinct):
        layer = {**SPEC["layer"], "num_experts": 60 + 4 * i}  # type: ignore[dict-item]
        out.append({**SPEC, "layer": layer, "platform": args.preset})
    return out


# ---------------------------------------------------------------------------------------
# The server


def start_server(extra: list[str], cpus: set[int] | None) -> tuple[subprocess.Popen[str], str]:
    # The server's own default process count (one per core it may use): what is measured.
    command = serve_command("--log-level", "WARNING", *extra, processes=None)
    process = start_pinned(command, cpus)
    assert process.stdout is not None
    line = process.stdout.readline()
    match = listening(line)
    if match is None:
        process.kill()
        raise SystemExit(f"server did not start: {line!r}")
    return process, match.group(1)


# ---------------------------------------------------------------------------------------
# A client process


async def _drive(job: dict[str, Any], start_at: Any, ready: Any) -> dict[str, Any]:
    payloads = [
        pb.SelectBackendRequest(spec_json=json.dumps(s)).SerializeToString() for s in job["specs"]
    ]
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [
        grpc.aio.insecure_channel(job["target"], options=options) for _ in range(job["channels"])
    ]
    calls = [channel.unary_unary(METHOD) for channel in channels]  # raw bytes in and out
    for channel in channels:
        await asyncio.wait_for(channel.channel_ready(), 10)
    for i in range(job["warmup"]):
        await calls[i % len(calls)](payloads[i % len(payloads)], timeout=30)
    ready.set()
    await wait_for_start(start_at)

    latencies: list[float] = []
    errors: dict[str, int] = {}
    budget = job["requests"]
    deadline = time.perf_counter() + job["duration"]
    issued = 0

    async def one(index: int, scheduled: float) -> None:
        try:
            await calls[index % len(calls)](payloads[index % len(payloads)], timeout=30)
        except grpc.aio.AioRpcError as error:
            errors[error.code().name] = errors.get(error.code().name, 0) + 1
            return
        latencies.append(time.perf_counter() - scheduled)

    async def stream(first: int) -> None:
        nonlocal issued
        index = first
        while issued < budget and time.perf_counter() < deadline:
            issued += 1
            await one(index, time.perf_counter())
            index += job["concurrency"]

    async def open_loop() -> None:
        nonlocal issued
        slots = asyncio.Semaphore(job["concurrency"])
        interval = 1.0 / job["rate"]
        pending: set[asyncio.Task[None]] = set()

        async def released(index: int, scheduled: float) -> None:
            try:
                await one(index, scheduled)
            finally:
                slots.release()

        next_send = time.perf_counter()
        while issued < budget and time.perf_counter() < deadline:
            await slots.acquire()
            delay = next_send - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(released(issued, next_send))
            issued += 1
            pending.add(task)
            task.add_done_callback(pending.discard)
            next_send += interval
        await asyncio.gather(*pending)

    cpu_before = time.process_time()
    started = time.perf_counter()
    if job["rate"]:
        await open_loop()
    else:
        await asyncio.gather(*(stream(i) for i in range(job["concurrency"])))
    elapsed = time.perf_counter() - started
    cpu = time.process_time() - cpu_before
    for channel in channels:
        await channel.close()
    return {"latencies": latencies, "errors": errors, "elapsed": elapsed, "cpu": cpu}


# ---------------------------------------------------------------------------------------


def run(args: argparse.Namespace, target: str, server_pid: int | None) -> dict[str, Any]:
    all_specs = specs(args)
    expected = select(all_specs[0]).to_json()
    request = pb.SelectBackendRequest(spec_json=json.dumps(all_specs[0]))
    with grpc.insecure_channel(target) as channel:
        raw = channel.unary_unary(METHOD)(request.SerializeToString(), timeout=10)
    if codec.select_response_to_json(pb.SelectBackendResponse.FromString(raw)) != expected:
        raise SystemExit("the server's answer differs from the library's")

    k = args.client_processes
    channels = args.channels or args.concurrency
    jobs = [
        {
            "target": target,
            "specs": all_specs,
            "channels": max(1, channels // k + (i < channels % k)),
            "concurrency": max(1, args.concurrency // k + (i < args.concurrency % k)),
            "rate": args.rate / k,
            "requests": args.requests // k,
            "warmup": args.warmup // k,
            "duration": args.duration,
            "cpus": sorted(cpu_list(args.client_cpus) or ()),
        }
        for i in range(k)
    ]
    parts, server_cpu = run_clients(_drive, jobs, server_pid, args.duration)
    return {
        "target": target,
        "mode": f"open loop at {args.rate:g}/s" if args.rate else "closed loop",
        "concurrency": args.concurrency,
        "channels": channels,
        "client_processes": k,
        "distinct_requests": args.distinct,
        **load_summary(parts, server_cpu),
        "server_cpus": args.server_cpus or "any",
        "client_cpus": args.client_cpus or "any",
        "cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="HOST:PORT of a running server (loopback only)")
    parser.add_argument("--server-pid", type=int, help="with --target: its pid, for CPU time")
    parser.add_argument("--concurrency", type=int, default=64, help="calls in flight (cap)")
    parser.add_argument(
        "--rate", type=float, default=0.0, help="open loop: calls per second in all (0: closed)"
    )
    parser.add_argument(
        "--channels", type=int, default=0, help="connections in all (0: one per in-flight call)"
    )
    parser.add_argument("--client-processes", type=int, default=1, help="client processes")
    parser.add_argument("--requests", type=int, default=200000, help="measured calls (cap)")
    parser.add_argument("--warmup", type=int, default=2000, help="unmeasured calls first")
    parser.add_argument("--duration", type=float, default=20.0, help="measured seconds (cap)")
    parser.add_argument("--preset", default="a100", help="platform preset of the requests")
    parser.add_argument("--distinct", type=int, default=1, help="different requests, in turn")
    parser.add_argument("--server-cpus", help="pin the server to these CPUs, e.g. 0,1")
    parser.add_argument("--client-cpus", help="pin the clients to these CPUs, e.g. 2-7")
    parser.add_argument("--json", action="store_true", help="print the result as JSON only")
    parser.add_argument("server_args", nargs="*", help="extra `serve` flags (after --)")
    args = parser.parse_args(argv)
    if args.target and not _loopback(args.target):
        parser.error("--target must be a loopback address (this benchmark stays on the host)")
    process = None
    target = args.target
    if target is None:
        process, target = start_server(args.server_args, cpu_list(args.server_cpus))
    try:
        _wait_ready(target)
        result = run(args, target, process.pid if process is not None else args.server_pid)
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(30)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>26}: {value}")
    return 0


def _wait_ready(target: str, timeout: float = 60.0) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    service = pb.DESCRIPTOR.services_by_name["MoeControlService"].full_name
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub: Any = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise SystemExit("the server never became ready")


if __name__ == "__main__":
    sys.exit(main())
