"""Helpers shared by the benchmark scripts.

Kept small on purpose. For the scripts that time MoE forwards on a device (the layer
builders live in gpu_suite.py): the two measured ceilings, a CUDA-graph timer that falls
back to plain launches when a backend cannot be captured, the relative error every table
reports, and writing a result file with the command that made it. (kernel_check.py has its
own copy of the ceilings; it imports the Triton kernel's internals, which change under
tuning, so moe_bench does not import it.) torch is imported where it is used, so the load
benches below, whose client processes import this module, do not load it.

For the load benches of a real server (load_bench.py: gRPC, http_bench.py: HTTP): CPU
lists and pinning, the CPU time of the server's process tree, client processes started
together at one instant, and the latency and throughput summary of what they measured.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: bf16 activations: products rounded to bf16 between the GEMMs give 2-6e-3 (peer_bench.md).
TOLERANCE = 1e-2


@dataclass(frozen=True)
class Timing:
    """A median time in microseconds and how it was taken ("graph", "eager" or "wall")."""

    us: float
    mode: str
    note: str = ""


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN anywhere in `out` gives NaN, which fails)."""
    import torch

    diff = out.to(torch.float64) - ref.to(torch.float64)
    norm = float(torch.linalg.norm(ref.to(torch.float64)))
    return float(torch.linalg.norm(diff)) / max(norm, 1e-30)


def time_forward(
    fn: Callable[[], Any], device: torch.device, *, rep_ms: int = 60, graph: bool = True
) -> tuple[Timing, torch.cuda.CUDAGraph | None]:
    """Median µs of `fn` with the L2 flushed before each run, and the captured graph.

    On CUDA: `fn` is captured in one CUDA graph and its replays timed by
    `triton.testing.do_bench` (which zeroes a 256 MB buffer before each replay, outside the
    events, so every replay reads its weights from HBM). A backend whose forward cannot be
    captured (a host synchronisation inside) is timed by do_bench on plain launches instead,
    which then includes launch gaps; the mode says which. Elsewhere: wall-clock median of a
    few runs (only the CPU smoke paths use that).
    """
    import torch

    if device.type != "cuda":
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        return Timing(sorted(times)[1], "wall"), None
    import triton

    fn()  # warm-up outside the capture: compiles, allocates workspaces
    torch.cuda.synchronize(device)
    note = ""
    if graph:
        try:
            stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.current_stream(device).wait_stream(stream)
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                fn()
            ms = triton.testing.do_bench(
                captured.replay, warmup=10, rep=rep_ms, return_mode="median"
            )
            return Timing(ms * 1e3, "graph"), captured
        except Exception as exc:  # a capture that failed leaves plain launches to time
            torch.cuda.synchronize(device)
            note = f"no graph: {type(exc).__name__}: {str(exc)[:80]}"
    ms = triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")
    return Timing(ms * 1e3, "eager", note), None


def ceilings(device: torch.device) -> tuple[float, float]:
    """(copy bandwidth in B/s counting bytes read + written, bf16 matmul FLOP/s), measured
    on `device` with do_bench medians: a 1 GiB device-to-device copy and an 8192^3 matmul
    on random data (zeros can run faster than real data)."""
    import torch
    import triton

    pair = [torch.empty(1 << 30, dtype=torch.uint8, device=device).random_()]
    pair.append(torch.empty_like(pair[0]))
    ms = triton.testing.do_bench(
        lambda: pair[1].copy_(pair[0]), warmup=25, rep=200, return_mode="median"
    )
    bandwidth = 2 * pair[0].numel() / (ms * 1e-3)
    pair.clear()  # give the 2 GiB back before the layers are built
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    return bandwidth, 2 * 8192**3 / (ms * 1e-3)


def command_line() -> str:
    """The command as typed (for the results file)."""
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])


def write_results(
    out_dir: Path | None, stem: str, markdown: str, payload: dict[str, Any]
) -> list[Path]:
    """Write `<stem>.md` (the command, then the table) and `<stem>.json`; the paths written."""
    if out_dir is None:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / f"{stem}.md"
    md.write_text(f"Command: `{command_line()}`\n\n{markdown}\n")
    js = out_dir / f"{stem}.json"
    js.write_text(json.dumps({"command": command_line(), **payload}, indent=1, default=str))
    return [md, js]


# ---------------------------------------------------------------------------------------
# Load benches of a real server


def cpu_list(text: str | None) -> set[int] | None:
    """'0,1' or '2-7' or '0,4-5' -> CPU numbers."""
    if not text:
        return None
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def start_pinned(command: list[str], cpus: set[int] | None) -> subprocess.Popen[str]:
    """`command` with its stdout piped, pinned to `cpus` (its children inherit it)."""

    def pin() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)

    # preexec_fn is safe here: no threads exist yet in this process.
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, preexec_fn=pin)  # noqa: PLW1509


def tree_cpu_seconds(root: int) -> float:
    """CPU time (user + system) of a process and all its descendants."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        times[pid] = (int(fields[11]) + int(fields[12])) / tick
    total = 0.0
    for pid, seconds in times.items():
        ancestor = pid
        while ancestor not in (0, 1, root) and ancestor in parents:
            ancestor = parents[ancestor]
        if ancestor == root:
            total += seconds
    return total


#: A client process's work: (its job, the shared start time, its ready event) -> its part
#: of the result: {"latencies": [s, ...], "errors": {code: n}, "elapsed": s, "cpu": s}.
Drive = Callable[[dict[str, Any], Any, Any], Awaitable[dict[str, Any]]]


async def wait_for_start(start_at: Any) -> None:
    """Wait for the start time the parent sets (seconds since the epoch), then for it."""
    while start_at.value == 0.0:
        await asyncio.sleep(0.005)
    await asyncio.sleep(max(0.0, start_at.value - time.time()))


def _client(drive: Drive, job: dict[str, Any], start_at: Any, ready: Any, results: Any) -> None:
    if job.get("cpus"):
        os.sched_setaffinity(0, job["cpus"])
    results.put(asyncio.run(drive(job, start_at, ready)))


def run_clients(
    drive: Drive, jobs: Sequence[dict[str, Any]], server_pid: int | None, duration: float
) -> tuple[list[dict[str, Any]], float | None]:
    """Start one client process per job (`drive` a module-level coroutine function), wait
    until each has warmed up and set its ready event, start them all at one instant, and
    collect their parts; with the server's CPU seconds over the measured time (its process
    tree; None without `server_pid`)."""
    context = multiprocessing.get_context("spawn")
    start_at = context.Value("d", 0.0)
    results = context.Queue()
    clients = []
    for job in jobs:
        ready = context.Event()
        process = context.Process(target=_client, args=(drive, job, start_at, ready, results))
        process.start()
        clients.append((process, ready))
    for _, ready in clients:
        if not ready.wait(120):
            raise SystemExit("a client process did not get ready")
    start_at.value = time.time() + 0.3
    time.sleep(0.3)
    server_before = tree_cpu_seconds(server_pid) if server_pid else 0.0
    parts = [results.get(timeout=duration + 120) for _ in clients]
    server_cpu = (tree_cpu_seconds(server_pid) - server_before) if server_pid else None
    for process, _ in clients:
        process.join(30)
    return parts, server_cpu


def latency_summary(latencies: Sequence[float]) -> dict[str, float]:
    """p50, p90, p99, max and mean of latencies in seconds, in milliseconds."""
    ordered = sorted(latencies)
    n = len(ordered)

    def pct(q: float) -> float:
        return round(ordered[min(n - 1, int(q * n))] * 1e3, 3) if n else 0.0

    return {
        "p50_ms": pct(0.50),
        "p90_ms": pct(0.90),
        "p99_ms": pct(0.99),
        "max_ms": round(ordered[-1] * 1e3, 3) if n else 0.0,
        "mean_ms": round(statistics.fmean(ordered) * 1e3, 3) if n else 0.0,
    }


def load_summary(parts: Sequence[dict[str, Any]], server_cpu: float | None) -> dict[str, Any]:
    """The client parts together: calls answered, errors by code, throughput, latency, and
    CPU per call of the server (every process of it) and of the clients."""
    latencies = [x for part in parts for x in part["latencies"]]
    errors: dict[str, int] = {}
    for part in parts:
        for code, count in part["errors"].items():
            errors[code] = errors.get(code, 0) + count
    elapsed = max(part["elapsed"] for part in parts)
    n = len(latencies)
    client_cpu = sum(part["cpu"] for part in parts)
    return {
        "requests": n,
        "errors": errors,
        "elapsed_s": round(elapsed, 2),
        "throughput_rps": round(n / elapsed) if n else 0,
        **latency_summary(latencies),
        "server_cpu_ms_per_request": round(server_cpu / n * 1e3, 4)
        if n and server_cpu is not None
        else None,
        "server_cores_busy": round(server_cpu / elapsed, 2) if server_cpu is not None else None,
        "client_cpu_ms_per_request": round(client_cpu / n * 1e3, 4) if n else None,
    }
