"""Helpers shared by the benchmark scripts that time MoE forwards on a device.

Kept small on purpose: the layer builders live in gpu_suite.py (imported from there); this
module holds what several scripts need: the two measured ceilings, a CUDA-graph timer that
falls back to plain launches when a backend cannot be captured, the relative error every
table reports, and writing a result file with the command that made it. (kernel_check.py
has its own copy of the ceilings; it imports the Triton kernel's internals, which change
under tuning, so moe_bench does not import it.)
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
