"""Does a big request stall a server process? Health, readiness and a plain SelectBackend
timed over loopback while the largest allowed matrix is decided.

Starts a real `moe-control serve` (one server process by default: the matrix and the
probes meet in one event loop, the worst case), then, twice:

- **idle**: the probes alone for `--seconds`;
- **matrix**: a client process asks the largest matrix the limit allows (every preset x
  every ruleset x enough rows for MAX_MATRIX_CELLS cells) again and again, by turns over
  gRPC (SelectMatrix) and HTTP (`POST /v1/select:matrix`), each time with rows the server
  has not seen (so no cell is served from the answer cache), while the probes run.

The probes, one after another from this process, each on a connection of its own: gRPC
health `Check("")`, `GET /readyz`, and a plain SelectBackend (no what-would-change search;
a spec the cache has not seen, so it is decided). Only probes sent while a matrix was in
flight count in the matrix phase. The table: each probe's p50, p99 and max per phase, and
how long the matrices took.

    python bench/stall_bench.py [--processes 1] [--seconds 20] [--out DIR]
    python bench/stall_bench.py --doors http --server-path /path/to/other/checkout

`--server-path` serves another checkout's code (PYTHONPATH), e.g. the one before the matrix
left the event loop; `--doors http` asks the matrix over HTTP only (a server without
SelectMatrix).
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
from _common import latency_summary, write_results
from _serve import listening, serve_command
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc
from service.dataplane.matrix import MAX_MATRIX_CELLS
from service.oracle import PLATFORM_PRESETS, RULESETS, deployment_from_model_config

#: A quantized MoE config.json (Qwen3-30B-A3B's shape, GPTQ int4).
CONFIG: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "quantization_config": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": False,
        "sym": True,
    },
}
ROWS = MAX_MATRIX_CELLS // (len(PLATFORM_PRESETS) * len(RULESETS))
PROBES = ("grpc_health", "http_readyz", "grpc_select")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _config(round_: int, row: int) -> dict[str, Any]:
    """A row's config, unseen before: its expert size differs by round and row."""
    return {**CONFIG, "moe_intermediate_size": 128 * (1 + row + ROWS * round_)}


def _ask_matrices(address: str, http_url: str, doors: list[str], signals: Any) -> None:
    """The client process: the largest matrix, by turns over each door, until `stop`
    (`signals`: the in-flight and stop events and the queue the times go to)."""
    in_flight, stop, out = signals
    url = urlsplit(http_url)
    times: dict[str, list[float]] = {door: [] for door in doors}
    round_ = 0
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.MoeControlServiceStub(channel)
        while not stop.is_set():
            door = doors[round_ % len(doors)]
            configs = [_config(round_, row) for row in range(ROWS)]
            in_flight.set()
            started = time.perf_counter()
            if door == "grpc":
                models = [
                    pb.MatrixModel(
                        label=f"m{row}", spec_json=json.dumps(deployment_from_model_config(c))
                    )
                    for row, c in enumerate(configs)
                ]
                request = pb.SelectMatrixRequest(
                    models=models, gpus=list(PLATFORM_PRESETS), rulesets=list(RULESETS)
                )
                response = stub.SelectMatrix(request, timeout=300)
                cells = len(response.cells)
            else:
                body = {
                    "configs": [{"name": f"m{row}", "config": c} for row, c in enumerate(configs)],
                    "gpus": "all",
                    "rulesets": list(RULESETS),
                }
                connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=300)
                connection.request("POST", "/v1/select:matrix", body=json.dumps(body).encode())
                answer = connection.getresponse()
                payload = answer.read()
                connection.close()
                assert answer.status == 200, payload[:200]
                cells = len(json.loads(payload)["cells"])
            in_flight.clear()
            assert cells == ROWS * len(PLATFORM_PRESETS) * len(RULESETS), cells
            times[door].append(time.perf_counter() - started)
            round_ += 1
    out.put(times)


def _probe(seconds: float, address: str, http_url: str, in_flight: Any | None) -> dict[str, Any]:
    """Each probe in turn for `seconds`; latencies (only while a matrix is in flight when
    `in_flight` is given)."""
    url = urlsplit(http_url)
    latencies: dict[str, list[float]] = {name: [] for name in PROBES}
    options = [("grpc.use_local_subchannel_pool", 1)]
    with (
        grpc.insecure_channel(address, options=options) as health_channel,
        grpc.insecure_channel(address, options=options) as select_channel,
    ):
        health = health_pb2_grpc.HealthStub(health_channel)
        select = pb_grpc.MoeControlServiceStub(select_channel)
        connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=60)
        spec = deployment_from_model_config(CONFIG)
        n = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            name = PROBES[n % len(PROBES)]
            busy = in_flight is None or in_flight.is_set()
            started = time.perf_counter()
            if name == "grpc_health":
                health.Check(health_pb2.HealthCheckRequest(service=""), timeout=60)
            elif name == "http_readyz":
                try:
                    connection.request("GET", "/readyz")
                    connection.getresponse().read()
                except (http.client.HTTPException, ConnectionError):
                    # A stalled loop may close a kept-alive connection (its idle timer fires
                    # late): the probe connects again, the time it took counted.
                    connection.close()
                    connection.request("GET", "/readyz")
                    connection.getresponse().read()
            else:
                request = pb.SelectBackendRequest(spec_json=json.dumps({**spec, "id": n}))
                select.SelectBackend(request, timeout=60)
            took = time.perf_counter() - started
            if busy and (in_flight is None or in_flight.is_set()):
                latencies[name].append(took)
            n += 1
            time.sleep(0.005)
        connection.close()
    return {
        name: latency_summary(values) | {"n": len(values)} for name, values in latencies.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=1, help="server processes")
    parser.add_argument("--seconds", type=float, default=20.0, help="per phase")
    parser.add_argument("--doors", default="grpc,http", help="doors the matrix is asked by")
    parser.add_argument("--server-path", default=None, help="serve this checkout's code")
    parser.add_argument("--out", type=Path, default=None, help="write stall.md / stall.json")
    args = parser.parse_args()
    doors = [d.strip() for d in args.doors.split(",") if d.strip()]

    env = dict(os.environ)
    cwd = None
    if args.server_path:
        cwd = args.server_path
        env["PYTHONPATH"] = args.server_path
    server = subprocess.Popen(
        # `serve_command` turns the HTTP door off (`--http-port 0`); a later flag wins.
        serve_command(
            "--log-level", "WARNING", "--http-port", str(free_port()), processes=args.processes
        ),
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
    )
    try:
        assert server.stdout is not None
        match = listening(server.stdout.readline().strip())
        assert match is not None, "the server did not start"
        address, http_url = match.group(1), match.group(3)
        server.stdout.readline()  # "ready"
        idle = _probe(args.seconds, address, http_url, None)

        context = multiprocessing.get_context("spawn")
        in_flight, stop, out = context.Event(), context.Event(), context.Queue()
        client = context.Process(
            target=_ask_matrices, args=(address, http_url, doors, (in_flight, stop, out))
        )
        client.start()
        busy = _probe(args.seconds, address, http_url, in_flight)
        stop.set()
        times = out.get(timeout=600)
        client.join(60)
    finally:
        server.terminate()
        server.wait(30)

    cells = ROWS * len(PLATFORM_PRESETS) * len(RULESETS)
    lines = [
        f"{cells} cells a matrix ({ROWS} rows x {len(PLATFORM_PRESETS)} presets x "
        f"{len(RULESETS)} rulesets), {args.processes} server process(es), "
        f"{os.cpu_count()} CPUs",
        "",
        "| probe | idle p50 / p99 / max ms | matrix in flight p50 / p99 / max ms | n |",
        "| --- | --- | --- | --- |",
    ]
    for name in PROBES:
        a, b = idle[name], busy[name]
        lines.append(
            f"| {name} | {a['p50_ms']:.2f} / {a['p99_ms']:.2f} / {a['max_ms']:.2f} | "
            f"{b['p50_ms']:.2f} / {b['p99_ms']:.2f} / {b['max_ms']:.2f} | {b['n']} |"
        )
    for door, values in times.items():
        shown = ", ".join(f"{v:.2f}" for v in values)
        lines.append(f"\nmatrix over {door}: {len(values)} asked, seconds each: {shown}")
    markdown = "\n".join(lines)
    print(markdown)
    write_results(
        args.out, "stall", markdown, {"idle": idle, "matrix": busy, "matrix_seconds": times}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
