"""Load benchmark of SelectBackend over real gRPC on loopback.

Starts `moe-control serve` as a subprocess on free loopback ports (or uses `--target`, which
must be a loopback address), then drives it from an asyncio client with `--concurrency`
requests in flight, bounded by `--requests` and `--duration`. Reports throughput and the
client-side latency percentiles; the record is in bench/RESULTS.md.

    .venv/bin/python bench/load_bench.py --concurrency 64 --requests 60000 --duration 30
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import grpc

from service.api import codec
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


def start_server(extra: list[str]) -> tuple[subprocess.Popen[str], str]:
    command = [
        sys.executable,
        "-m",
        "service.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--devices",
        "cpu",
        "--log-level",
        "WARNING",
        *extra,
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    match = re.search(r"serving gRPC on (\S+?)(;|$)", line)
    if match is None:
        process.kill()
        raise SystemExit(f"server did not start: {line!r}")
    return process, match.group(1)


async def run(args: argparse.Namespace, target: str) -> dict[str, Any]:
    spec = {**SPEC, "platform": args.preset}
    payload = pb.SelectBackendRequest(spec_json=json.dumps(spec)).SerializeToString()
    expected = select(spec).to_json()
    channels = [grpc.aio.insecure_channel(target) for _ in range(args.channels)]
    calls = [ch.unary_unary(METHOD) for ch in channels]  # raw bytes in and out
    for channel in channels:
        await asyncio.wait_for(channel.channel_ready(), 10)
    answer = pb.SelectBackendResponse.FromString(await calls[0](payload, timeout=10))
    if codec.select_response_to_json(answer) != expected:
        raise SystemExit("the server's answer differs from the library's")

    latencies: list[float] = []
    errors: dict[str, int] = {}
    budget = args.warmup + args.requests
    issued = 0
    deadline = 0.0

    async def stream(index: int) -> None:
        nonlocal issued
        call = calls[index % len(calls)]
        while issued < budget and time.perf_counter() < deadline:
            issued += 1
            measured = issued > args.warmup
            start = time.perf_counter()
            try:
                await call(payload, timeout=30)
            except grpc.aio.AioRpcError as error:
                errors[error.code().name] = errors.get(error.code().name, 0) + 1
                continue
            if measured:
                latencies.append(time.perf_counter() - start)

    async def open_loop() -> None:
        """Send at a fixed rate (at most `concurrency` in flight); latency counts from the
        scheduled send time, so a stalled server cannot hide its queue."""
        nonlocal issued
        slots = asyncio.Semaphore(args.concurrency)
        interval = 1.0 / args.rate
        pending: set[asyncio.Task[None]] = set()

        async def one(scheduled: float, measured: bool) -> None:
            try:
                await calls[issued % len(calls)](payload, timeout=30)
            except grpc.aio.AioRpcError as error:
                errors[error.code().name] = errors.get(error.code().name, 0) + 1
                return
            finally:
                slots.release()
            if measured:
                latencies.append(time.perf_counter() - scheduled)

        next_send = time.perf_counter()
        while issued < budget and time.perf_counter() < deadline:
            await slots.acquire()
            delay = next_send - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            issued += 1
            task = asyncio.create_task(one(next_send, issued > args.warmup))
            pending.add(task)
            task.add_done_callback(pending.discard)
            next_send += interval
        await asyncio.gather(*pending)

    deadline = time.perf_counter() + args.duration
    started = time.perf_counter()
    if args.rate:
        await open_loop()
    else:
        await asyncio.gather(*(stream(i) for i in range(args.concurrency)))
    elapsed = time.perf_counter() - started
    for channel in channels:
        await channel.close()
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1e3

    measured_s = elapsed * len(latencies) / max(1, len(latencies) + args.warmup)
    return {
        "target": target,
        "mode": f"open loop at {args.rate:g}/s" if args.rate else "closed loop",
        "concurrency": args.concurrency,
        "channels": args.channels,
        "requests": len(latencies),
        "errors": errors,
        "elapsed_s": round(elapsed, 2),
        "throughput_rps": round(len(latencies) / measured_s) if latencies else 0,
        "p50_ms": round(pct(0.50), 3),
        "p90_ms": round(pct(0.90), 3),
        "p99_ms": round(pct(0.99), 3),
        "max_ms": round(latencies[-1] * 1e3, 3) if latencies else 0.0,
        "mean_ms": round(statistics.fmean(latencies) * 1e3, 3) if latencies else 0.0,
        "cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="HOST:PORT of a running server (loopback only)")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight (cap)")
    parser.add_argument(
        "--rate", type=float, default=0.0, help="open loop: send this many per second (0: closed)"
    )
    parser.add_argument("--channels", type=int, default=1, help="client channels (connections)")
    parser.add_argument("--requests", type=int, default=30000, help="measured requests (cap)")
    parser.add_argument("--warmup", type=int, default=1000, help="unmeasured requests first")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds (cap)")
    parser.add_argument("--preset", default="a100", help="platform preset of the request")
    parser.add_argument("--json", action="store_true", help="print the result as JSON only")
    parser.add_argument("server_args", nargs="*", help="extra `serve` flags (after --)")
    args = parser.parse_args(argv)
    if args.target and not _loopback(args.target):
        parser.error("--target must be a loopback address (this benchmark stays on the host)")
    process = None
    target = args.target
    if target is None:
        process, target = start_server(args.server_args)
    try:
        result = asyncio.run(run(args, target))
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(30)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>15}: {value}")
    return 0


if __name__ == "__main__":
    socket.setdefaulttimeout(30)
    sys.exit(main())
