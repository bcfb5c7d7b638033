"""Whole-checkpoint conversion throughput with 1 and 2 GPU workers, through the real server.

A synthetic checkpoint of Mixtral-8x7B's shape (8 experts, hidden 4096, intermediate 14336,
GPTQ int4 group 128, 3 shards, with attention, norms, router and embeddings; `--layers`
decoder layers, codes drawn directly: `SyntheticSpec(fast=True)`) is converted by path-mode
ConvertWeights into each `--targets` backend, against `moe-control serve --devices cuda:0`
(one worker) and `--devices cuda:0,cuda:1` (two workers: the server spreads the layers over
both, dataplane/spread.py). Each configuration converts `--rounds` times into a fresh
directory; the table shows the best and the median. Throughput = checkpoint bytes read per
second of wall time seen by the client (the call's whole life: planning, every layer,
copies, source hashing, index and manifest). The one- and two-worker outputs are compared
(the manifests, which hold every tensor's SHA-256, must be byte-equal).

The data lives under `--root` (default: /dev/shm when it has room for the checkpoint and two
outputs, else the temp directory), because on one local disk both configurations wait on the
same disk (bench/RESULTS.md measured the one-GPU path at the disk's speed) and the figure
would say nothing about the GPUs.

    python bench/multi_gpu_bench.py                       # 8 layers, TRITON and MARLIN
    python bench/multi_gpu_bench.py --layers 4 --rounds 1 --targets TRITON
    python bench/multi_gpu_bench.py --quick               # small shapes: a smoke run (CPU ok)

Prints a Markdown table; `--out DIR` also writes it and the raw figures (JSON) there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from _serve import listening, serve_command  # bench/_serve.py (bench/ is on sys.path)

from service.client.convert import Connection, convert_checkpoint_remote, header_for
from service.formats.checkpoint.plan import MANIFEST_NAME
from service.formats.synthetic.checkpoints import SyntheticSpec, write_synthetic_checkpoint

GB = 1e9
MIXTRAL = {"num_experts": 8, "hidden_size": 4096, "intermediate_size": 14336, "group_size": 128}
QUICK = {"num_experts": 8, "hidden_size": 512, "intermediate_size": 1024, "group_size": 128}


class Server:
    """`moe-control serve` on a free loopback port, with its stderr kept for the logs."""

    def __init__(self, devices: str, root: Path, extra: list[str]) -> None:
        command = serve_command("--data-root", str(root), *extra, devices=devices, metrics=False)
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.stderr: list[str] = []
        assert self.process.stderr is not None and self.process.stdout is not None
        stderr = self.process.stderr
        threading.Thread(target=lambda: self.stderr.extend(stderr), daemon=True).start()
        line = self.process.stdout.readline()
        match = listening(line)
        if match is None:
            self.stop()
            raise RuntimeError(f"server did not start: {line!r}\n{''.join(self.stderr[-40:])}")
        self.address = match.group(1)

    def wait_workers(self, count: int, timeout: float = 300.0) -> None:
        import grpc

        from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
        from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc

        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as channel:
            stub = pb_grpc.MoeControlServiceStub(channel)
            while time.monotonic() < deadline:
                with_ready = stub.ListWorkers(pb.ListWorkersRequest(), timeout=10).ready_workers
                if with_ready >= count:
                    return
                time.sleep(0.5)
        raise RuntimeError(f"{count} workers not ready in {timeout:g} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def pick_root(wanted: str | None, need: int) -> tuple[Path, str]:
    if wanted:
        return Path(wanted), wanted
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > need:
        return Path(tempfile.mkdtemp(prefix="multi-gpu-bench-", dir=shm)), "/dev/shm (RAM)"
    base = Path(tempfile.mkdtemp(prefix="multi-gpu-bench-"))
    return base, f"{tempfile.gettempdir()} (disk: /dev/shm too small)"


def convert(
    server: Server, target: str, out: str, workers: int, source: str = "model"
) -> dict[str, Any]:
    events: list[dict[str, Any]] = []
    header = header_for(backend=target, checkpoint=(source, out))
    logged_before = len(spread_lines(server))
    done_before = len(done_lines(server))
    began = time.perf_counter()
    summary = convert_checkpoint_remote(
        Connection(server.address, timeout=1800), header, events.append
    )
    seconds = time.perf_counter() - began
    deadline = time.monotonic() + 5  # the log line may still be on its way through the pipe
    while len(done_lines(server)) <= done_before:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    spread = [json.loads(line) for line in spread_lines(server)[logged_before:]]
    done = [json.loads(line) for line in done_lines(server)[done_before:]]
    return {
        "seconds": seconds,
        "bytes_in": summary.bytes_in,
        "bytes_out": summary.bytes_out,
        "layers": summary.layers_converted,
        "device_s": summary.device_time.ToNanoseconds() / 1e9,
        "ranges_by_worker": _count(spread[-1]["workers"]) if workers > 1 and spread else None,
        "layers_by_worker": spread[-1].get("layers_by_worker") if workers > 1 and spread else None,
        "progress_events": len(events),
        # Worker seconds per stage, summed over layers and workers (the server's log line).
        "stage_seconds": done[-1].get("stage_seconds", {}) if done else {},
    }


def spread_lines(server: Server) -> list[str]:
    """The server's log lines of spread conversions (which worker ran each range)."""
    return [line for line in list(server.stderr) if "convert_spread" in line]


def done_lines(server: Server) -> list[str]:
    """The server's log lines of finished checkpoint conversions (with stage seconds)."""
    return [
        line
        for line in list(server.stderr)
        if '"convert_spread"' in line or '"convert_checkpoint"' in line
    ]


def _count(indices: list[int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for index in indices:
        out[str(index)] = out.get(str(index), 0) + 1
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--targets", nargs="+", default=["TRITON", "MARLIN"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--root", help="where the checkpoint and outputs go")
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    parser.add_argument("--devices", default="cuda:0,cuda:1", help="the two-worker devices")
    parser.add_argument("--out", help="write the table and the JSON here")
    args = parser.parse_args()

    two = [d for d in args.devices.split(",") if d]
    if two[0].startswith("cuda") and torch.cuda.device_count() < len(two):
        print(f"needs {len(two)} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    shape = QUICK if args.quick else MIXTRAL
    spec = SyntheticSpec(
        num_layers=args.layers,
        num_experts=shape["num_experts"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        group_size=shape["group_size"],
        vocab_size=32000,
        shards=3,
        fast=True,
    )
    per_layer = 3 * shape["num_experts"] * shape["hidden_size"] * shape["intermediate_size"] // 2
    root, storage = pick_root(args.root, int(per_layer * args.layers * 3.5))
    model = root / "model"
    began = time.perf_counter()
    if not (model / "config.json").exists():
        write_synthetic_checkpoint(model, spec, device=two[0], keep_layers=False)
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    warm = dataclasses.replace(
        spec, num_layers=2 * len(two), **{k: v for k, v in QUICK.items() if k != "num_experts"}
    )
    write_synthetic_checkpoint(root / "warm", warm, device=two[0], keep_layers=False)
    print(
        f"checkpoint: {args.layers} layers, {size / GB:.2f} GB on {storage} "
        f"(written in {time.perf_counter() - began:.1f} s)",
        file=sys.stderr,
        flush=True,
    )

    configs = [(1, two[0]), (len(two), ",".join(two))]
    results: list[dict[str, Any]] = []
    try:
        for workers, devices in configs:
            server = Server(devices, root, ["--log-level", "INFO"])
            try:
                server.wait_workers(workers)
                for target in args.targets:  # every worker imports and warms up first
                    shutil.rmtree(root / "warm-out", ignore_errors=True)
                    convert(server, target, "warm-out", workers, source="warm")
                shutil.rmtree(root / "warm-out", ignore_errors=True)
                for target in args.targets:
                    runs = []
                    for number in range(args.rounds):
                        out = f"out-{target.lower()}-{workers}-{number}"
                        shutil.rmtree(root / out, ignore_errors=True)
                        run = convert(server, target, out, workers)
                        print(
                            f"  {target} x{workers} round {number}: {run['seconds']:.2f} s",
                            file=sys.stderr,
                            flush=True,
                        )
                        runs.append(run)
                        manifest = (root / out / MANIFEST_NAME).read_bytes()
                        shutil.rmtree(root / out, ignore_errors=True)
                    results.append(
                        {
                            "target": target,
                            "workers": workers,
                            "devices": devices,
                            "runs": runs,
                            "manifest": manifest.decode(),
                        }
                    )
            finally:
                server.stop()
    finally:
        shape_name = "small (--quick)" if args.quick else "Mixtral-8x7B"
        rows = table(results, args.layers, size, f"{shape_name} shape, on {storage}")
        print(rows)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            Path(args.out, "multi_gpu_bench.md").write_text(rows + "\n")
            for result in results:
                result.pop("manifest", None)
            Path(args.out, "multi_gpu_bench.json").write_text(json.dumps(results, indent=1))
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    return 0


def table(results: list[dict[str, Any]], layers: int, size: int, where: str) -> str:
    lines = [
        f"Checkpoint: {layers} layers, {size / GB:.2f} GB, {where}.",
        "",
        "| target | GPU workers | GB in | best s | median s | GB/s (best) | speedup "
        "| layers (ranges) per worker | output = 1-worker output |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    single = {r["target"]: r for r in results if r["workers"] == 1}
    for result in results:
        times = [run["seconds"] for run in result["runs"]]
        best = min(times)
        gb = result["runs"][0]["bytes_in"] / GB
        base = single.get(result["target"])
        speedup = min(run["seconds"] for run in base["runs"]) / best if base else float("nan")
        same = (
            "-"
            if result["workers"] == 1 or base is None
            else ("yes" if result["manifest"] == base["manifest"] else "NO")
        )
        ranges = result["runs"][0]["ranges_by_worker"] or {"0": 1}
        by_layer = result["runs"][0].get("layers_by_worker") or {"0": layers}
        spread = ", ".join(
            f"{w}: {by_layer.get(w, 0)} ({ranges.get(w, 0)})"
            for w in sorted(set(ranges) | set(by_layer))
        )
        lines.append(
            f"| {result['target']} | {result['workers']} ({result['devices']}) | {gb:.2f} "
            f"| {best:.2f} | {statistics.median(times):.2f} | {gb / best:.2f} | {speedup:.2f}x "
            f"| {spread} | {same} |"
        )
    lines += ["", *stage_table(results)]
    return "\n".join(lines)


#: The stages of a conversion, in the order a layer goes through them.
STAGES = (
    "to_device",
    "repack",
    "to_host",
    "convert",
    "wait_write",
    "write_hash",
    "fsync_rename",
    "journal",
    "copy_rest",
    "hash_sources",
)


def stage_table(results: list[dict[str, Any]]) -> list[str]:
    """Worker seconds per stage of each configuration's best round (summed over layers and
    workers: with two workers they add up to more than the wall time). `convert` is
    to_device + repack + to_host; `write_hash` writes and SHA-256s the output at once;
    `wait_write` is the converting thread waiting for the previous layer's write."""
    lines = [
        "Worker seconds per stage (best round, summed over layers and workers):",
        "",
        "| target | workers | wall s | " + " | ".join(STAGES) + " |",
        "|---|---|---|" + "---|" * len(STAGES),
    ]
    for result in results:
        run = min(result["runs"], key=lambda r: r["seconds"])
        stages = run.get("stage_seconds") or {}
        cells = " | ".join(f"{float(stages[s]):.2f}" if s in stages else "-" for s in STAGES)
        lines.append(
            f"| {result['target']} | {result['workers']} | {run['seconds']:.2f} | {cells} |"
        )
    return lines


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
