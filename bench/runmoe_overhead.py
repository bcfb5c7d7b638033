#!/usr/bin/env python
"""What RunMoE over gRPC adds to the forward: client, transport, server and device time.

Starts `moe-control serve` on free loopback ports (one server process, the devices given),
keeps one synthetic layer on the worker (ConvertWeights keep_loaded), then calls RunMoE by
layer id at each token count, one call at a time, and splits every call's wall time:

* client wall W: `stub.RunMoE` around the call (request serialisation, HTTP/2 on loopback,
  response parsing included);
* server handler H: the server's own `grpc_server_handling_seconds` for RunMoE, read from
  its /metrics before and after each call (the sum moves by exactly this call's time);
* device D: the reply's `device_time` (CUDA events around the forward on a GPU, the wall
  clock of the forward on a CPU worker).

`H - D` is the server's share (checks, tensors into shared-memory segments, the pipe to
the worker, host<->device copies, routing, the output back); `W - H` is the transport and
the client's protobuf work. An empty unary call (ListPlatformPresets, answered in process)
measured the same way gives gRPC's own floor on this machine.

    python bench/runmoe_overhead.py                      # CPU: small layer, EMULATION
    python bench/runmoe_overhead.py --shape tiny         # CPU: device time ~1 ms at M = 1
    python bench/runmoe_overhead.py --devices cuda:0 --shape qwen3 --backend HUMMING

Where the server's share goes: run the server under a sampling profiler, e.g.
`--server-prefix ".venv/bin/py-spy record -o prof.txt -f raw --subprocesses --"` (py-spy
installed by hand, not a dependency); the server is stopped with SIGINT so it writes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc
import torch
from _serve import listening, serve_command  # bench/ is on sys.path (above)

from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.client.convert import Connection, convert_layer_remote, header_for
from service.client.run import run_request
from service.formats.io.safetensors import tensor_bytes
from service.formats.io.streaming import FROM_TORCH, TensorSpec
from service.formats.readers import GPTQ, SourceQuantization, write_checkpoint
from service.formats.synthetic.checkpoints import SyntheticSpec, synthetic_layer

#: (experts, top_k, hidden, intermediate)
SHAPES = {
    "tiny": (8, 2, 256, 128),
    "small": (8, 2, 1024, 512),
    "qwen3": (128, 8, 2048, 768),
    "mixtral": (8, 2, 4096, 14336),
}


@dataclass
class Row:
    method: str
    tokens: int
    calls: int
    request_bytes: int
    response_bytes: int
    client_wall_ms: float
    client_wall_p90_ms: float
    server_ms: float
    device_ms: float
    server_overhead_ms: float
    transport_ms: float
    wall_minus_device_ms: float


def start_server(
    devices: str, extra: list[str], prefix: list[str] | None = None
) -> tuple[subprocess.Popen[str], str, str]:
    command = serve_command(
        "--log-level", "WARNING",
        # M = 4096 at a real hidden size is 16+ MiB a message each way (the default limit)
        "--max-receive-message-bytes", str(256 << 20), "--max-send-message-bytes", str(256 << 20),
        *extra, devices=devices, prefix=prefix or (),
    )  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    while line and prefix and listening(line) is None:
        line = process.stdout.readline()  # a profiler's own lines first
    match = listening(line)
    if match is None or match.group(2) is None:  # the bench reads the server's /metrics
        process.kill()
        raise SystemExit(f"server did not start: {line!r}")
    return process, match.group(1), match.group(2)


def wait_ready(channel: grpc.Channel, timeout: float = 300.0) -> None:
    """Until the service reports SERVING (its workers are up)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    check = health_pb2_grpc.HealthStub(channel).Check  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout
    request = health_pb2.HealthCheckRequest(service="moe_control.v1.MoeControlService")
    while check(request, timeout=10).status != health_pb2.HealthCheckResponse.SERVING:
        if time.monotonic() > deadline:
            raise SystemExit("the server's workers never became ready")
        time.sleep(0.1)


def anonymous_rss_mib(pid: int) -> float:
    """The process's anonymous resident memory (heap, mappings of its own; not files)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def handled_seconds(metrics_url: str, method: str) -> tuple[float, float]:
    """(sum, count) of grpc_server_handling_seconds for `method`, from /metrics."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    total = count = 0.0
    for line in text.splitlines():
        if f'grpc_method="{method}"' not in line:
            continue
        if line.startswith("grpc_server_handling_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("grpc_server_handling_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


def measure(
    call: Callable[[], Any], metrics_url: str, method: str, calls: int
) -> tuple[list[float], list[float], list[Any]]:
    """Per call: client wall seconds, server handler seconds, and the reply."""
    walls, servers, replies = [], [], []
    for _ in range(calls):
        before, n0 = handled_seconds(metrics_url, method)
        start = time.perf_counter()
        reply = call()
        walls.append(time.perf_counter() - start)
        after, n1 = handled_seconds(metrics_url, method)
        if n1 != n0 + 1:
            raise SystemExit(f"{method}: {n1 - n0} calls counted between scrapes, expected 1")
        servers.append(after - before)
        replies.append(reply)
    return walls, servers, replies


def keep_layer(address: str, shape: tuple[int, int, int, int], backend: str) -> str:
    experts, top_k, hidden, intermediate = shape
    spec = SyntheticSpec(
        num_experts=experts,
        top_k=top_k,
        hidden_size=hidden,
        intermediate_size=intermediate,
        group_size=128,
        fast=True,
        dtype=torch.bfloat16,
    )
    layer = synthetic_layer(spec, torch.Generator().manual_seed(0))
    tensors = write_checkpoint(GPTQ, layer, SourceQuantization(4, 128), naming="mixtral")
    wire = {
        name: (
            TensorSpec.of(name, FROM_TORCH[str(t.dtype).removeprefix("torch.")], t.shape),
            memoryview(tensor_bytes(t)),
        )
        for name, t in tensors.items()
    }
    deployment = {
        "hf_quantization_config": spec.quantization_config(),
        "layer": {
            "num_experts": experts,
            "top_k": top_k,
            "hidden_size": hidden,
            "intermediate_size": intermediate,
        },
    }
    header = header_for(
        deployment_json=json.dumps(deployment),
        backend=backend,
        keep_loaded=True,
        return_tensors=False,
    )
    result = convert_layer_remote(Connection(address, timeout=600), header, wire)
    assert result.summary is not None and result.summary.layer_id
    return result.summary.layer_id


def _ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def table(rows: list[Row]) -> str:
    head = (
        "| call | M | calls | request B | response B | client wall ms (p90) | server ms "
        "| device ms | server - device ms | transport + client ms | W - D ms |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r.method} | {r.tokens} | {r.calls} | {r.request_bytes:,} | "
            f"{r.response_bytes:,} | {r.client_wall_ms:.3f} ({r.client_wall_p90_ms:.3f}) | "
            f"{r.server_ms:.3f} | {r.device_ms:.3f} | {r.server_overhead_ms:.3f} | "
            f"{r.transport_ms:.3f} | {r.wall_minus_device_ms:.3f} |"
        )
    return "\n".join(lines)


def row_of(
    method: str, tokens: int, *, walls: list[float], servers: list[float], devices: list[float],
    sizes: tuple[int, int],
) -> Row:  # fmt: skip
    over = [s - d for s, d in zip(servers, devices, strict=True)]
    transport = [w - s for w, s in zip(walls, servers, strict=True)]
    beyond = [w - d for w, d in zip(walls, devices, strict=True)]
    p90 = sorted(walls)[min(len(walls) - 1, int(0.9 * len(walls)))]
    return Row(
        method, tokens, len(walls), sizes[0], sizes[1], _ms(walls), p90 * 1e3, _ms(servers),
        _ms(devices), _ms(over), _ms(transport), _ms(beyond),
    )  # fmt: skip


def measured_selection(
    stub: Any, shape: tuple[int, int, int, int], tokens: list[int], metrics_url: str
) -> str:
    """SelectBackend MEASURED on the serving worker for the layer's shape: the first call
    (times every backend), then the same call again (from the cache); a table per bucket."""
    from service.api.generated.moe_control.v1 import measured_pb2

    experts, top_k, hidden, intermediate = shape
    spec = {
        "hf_quantization_config": {
            "quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False,
        },
        "layer": {
            "num_experts": experts, "top_k": top_k, "hidden_size": hidden,
            "intermediate_size": intermediate,
        },
    }  # fmt: skip
    request = pb.SelectBackendRequest(
        spec_json=json.dumps(spec),
        policy=measured_pb2.SELECTION_POLICY_MEASURED,
        token_counts=tokens,
    )
    start = time.perf_counter()
    stub.SelectBackend(request, timeout=600)
    first = time.perf_counter() - start
    walls, servers, answers = measure(
        lambda: stub.SelectBackend(request, timeout=600), metrics_url, "SelectBackend", 20
    )
    answer = answers[-1]
    m = answer.measured
    lines = [
        f"SelectBackend MEASURED on {m.device_name}: first call {first:.2f} s; 20 repeats from "
        f"the cache ({all(a.measured.from_cache for a in answers)}): client wall median "
        f"{_ms(walls):.3f} ms, server handler median {_ms(servers) * 1e3:.0f} µs; "
        f"vLLM's choice: {answer.backend or '(fails)'}",
        "",
        "| M | fastest | µs | vLLM's choice µs | speedup | every backend µs |",
        "|---|---|---|---|---|---|",
    ]
    for b in m.buckets:
        each = ", ".join(
            f"{t.backend} {t.device_seconds * 1e6:.1f}" if t.HasField("device_seconds")
            else f"{t.backend} n/a"
            for t in b.timings
        )  # fmt: skip
        static = f"{b.static_seconds * 1e6:.1f}" if b.HasField("static_seconds") else "n/a"
        speedup = f"{b.speedup:.2f}x" if b.HasField("speedup") else ""
        lines.append(
            f"| {b.tokens} | {b.fastest_backend} | {b.fastest_seconds * 1e6:.1f} | {static} "
            f"| {speedup} | {each} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="cpu", help="the server's --devices")
    parser.add_argument("--shape", default="", help=f"{sorted(SHAPES)}; default small on CPU")
    parser.add_argument("--backend", default="", help="kept layer's backend; default: oracle's")
    parser.add_argument("--tokens", default="1,4096")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", default=os.environ.get("OUT", ""))
    parser.add_argument(
        "--measured", action="store_true", help="also SelectBackend policy MEASURED, twice"
    )
    parser.add_argument(
        "--server-prefix",
        default="",
        help="command the server runs under, e.g. 'py-spy record -o prof.svg --' (profiling)",
    )
    parser.add_argument(
        "--idle-s",
        type=float,
        default=0.0,
        help="then the server's anonymous RSS once idle this long (what its malloc keeps)",
    )
    parser.add_argument("serve_args", nargs="*", help="extra `serve` flags after --")
    args = parser.parse_args(argv)
    cpu = args.devices == "cpu"
    token_list = [int(t) for t in args.tokens.split(",")]
    shape = SHAPES[args.shape or ("small" if cpu else "qwen3")]
    backend = args.backend or ("EMULATION" if cpu else "")
    process, address, metrics_url = start_server(
        args.devices, args.serve_args, args.server_prefix.split()
    )
    rows: list[Row] = []
    memory = ""
    try:
        channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", 256 << 20),
                ("grpc.max_send_message_length", 256 << 20),
            ],
        )
        from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc

        stub: Any = pb_grpc.MoeControlServiceStub(channel)  # type: ignore[no-untyped-call]
        grpc.channel_ready_future(channel).result(timeout=60)
        wait_ready(channel)
        started = time.perf_counter()
        layer_id = keep_layer(address, shape, backend)
        print(f"layer {layer_id} kept in {time.perf_counter() - started:.1f} s", flush=True)

        empty = pb.ListPlatformPresetsRequest()
        for _ in range(5):
            stub.ListPlatformPresets(empty)
        walls, servers, replies = measure(
            lambda: stub.ListPlatformPresets(empty), metrics_url, "ListPlatformPresets", args.calls
        )
        rows.append(
            row_of(
                "ListPlatformPresets (empty)",
                0,
                walls=walls,
                servers=servers,
                devices=[0.0] * len(walls),
                sizes=(0, replies[0].ByteSize()),
            )
        )
        experts, _, hidden, _ = shape
        gen = torch.Generator().manual_seed(1)
        for tokens in token_list:
            x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
            logits = torch.randn(tokens, experts, generator=gen)
            request = run_request(x, layer_id=layer_id, router_logits=logits)
            for _ in range(3):  # JIT, workspaces, caches
                stub.RunMoE(request, timeout=600)

            def run_once(r: pb.RunMoERequest = request) -> Any:
                return stub.RunMoE(r, timeout=600)

            walls, servers, replies = measure(run_once, metrics_url, "RunMoE", args.calls)
            devices = [r.device_time.ToNanoseconds() / 1e9 for r in replies]
            rows.append(
                row_of(
                    f"RunMoE ({replies[0].backend})",
                    tokens,
                    walls=walls,
                    servers=servers,
                    devices=devices,
                    sizes=(request.ByteSize(), replies[0].ByteSize()),
                )
            )
            print(table(rows[-1:]).splitlines()[-1], flush=True)
        # What the server process keeps after the calls, and after a rest (Linux only).
        if Path(f"/proc/{process.pid}/status").exists():
            rss = [anonymous_rss_mib(process.pid)]
            if args.idle_s > 0:
                time.sleep(args.idle_s)
                rss.append(anonymous_rss_mib(process.pid))
            memory = "server anonymous RSS MiB after the calls / idle: " + " / ".join(
                f"{r:.1f}" for r in rss
            )
            print(memory, flush=True)
        measured_text = (
            measured_selection(stub, shape, token_list, metrics_url) if args.measured else ""
        )
        channel.close()
    finally:
        # py-spy writes its profile on SIGINT; the server stops cleanly on either.
        process.send_signal(signal.SIGINT if args.server_prefix else signal.SIGTERM)
        process.wait(60)
    text = table(rows)
    experts, top_k, hidden, intermediate = shape
    header = (
        f"RunMoE over loopback gRPC, devices {args.devices}, layer E={experts} k={top_k} "
        f"H={hidden} I={intermediate} int4 g128, medians of {args.calls} calls"
    )
    if memory:
        text += "\n\n" + memory
    print(f"\n{header}\n{text}")
    if measured_text:
        print("\n" + measured_text)
        text += "\n\n" + measured_text
    if args.out:
        from _common import write_results

        write_results(
            Path(args.out),
            "runmoe_overhead",
            header + "\n\n" + text,
            {"rows": [asdict(r) for r in rows], "shape": shape, "devices": args.devices},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
