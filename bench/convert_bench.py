"""Conversion throughput: one Mixtral-8x7B MoE layer, and a whole synthetic checkpoint.

Part 1 (layer): a Mixtral-8x7B expert layer (8 experts, hidden 4096, intermediate 14336,
4-bit, group 128, symmetric) as a GPTQ and as an AWQ checkpoint stores it, converted into
each target (TRITON, MARLIN) by the same code the service runs (`inline.convert_layer`:
reader -> canonical -> writer), on --device with the tensors already there. Throughput is
checkpoint bytes read per second; the floor is the time the bytes read plus the bytes
written take at the device's measured copy bandwidth, so `floor / time` is the fraction of
memory bandwidth the conversion reaches. Read (decode to canonical) and write (kernel layout)
are timed apart so it is clear which side to work on.

Part 2 (checkpoint): a synthetic 8-layer checkpoint of Mixtral's shape (GPTQ, 3 shards,
attention, norms, router and embeddings too), converted into each target by
`checkpoint.convert_checkpoint` (what `moe-control convert` and path-mode ConvertWeights
run); then converted again (the resume: every finished layer verified by SHA-256 and
kept). Beside it, the disk's read speed (O_DIRECT, so the page cache does not flatter it).

    .venv/bin/python bench/convert_bench.py                 # CPU, everything
    .venv/bin/python bench/convert_bench.py --device cuda:0 --skip-checkpoint
    .venv/bin/python bench/convert_bench.py --quick         # smaller shapes, a smoke run

Prints a Markdown table per part and, with --json, the raw figures.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from service.formats import registry
from service.formats.checkpoint import convert_checkpoint, plan_job
from service.formats.paths import DataRoot
from service.formats.readers import LAYOUTS, SourceQuantization, write_checkpoint
from service.formats.synthetic import (
    SyntheticSpec,
    synthetic_layer,
    to_device,
    write_synthetic_checkpoint,
)
from service.oracle import preset

GB = 1e9
MIXTRAL = {"num_experts": 8, "hidden_size": 4096, "intermediate_size": 14336, "group_size": 128}
QUICK = {"num_experts": 8, "hidden_size": 1024, "intermediate_size": 2048, "group_size": 128}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, size: int = 1 << 30, rounds: int = 5) -> float:
    """Bytes moved per second (read + write) by a device-local copy of `size` bytes."""
    source = torch.empty(size, dtype=torch.uint8, device=device)
    source.fill_(1)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(rounds):
        sync(device)
        began = time.perf_counter()
        target.copy_(source)
        sync(device)
        best = min(best, time.perf_counter() - began)
    return 2 * size / best


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@dataclass
class LayerFigure:
    source: str
    target: str
    bytes_in: int
    bytes_out: int
    read_s: float
    write_s: float

    @property
    def total_s(self) -> float:
        return self.read_s + self.write_s

    def row(self, bandwidth: float) -> dict[str, Any]:
        floor = (self.bytes_in + self.bytes_out) / bandwidth
        return {
            "source": self.source,
            "target": self.target,
            "GB_in": round(self.bytes_in / GB, 3),
            "GB_out": round(self.bytes_out / GB, 3),
            "read_s": round(self.read_s, 3),
            "write_s": round(self.write_s, 3),
            "total_s": round(self.total_s, 3),
            "GB_per_s": round(self.bytes_in / self.total_s / GB, 3),
            "floor_s": round(floor, 4),
            "fraction_of_bandwidth": round(floor / self.total_s, 4),
        }


def time_layer(
    *,
    source: str,
    target: str,
    tensors: dict[str, torch.Tensor],
    shape: dict[str, int],
    device: torch.device,
    rounds: int,
) -> LayerFigure:
    quant = SourceQuantization(bits=4, group_size=shape["group_size"])
    best_read = best_write = float("inf")
    out_bytes = 0
    for _ in range(rounds):
        sync(device)
        began = time.perf_counter()
        layer = registry.read_layer(source, tensors, quant, num_experts=shape["num_experts"])
        sync(device)
        middle = time.perf_counter()
        converted = registry.convert(layer, target, source=source)
        sync(device)
        ended = time.perf_counter()
        best_read = min(best_read, middle - began)
        best_write = min(best_write, ended - middle)
        out_bytes = nbytes(converted.tensors)
        del layer, converted
    return LayerFigure(source, target, nbytes(tensors), out_bytes, best_read, best_write)


def layer_part(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    shape = QUICK if args.quick else MIXTRAL
    spec = SyntheticSpec(
        num_experts=shape["num_experts"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        group_size=shape["group_size"],
        fast=True,
    )
    print(f"building a {shape} layer ...", file=sys.stderr, flush=True)
    layer = to_device(synthetic_layer(spec, torch.Generator().manual_seed(0)), device)
    bandwidth = copy_bandwidth(device)
    rows: list[dict[str, Any]] = []
    for source in args.sources:
        quant = SourceQuantization(bits=4, group_size=shape["group_size"])
        tensors = write_checkpoint(LAYOUTS[source], layer, quant, naming="mixtral")
        for target in args.targets:
            if target not in registry.TARGET_BACKENDS:
                rows.append({"source": source, "target": target, "skipped": "no writer yet"})
                continue
            print(f"  {source} -> {target} ...", file=sys.stderr, flush=True)
            try:
                figure = time_layer(
                    source=source,
                    target=target,
                    tensors=tensors,
                    shape=shape,
                    device=device,
                    rounds=args.rounds,
                )
            except registry.ConversionUnsupported as exc:
                rows.append({"source": source, "target": target, "skipped": exc.reason})
                continue
            rows.append(figure.row(bandwidth))
        del tensors
    return {"shape": shape, "device": str(device), "copy_GB_per_s": bandwidth / GB, "rows": rows}


def disk_read_speed(paths: list[Path], limit: int = 2 << 30) -> float:
    """Bytes per second reading the files with O_DIRECT (past the page cache)."""
    block = 16 << 20
    buffer = mmap.mmap(-1, block)
    total = 0
    began = time.perf_counter()
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            return float("nan")
        try:
            while total < limit:
                count = os.readv(fd, [buffer])
                total += count
                if count < block:
                    break
        finally:
            os.close(fd)
        if total >= limit:
            break
    return total / (time.perf_counter() - began)


def disk_write_speed(directory: Path, size: int = 1 << 30) -> float:
    """Bytes per second writing a file and fsyncing it (what a converted shard costs)."""
    block = os.urandom(16 << 20)
    path = directory / "write-speed.tmp"
    began = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(size // len(block)):
            os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - began
    path.unlink()
    return size / elapsed


def evict(paths: list[Path]) -> None:
    """Drop the files' clean pages from the page cache (no privileges needed), so the
    conversion reads them from the disk as a first run would."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def checkpoint_part(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    shape = QUICK if args.quick else MIXTRAL
    base = Path(args.workdir or tempfile.mkdtemp(prefix="convert-bench-"))
    model = base / "mixtral-gptq"
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
    if not (model / "config.json").exists():
        print(f"writing a {args.layers}-layer checkpoint to {model} ...", file=sys.stderr)
        write_synthetic_checkpoint(model, spec, device=str(device), keep_layers=False)
    shards = sorted(model.glob("*.safetensors"))
    size = sum(p.stat().st_size for p in shards)
    evict(shards)
    disk = disk_read_speed(shards)
    disk_write = disk_write_speed(base)
    rows: list[dict[str, Any]] = []
    for target in args.targets:
        out = base / f"out-{target.lower()}"
        shutil.rmtree(out, ignore_errors=True)
        if target not in registry.TARGET_BACKENDS:
            rows.append({"target": target, "skipped": "no writer yet"})
            continue
        job = plan_job(
            model,
            out,
            root=DataRoot.unconfined(),
            platform=preset("h200"),
            backend=target,
            device=str(device),
        )
        print(f"  checkpoint -> {target} ...", file=sys.stderr, flush=True)
        evict(shards)
        first = convert_checkpoint(job)
        again = convert_checkpoint(job)
        # Reads and writes overlapped (max) or, on one disk, one after the other (sum).
        floor = max(first.bytes_in / disk, first.bytes_out / disk_write)
        serial = first.bytes_in / disk + first.bytes_out / disk_write
        rows.append(
            {
                "target": target,
                "GB_in": round(first.bytes_in / GB, 3),
                "GB_out": round(first.bytes_out / GB, 3),
                "seconds": round(first.seconds, 2),
                "GB_per_s": round(first.bytes_in / first.seconds / GB, 3),
                "conversion_s": round(first.convert_seconds, 2),
                "disk_floor_s": round(floor, 2),
                "fraction_of_disk": round(floor / first.seconds, 3),
                "disk_serial_s": round(serial, 2),
                "fraction_of_serial": round(serial / first.seconds, 3),
                "resume_s": round(again.seconds, 2),
                "resume_skipped": again.layers_skipped,
            }
        )
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    if not args.keep and args.workdir is None:
        shutil.rmtree(base, ignore_errors=True)
    return {
        "layers": args.layers,
        "checkpoint_GB": round(size / GB, 3),
        "disk_read_GB_per_s": round(disk / GB, 3),
        "disk_write_GB_per_s": round(disk_write / GB, 3),
        "rows": rows,
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    keys: list[str] = []
    for row in rows:
        keys.extend(k for k in row if k not in keys)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(row.get(k, "")) for k in keys) + " |" for row in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sources", nargs="+", default=["gptq", "awq"])
    parser.add_argument("--targets", nargs="+", default=["TRITON", "MARLIN"])
    parser.add_argument("--rounds", type=int, default=2, help="best of this many timings")
    parser.add_argument("--layers", type=int, default=8, help="checkpoint part: decoder layers")
    parser.add_argument("--quick", action="store_true", help="smaller shapes (a smoke run)")
    parser.add_argument("--skip-layer", action="store_true")
    parser.add_argument("--skip-checkpoint", action="store_true")
    parser.add_argument("--workdir", help="checkpoint part: reuse/keep files here")
    parser.add_argument("--keep", action="store_true", help="keep the written checkpoints")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    results: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)
    if not args.skip_layer:
        results["layer"] = layer_part(args, device)
        part = results["layer"]
        print(
            f"\nLayer {part['shape']} on {part['device']}, copy bandwidth "
            f"{part['copy_GB_per_s']:.1f} GB/s\n"
        )
        print(markdown(part["rows"]))
    if not args.skip_checkpoint:
        results["checkpoint"] = checkpoint_part(args, device)
        part = results["checkpoint"]
        print(
            f"\nCheckpoint: {part['layers']} layers, {part['checkpoint_GB']} GB, disk read "
            f"{part['disk_read_GB_per_s']} GB/s (O_DIRECT), write+fsync "
            f"{part['disk_write_GB_per_s']} GB/s; input evicted from the page cache first\n"
        )
        print(markdown(part["rows"]))
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
