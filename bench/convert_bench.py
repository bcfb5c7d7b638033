"""Conversion throughput: one Mixtral-8x7B MoE layer, and a whole synthetic checkpoint.

Part 1 (layer): a Mixtral-8x7B expert layer (8 experts, hidden 4096, intermediate 14336,
4-bit, group 128, symmetric) as a GPTQ and as an AWQ checkpoint stores it (per-expert
tensors, already on --device), converted into each target (TRITON, MARLIN) by each route:
`canonical` (reader -> one byte per code -> writer), `direct` (`service.formats.routes.direct`:
packed words to packed words in torch ops) and `triton` (the same routes' fused Triton
kernels, `service.formats.routes.gpu_repack`), each checked byte for byte against the canonical
result.
Each figure is the median of --rounds timings after one warm-up, timed with CUDA events on a
GPU. Throughput is checkpoint bytes read per second; the floor is the time the bytes read
plus the bytes written take at the device's copy bandwidth measured in the same run (a
1 GiB `copy_`, read + write counted), so `floor / time` is the fraction of memory bandwidth
the conversion reaches.

Part 2 (checkpoint): a synthetic 8-layer checkpoint of Mixtral's shape (GPTQ, 3 shards,
attention, norms, router and embeddings too), converted into each target by
`checkpoint.job.convert_checkpoint` (what `moe-control convert` and path-mode ConvertWeights
run); then converted again (the resume: every finished layer verified by SHA-256 and
kept). Beside it, the disk's read speed (O_DIRECT, so the page cache does not flatter it,
and buffered after evicting the files, as the conversion reads them), and what bounds the
CPU side: the process's CPU seconds over the cores, and the SHA-256 floor (every source and
output byte hashed once, at the measured one-core SHA-256 speed, over the cores).

    .venv/bin/python bench/convert_bench.py                 # CPU, everything
    .venv/bin/python bench/convert_bench.py --device cuda:0 --skip-checkpoint
    .venv/bin/python bench/convert_bench.py --quick         # smaller shapes, a smoke run
    scripts/gpu_convert_bench.sh                            # on the H200 (layer part)

Prints a Markdown table per part (also written to --markdown PATH) and, with --json, the
raw figures.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import mmap
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from bench import repack_variants
from service.formats import registry
from service.formats.canonical import QuantizedMoELayer
from service.formats.checkpoint import manifest
from service.formats.checkpoint.converter import registry_converter
from service.formats.checkpoint.job import convert_checkpoint
from service.formats.checkpoint.plan import plan_job
from service.formats.errors import ConversionUnsupported
from service.formats.io import safetensors
from service.formats.io.paths import DataRoot
from service.formats.readers import LAYOUTS, SourceQuantization, write_checkpoint
from service.formats.routes import direct
from service.formats.routes.canonical import canonical
from service.formats.synthetic.checkpoints import (
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


class Timer:
    """Seconds of one call: CUDA events on a GPU (device time, after a synchronize so the
    host's queue is empty), perf_counter on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.device.type != "cuda":
            began = time.perf_counter()
            fn()
            return time.perf_counter() - began
        torch.cuda.synchronize(self.device)
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        return float(start.elapsed_time(stop)) / 1000.0


def copy_bandwidth(device: torch.device, size: int = 1 << 30, rounds: int = 5) -> float:
    """Bytes moved per second (read + write) by a device-local copy of `size` bytes
    (median of `rounds`, after one warm-up)."""
    source = torch.empty(size, dtype=torch.uint8, device=device)
    source.fill_(1)
    target = torch.empty_like(source)
    timer = Timer(device)
    timer(lambda: target.copy_(source))
    times = [timer(lambda: target.copy_(source)) for _ in range(rounds)]
    return 2 * size / statistics.median(times)


def nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


ROUTES: dict[str, Callable[..., registry.ConvertedLayer | None]] = {
    "canonical": canonical,
    "direct": functools.partial(direct.try_direct, kernels=False),
    "triton": functools.partial(direct.try_direct, kernels=True),
    "table": repack_variants.try_table,
    "compiled": repack_variants.try_compiled,
}
"""Route name -> conversion of per-expert tensors (`direct.try_direct` answers None where it
has no route for the pair): `direct` runs the routes' torch transforms, `triton` their
fused Triton kernels (service/formats/routes/gpu_repack.py; on a CUDA device, else the same as
`direct`; the warm-up call compiles them), `table` the same with the generic table kernel
where a dedicated one replaced it (the int4 Marlin routes), `compiled` the torch transforms through
torch.compile (whose warm-up call compiles)."""


def identical(a: registry.ConvertedLayer, b: registry.ConvertedLayer) -> bool:
    """Same names in the same order, same dtypes, shapes and bytes, same descriptor."""
    if list(a.tensors) != list(b.tensors) or a.descriptor != b.descriptor:
        return False
    return all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        for x, y in zip(a.tensors.values(), b.tensors.values(), strict=True)
    )


def time_layer(
    *,
    source: str,
    target: str,
    route: str,
    tensors: dict[str, torch.Tensor],
    shape: dict[str, int],
    device: torch.device,
    rounds: int,
    reference: registry.ConvertedLayer | None,
) -> tuple[dict[str, Any], registry.ConvertedLayer | None]:
    """Median device seconds of `rounds` conversions after one warm-up (whose result is
    compared with `reference`, the canonical route's)."""
    quant = SourceQuantization(bits=4, group_size=shape["group_size"])
    fn = ROUTES[route]

    def once() -> registry.ConvertedLayer | None:
        return fn(source, tensors, quant, target, num_experts=shape["num_experts"])

    first = once()
    if first is None:
        return {"source": source, "target": target, "route": route, "skipped": "no route"}, None
    timer = Timer(device)
    times = [timer(once) for _ in range(rounds)]
    row: dict[str, Any] = {
        "source": source,
        "target": target,
        "route": route,
        "GB_in": nbytes(tensors) / GB,
        "GB_out": nbytes(first.tensors) / GB,
        "seconds": statistics.median(times),
        "min_s": min(times),
        "identical": "-" if reference is None else identical(first, reference),
    }
    return row, first


def finish_row(row: dict[str, Any], bandwidth: float) -> dict[str, Any]:
    if "skipped" in row:
        return row
    floor = (row["GB_in"] + row["GB_out"]) * GB / bandwidth
    return {
        "source": row["source"],
        "target": row["target"],
        "route": row["route"],
        "GB in": round(row["GB_in"], 3),
        "GB out": round(row["GB_out"], 3),
        "ms (median)": round(row["seconds"] * 1e3, 2),
        "ms (min)": round(row["min_s"] * 1e3, 2),
        "GB/s": round(row["GB_in"] / row["seconds"], 2),
        "floor ms": round(floor * 1e3, 3),
        "fraction of bandwidth": f"{100 * floor / row['seconds']:.1f} %",
        "identical to canonical": row["identical"],
    }


def bench_layer(quick: bool, device: torch.device) -> tuple[dict[str, int], QuantizedMoELayer]:
    """The layer both layer benches convert (this one and bench/repack_profile.py): the
    Mixtral-8x7B shape (QUICK: a smaller one), random int4 codes from seed 0, on `device`."""
    shape = QUICK if quick else MIXTRAL
    spec = SyntheticSpec(
        num_experts=shape["num_experts"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        group_size=shape["group_size"],
        fast=True,
    )
    print(f"building a {shape} layer ...", file=sys.stderr, flush=True)
    return shape, to_device(synthetic_layer(spec, torch.Generator().manual_seed(0)), device)


def layer_part(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    shape, layer = bench_layer(args.quick, device)
    bandwidth = copy_bandwidth(device)
    rows: list[dict[str, Any]] = []
    for source in args.sources:
        quant = SourceQuantization(bits=4, group_size=shape["group_size"])
        tensors = write_checkpoint(LAYOUTS[source], layer, quant, naming="mixtral")
        for target in args.targets:
            reference: registry.ConvertedLayer | None = None
            for route in args.routes:
                print(f"  {source} -> {target} ({route}) ...", file=sys.stderr, flush=True)
                try:
                    row, result = time_layer(
                        source=source,
                        target=target,
                        route=route,
                        tensors=tensors,
                        shape=shape,
                        device=device,
                        rounds=args.rounds,
                        reference=reference,
                    )
                except ConversionUnsupported as exc:
                    row, result = {"source": source, "target": target, "skipped": exc.reason}, None
                except Exception as exc:  # one failing route keeps the other routes' rows
                    failed = f"failed: {exc!r}"[:300]
                    row, result = (
                        {"source": source, "target": target, "route": route, "skipped": failed},
                        None,
                    )
                if route == "canonical":
                    reference = result
                del result
                rows.append(finish_row(row, bandwidth))
                # Each row as soon as it is measured (a run cut short keeps what it had).
                print(f"    {rows[-1]}", file=sys.stderr, flush=True)
            del reference
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


def disk_read_speed_buffered(paths: list[Path], limit: int = 2 << 30) -> float:
    """Bytes per second reading the files, evicted first, through the page cache (as the
    conversion and its source hashing read them): one sequential stream, 16 MB reads."""
    evict(paths)
    buffer = bytearray(16 << 20)
    total = 0
    began = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while total < limit and (count := os.readv(fd, [buffer])):
                total += count
        finally:
            os.close(fd)
    return total / (time.perf_counter() - began)


def sha256_speed(size: int = 256 << 20, rounds: int = 3) -> float:
    """Bytes per second of hashlib's SHA-256 on one core (best of `rounds`): the manifest
    hashes every source byte and every output byte once, so this bounds the CPU side."""
    data = bytearray(os.urandom(1 << 20)) * (size >> 20)
    best = float("inf")
    for _ in range(rounds):
        began = time.perf_counter()
        hashlib.sha256(data).digest()
        best = min(best, time.perf_counter() - began)
    return size / best


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


def process_cpu_seconds() -> float:
    """User + system CPU seconds of this process, all threads (robust to a loaded machine,
    where wall time mostly measures the other tenants)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


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


class CpuSplit:
    """Thread CPU seconds (`time.thread_time`) spent inside the whole-checkpoint pipeline's
    parts, summed over the threads: where a run's CPU seconds go. Installed by wrapping the
    module functions the pipeline calls (bench only; nothing in the service changes)."""

    #: label -> (module or class, attribute)
    PARTS: ClassVar[dict[str, tuple[Any, str]]] = {
        "sha256 outputs": (safetensors, "sha256_of"),
        "source files read + sha256": (manifest, "hash_file"),
        "page-cache writes": (safetensors.SafetensorsWriter, "_write"),
        "fsync + rename": (safetensors.SafetensorsWriter, "commit"),
    }

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()
        self._saved: list[tuple[Any, str, Any]] = []

    def timed(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            began = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.thread_time() - began
                with self._lock:
                    self.seconds[label] = self.seconds.get(label, 0.0) + spent

        return wrapper

    def __enter__(self) -> CpuSplit:
        for label, (owner, name) in self.PARTS.items():
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self.timed(label, original))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def text(self) -> str:
        return ", ".join(f"{k} {v:.2f}" for k, v in sorted(self.seconds.items()))


def checkpoint_part(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    shape = dict(QUICK if args.quick else MIXTRAL)
    # A smaller checkpoint where the disk or the time is short (the shared dev machine).
    for key in ("num_experts", "hidden_size", "intermediate_size"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
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
    disk_buffered = disk_read_speed_buffered(shards)
    disk_write = disk_write_speed(base)
    sha = sha256_speed()
    cores = len(os.sched_getaffinity(0))
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
        converter = (
            registry_converter(job)
            if args.checkpoint_route == "direct"
            else repack_variants.canonical_converter(job)
        )
        firsts, resumes, cpus, splits = [], [], [], []
        for attempt in range(args.checkpoint_rounds):
            print(f"  checkpoint -> {target} ({attempt + 1}) ...", file=sys.stderr, flush=True)
            shutil.rmtree(out, ignore_errors=True)
            evict(shards)
            split = CpuSplit() if args.cpu_split else None
            timed = split.timed("conversion", converter) if split else converter
            cpu = process_cpu_seconds()
            with split or contextlib.nullcontext():
                firsts.append(convert_checkpoint(job, converter=timed))
            cpus.append(process_cpu_seconds() - cpu)
            splits.append(split.text() if split else "")
            resumes.append(convert_checkpoint(job, converter=converter))
        # The run of median time stands for all of them.
        median = sorted(range(len(firsts)), key=lambda n: firsts[n].seconds)[len(firsts) // 2]
        first = firsts[median]
        again_s = statistics.median(r.seconds for r in resumes)
        # Reads and writes overlapped (max) or, on one disk, one after the other (sum).
        floor = max(first.bytes_in / disk, first.bytes_out / disk_write)
        serial = first.bytes_in / disk + first.bytes_out / disk_write
        # SHA-256 of every source file and every output tensor, spread over every core.
        sha_floor = (size + first.bytes_out) / sha / cores
        cpu = statistics.median(cpus)
        rows.append(
            {
                "target": target,
                "route": args.checkpoint_route,
                "GB_in": round(first.bytes_in / GB, 3),
                "GB_out": round(first.bytes_out / GB, 3),
                "seconds (median)": round(first.seconds, 2),
                "all s": " / ".join(f"{r.seconds:.2f}" for r in firsts),
                "CPU s (median)": round(cpu, 2),
                "CPU s / cores": round(cpu / cores, 2),
                "read s (buffered)": round(first.bytes_in / disk_buffered, 2),
                "sha256 s / cores": round(sha_floor, 2),
                "GB_per_s": round(first.bytes_in / first.seconds / GB, 3),
                "conversion_s": round(first.convert_seconds, 2),
                "disk_floor_s": round(floor, 2),
                "fraction_of_disk": round(floor / first.seconds, 3),
                "disk_serial_s": round(serial, 2),
                "fraction_of_serial": round(serial / first.seconds, 3),
                "resume_s (median)": round(again_s, 2),
                "resume_skipped": resumes[-1].layers_skipped,
                **({"CPU split s (that run)": splits[median]} if args.cpu_split else {}),
            }
        )
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    if not args.keep and args.workdir is None:
        shutil.rmtree(base, ignore_errors=True)
    return {
        "layers": args.layers,
        "shape": shape,
        "checkpoint_GB": round(size / GB, 3),
        "disk_read_GB_per_s": round(disk / GB, 3),
        "disk_read_buffered_GB_per_s": round(disk_buffered / GB, 3),
        "sha256_GB_per_s_per_core": round(sha / GB, 3),
        "cores": cores,
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
    parser.add_argument(
        "--routes", nargs="+", default=["canonical", "direct", "triton"], choices=list(ROUTES)
    )
    parser.add_argument("--rounds", type=int, default=5, help="median of this many timings")
    parser.add_argument(
        "--checkpoint-rounds", type=int, default=1, help="checkpoint part: runs per target"
    )
    parser.add_argument("--checkpoint-route", choices=["direct", "canonical"], default="direct")
    parser.add_argument("--layers", type=int, default=8, help="checkpoint part: decoder layers")
    parser.add_argument("--quick", action="store_true", help="smaller shapes (a smoke run)")
    parser.add_argument("--skip-layer", action="store_true")
    parser.add_argument("--skip-checkpoint", action="store_true")
    parser.add_argument("--num-experts", type=int, help="checkpoint part: experts per layer")
    parser.add_argument("--hidden-size", type=int, help="checkpoint part: hidden size")
    parser.add_argument("--intermediate-size", type=int, help="checkpoint part: intermediate")
    parser.add_argument("--workdir", help="checkpoint part: reuse/keep files here")
    parser.add_argument("--keep", action="store_true", help="keep the written checkpoints")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument(
        "--cpu-split", action="store_true", help="checkpoint part: thread CPU s per part"
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--markdown", help="also write the tables to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if "compiled" in args.routes:
        # Each expert's rows are a different view of the output: room for every variant
        # torch's guards may tell apart, so the compiled route never falls back to eager.
        torch._dynamo.config.cache_size_limit = 64
    results: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    where = f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)
        where = f"{results['gpu']}, {where}"
    report: list[str] = []
    if not args.skip_layer:
        results["layer"] = layer_part(args, device)
        part = results["layer"]
        report += [
            f"Layer {part['shape']} (4-bit, symmetric) on {part['device']} ({where}); copy "
            f"bandwidth {part['copy_GB_per_s']:.1f} GB/s; median of {args.rounds} after a "
            "warm-up\n",
            markdown(part["rows"]),
        ]
    if not args.skip_checkpoint:
        results["checkpoint"] = checkpoint_part(args, device)
        part = results["checkpoint"]
        report += [
            f"\nCheckpoint: {part['layers']} layers of {part['shape']}, "
            f"{part['checkpoint_GB']} GB, disk read "
            f"{part['disk_read_GB_per_s']} GB/s (O_DIRECT), "
            f"{part['disk_read_buffered_GB_per_s']} GB/s (buffered, evicted first), "
            f"write+fsync {part['disk_write_GB_per_s']} GB/s; SHA-256 "
            f"{part['sha256_GB_per_s_per_core']} GB/s a core, {part['cores']} cores; input "
            "evicted from the page cache first\n",
            markdown(part["rows"]),
        ]
    text = "\n".join(report) + "\n"
    print("\n" + text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
