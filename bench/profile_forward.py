#!/usr/bin/env python
"""Per-kernel device time of our TRITON MoE forward inside its CUDA graph.

Where the time of a forward goes, graph node by graph node (bench/KERNEL_NOTES.md reads
these tables). For each layer shape, token count M and kernel variant this script

1. checks the forward against the fp32 reference (EMULATION's `forward_fp32` over the same
   random TRITON-layout layer, bench/kernel_check.py's `make_layer`): output and
   intermediate NaN-poisoned first, every element finite, ||out - ref|| / ||ref|| under
   bench/_common.py's tolerance (1e-2, bf16);
2. captures the whole forward in one CUDA graph and takes its median replay time with the
   L2 flushed before each replay (bench/_common.py's `time_forward`, as moe_bench does);
3. replays that graph under torch.profiler (CUDA activity), each replay after an L2 flush by
   a uniquely named kernel that splits the trace into replays, and reports per graph node
   (alignment kernels, memsets, w13, w2, casts) the median device time, the median gap
   before it (launch latency inside the graph), and the median device span first-start to
   last-end; the graph's output is checked again after the replays.

Variants: `shipped` (what the dispatcher picks today: the decode kernels for few routes per
expert, else the tuned table, else the prefill heuristic), `prefill` (the prefill heuristic,
when it differs) and `decode` (the decode kernels' default tiles); `--sweep` adds a few
alternative decode tiles at M=1.

    PYTHONPATH=. python bench/profile_forward.py [--shapes qwen3 mixtral] [--tokens 1 4]
        [--variants shipped prefill decode] [--sweep] [--out DIR] [--budget-s 170]
    PYTHONPATH=. python bench/profile_forward.py --smoke   # CPU, interpreted, tiny shape

Writes profile_forward.md (the command, then the tables) and .json under --out (or $OUT).
"""

# Kernels and benchmark drivers take many arguments; Triton constexprs are UPPER_CASE.
# ruff: noqa: N803, PLR0917

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# kernel_check switches the interpreter on for --smoke before triton is imported.
import kernel_check
import torch
import triton
import triton.language as tl
from _common import TOLERANCE, rel_err, time_forward, write_results

from service.kernels.emulation import EmulationExperts
from service.kernels.interface import LayerSpec
from service.kernels.layouts import triton_to_canonical
from service.kernels.routing import topk_route
from service.kernels.triton.config import (
    DECODE,
    DECODE_PROGRAMS_PER_SM,
    GemmTile,
    KernelConfig,
    _splits,
    choose_config,
    choose_config_decode,
    fit_block_k,
)
from service.kernels.triton.experts import TritonWNA16Experts

#: (experts, hidden, intermediate, top_k), as bench/moe_bench.py names them.
SHAPES = {
    "qwen3": ("Qwen3-30B-A3B", (128, 2048, 768, 8)),
    "qwen15": ("Qwen1.5-MoE-A2.7B", (60, 2048, 1408, 4)),
    "mixtral": ("Mixtral-8x7B", (8, 4096, 14336, 2)),
    "tiny": ("tiny", (4, 128, 128, 2)),
}
VARIANTS = ("shipped", "prefill", "decode")
#: Alternative decode tiles timed by --sweep at M=1: (label, w13 tile, w2 tile, splits):
#: splits "auto" as the default heuristic picks them for those tiles, "none" unsplit,
#: "half" half the default tiles' splits.
SWEEP = (
    ("bn64", GemmTile(64, 256, 4, 2), GemmTile(128, 256, 4, 2), "auto"),
    ("bn16", GemmTile(16, 256, 4, 2), GemmTile(32, 256, 4, 2), "auto"),
    ("bk128", GemmTile(32, 128, 4, 2), GemmTile(64, 128, 4, 2), "auto"),
    ("bk512 w8", GemmTile(32, 512, 8, 2), GemmTile(64, 512, 8, 2), "auto"),
    ("unsplit s3", GemmTile(32, 256, 4, 3), GemmTile(64, 256, 4, 3), "none"),
    ("half splits", GemmTile(32, 256, 4, 2), GemmTile(64, 256, 4, 2), "half"),
)
FLUSH_BYTES = 256 << 20
FLUSH_NAME = "_profile_l2_flush_kernel"


@triton.jit
def _profile_l2_flush_kernel(ptr, n, BLOCK: tl.constexpr):
    """Zeroes a 256 MB buffer (evicts the 50 MB L2); its name marks replay boundaries."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(ptr + offs, tl.zeros([BLOCK], tl.int32), mask=offs < n)


@dataclass
class Node:
    name: str
    us: float
    gap_us: float


@dataclass
class Result:
    shape: str
    tokens: int
    variant: str
    config: str
    rel_err: float = math.nan
    graph_rel_err: float = math.nan
    passed: bool = False
    graph_us: float = math.nan
    span_us: float = math.nan
    nodes: list[Node] = field(default_factory=list)
    note: str = ""


def describe(config: KernelConfig) -> str:
    c1, c2 = config.w13, config.w2
    head = config.kernel
    if config.kernel != DECODE:
        head += f" bm{config.block_m}"
    tiles = []
    for name, c in (("w13", c1), ("w2", c2)):
        swap = " swap" if c.swap_ab else ""
        tiles.append(
            f"{name} {c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages} k{c.split_k}{swap}"
        )
    return f"{head}: {'; '.join(tiles)}"


def configs_for(
    variants: list[str], m: int, top_k: int, backend: TritonWNA16Experts, num_sms: int,
    device: torch.device, sweep: bool,
) -> list[tuple[str, KernelConfig]]:  # fmt: skip
    """The (label, config) pairs of one point; prefill only where it differs from shipped."""
    spec = backend.spec
    out: list[tuple[str, KernelConfig]] = []
    heuristic = choose_config(m, top_k, spec, num_sms)
    shipped = backend.config_for(m, top_k, device) if device.type == "cuda" else heuristic
    for v in variants:
        if v == "shipped":
            out.append(("shipped", shipped))
        elif v == "prefill" and shipped != heuristic:
            out.append(("prefill", heuristic))
        elif v == "decode":
            out.append(("decode", choose_config_decode(m, top_k, spec, num_sms)))
    if sweep and m == 1 and "decode" in variants:
        base = choose_config_decode(m, top_k, spec, num_sms)
        for label, w13, w2, splits in SWEEP:
            config = _sweep_config(base, w13, w2, splits, m * top_k, spec, num_sms)
            out.append((f"decode {label}", config))
    return out


def _sweep_config(
    base: KernelConfig, w13: GemmTile, w2: GemmTile, splits: str, routes: int,
    spec: LayerSpec, num_sms: int,
) -> KernelConfig:  # fmt: skip
    """A sweep entry with its K tiles fitted to the layer and its splits resolved."""
    h, i = spec.hidden_size, spec.intermediate_size
    tiles = []
    for tile, k, n, default in ((w13, h, i, base.w13), (w2, i, h, base.w2)):
        group = k if spec.group_size == -1 else spec.group_size
        bk = fit_block_k(tile.block_k, k, group)
        bn = min(tile.block_n, triton.next_power_of_2(n))
        if splits == "none":
            split = 1
        elif splits == "half":
            split = max(1, default.split_k // 2)
        else:
            programs = routes * triton.cdiv(n, bn)
            split = _splits(k, bk, programs, DECODE_PROGRAMS_PER_SM * num_sms)
        tiles.append(replace(tile, block_n=bn, block_k=bk, split_k=split))
    return replace(base, w13=tiles[0], w2=tiles[1])


def short_name(name: str) -> str:
    """A readable kernel name: Triton kernels keep theirs; C++ ones lose templates and scope."""
    if name.startswith(("Memset", "Memcpy")):
        return name.replace(" (Device)", "").replace("Device -> Device", "DtoD")
    name = name.removeprefix("void ")
    name = name.split("(")[0].split("<")[0]
    return name.split("::")[-1][:32] or "?"


def profile_runs(
    run: Callable[[], Any], replays: int, flush: torch.Tensor
) -> tuple[list[Node], float, str]:
    """Per-node median device times of `replays` runs of `run` (a graph replay, or the
    forward's plain launches), each after an L2 flush, from a torch.profiler trace (CUDA
    activity): (nodes, median span first-start..last-end, note)."""
    from torch.profiler import ProfilerActivity, profile

    grid = (triton.cdiv(flush.numel(), 4096),)

    def flush_l2() -> None:
        _profile_l2_flush_kernel[grid](flush, flush.numel(), BLOCK=4096)

    flush_l2()
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            flush_l2()
            run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return nodes_from_trace(trace)


def nodes_from_trace(trace: dict[str, Any]) -> tuple[list[Node], float, str]:
    """A Chrome trace's device events split into runs at each flush kernel; per position
    the median duration and gap before; the median span; a note on irregular runs."""
    device_events = sorted(
        (
            e
            for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")
        ),
        key=lambda e: float(e["ts"]),
    )
    runs: list[list[dict[str, Any]]] = []
    for event in device_events:
        if FLUSH_NAME in event.get("name", ""):
            runs.append([])
        elif runs:
            runs[-1].append(event)
    runs = [r for r in runs if r]
    if not runs:
        return [], math.nan, "no device events in the trace (profiler saw no graph nodes)"
    lengths = {len(r) for r in runs}
    note = "" if len(lengths) == 1 else f"replays with differing node counts {sorted(lengths)}"
    count = statistics.mode(len(r) for r in runs)
    same = [r for r in runs if len(r) == count]
    nodes = []
    for pos in range(count):
        durs = [float(r[pos]["dur"]) for r in same]
        gaps = [
            float(r[pos]["ts"]) - (float(r[pos - 1]["ts"]) + float(r[pos - 1]["dur"]))
            if pos
            else 0.0
            for r in same
        ]
        nodes.append(Node(short_name(same[0][pos]["name"]), statistics.median(durs),
                          statistics.median(gaps)))  # fmt: skip
    spans = [float(r[-1]["ts"]) + float(r[-1]["dur"]) - float(r[0]["ts"]) for r in same]
    return nodes, statistics.median(spans), note


def run_point(
    name: str, m: int, label: str, config: KernelConfig, tensors: dict[str, torch.Tensor],
    spec: LayerSpec, reference: EmulationExperts, device: torch.device, replays: int,
    flush: torch.Tensor | None, seed: int,
) -> Result:  # fmt: skip
    result = Result(name, m, label, describe(config))
    e, h = spec.num_experts, spec.hidden_size
    top_k = SHAPES_BY_NAME[name][3]
    gen = torch.Generator(device=device).manual_seed(1000 + seed)
    x = torch.randn(m, h, device=device, generator=gen).to(torch.bfloat16)
    weights, ids = topk_route(torch.randn(m, e, device=device, generator=gen), top_k)
    ref = reference.forward_fp32(x, ids, weights, "silu")
    checked = TritonWNA16Experts(config, poison_workspace=True)
    checked.prepare(tensors, spec)
    out = torch.full((m, h), float("nan"), dtype=torch.bfloat16, device=device)
    checked.forward(x, ids, weights, "silu", out=out)
    result.rel_err = rel_err(out, ref)
    finite = bool(torch.isfinite(out).all())
    timed = TritonWNA16Experts(config)
    timed.prepare(tensors, spec)
    graph_out = torch.full_like(out, float("nan"))
    timing, graph = time_forward(
        lambda: timed.forward(x, ids, weights, "silu", out=graph_out), device
    )
    result.graph_us = timing.us
    if timing.mode != "graph":
        result.note = f"{timing.mode} {timing.note}".strip()
    if graph is not None and flush is not None:
        result.nodes, result.span_us, note = profile_runs(graph.replay, replays, flush)
        if not result.nodes:
            # No graph nodes in the trace: the same kernels launched one by one (their
            # device times hold; the gaps are then launch gaps, not the graph's).
            forward = lambda: timed.forward(x, ids, weights, "silu", out=graph_out)  # noqa: E731
            result.nodes, result.span_us, eager = profile_runs(forward, replays, flush)
            note = f"{note}; nodes from plain launches {eager}".strip()
        result.note = "; ".join(filter(None, [result.note, note]))
        graph_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
    result.graph_rel_err = rel_err(graph_out, ref)
    result.passed = (
        finite and result.rel_err < TOLERANCE and result.graph_rel_err < TOLERANCE
    )  # fmt: skip
    return result


SHAPES_BY_NAME = {name: shape for name, shape in SHAPES.values()}


def table(results: list[Result]) -> str:
    lines = [
        "| shape | M | variant | graph µs | span µs | nodes: µs (gap before) | rel err | pass "
        "| tiles |",
        "|---|---:|---|---:|---:|---|---|---|---|",
    ]
    for r in results:
        nodes = " · ".join(
            f"{n.name} {n.us:.1f}" + (f" ({n.gap_us:.1f})" if i else "")
            for i, n in enumerate(r.nodes)
        )
        lines.append(
            f"| {r.shape} | {r.tokens} | {r.variant} | {r.graph_us:.1f} | {r.span_us:.1f} | "
            f"{nodes or r.note or '-'} | {r.rel_err:.1e} ({r.graph_rel_err:.1e}) | "
            f"{'ok' if r.passed else 'FAIL'} | {r.config} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3", "qwen15", "mixtral"],
                        choices=sorted(SHAPES))  # fmt: skip
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--sweep", action="store_true", help="alternative decode tiles at M=1")
    parser.add_argument("--replays", type=int, default=20, help="profiled replays per point")
    parser.add_argument("--budget-s", type=float, default=170.0,
                        help="start no new point after this many seconds")  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="CPU/interpreter, tiny shape")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.shapes, args.tokens = ["tiny"], [1, 3]
    started = time.perf_counter()
    num_sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 4
    )
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {gpu} ({num_sms} SMs); torch {torch.__version__}; triton {triton.__version__}",
          flush=True)  # fmt: skip
    flush = (
        torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=device)
        if device.type == "cuda"
        else None
    )
    results: list[Result] = []
    out_dir = Path(args.out) if args.out else None
    cut = False
    # Every layer first, then token counts outer: a budget cut drops the larger M last.
    layers = {}
    for seed, key in enumerate(args.shapes):
        name, shape = SHAPES[key]
        tensors, spec = kernel_check.make_layer(shape, kernel_check.PRIMARY, device, seed)
        canonical = triton_to_canonical(tensors, bits=4, group_size=128)
        reference = EmulationExperts()
        reference.prepare(canonical, LayerSpec.from_canonical(canonical))
        probe = TritonWNA16Experts()
        probe.prepare(tensors, spec)
        layers[key] = (seed, tensors, spec, reference, probe)
    print(f"[{time.perf_counter() - started:6.1f}s] layers built", flush=True)
    for m in args.tokens:
        for key, (seed, tensors, spec, reference, probe) in layers.items():
            name, shape = SHAPES[key]
            for label, config in configs_for(
                args.variants, m, shape[3], probe, num_sms, device, args.sweep
            ):
                if time.perf_counter() - started > args.budget_s:
                    cut = True
                    continue
                try:
                    result = run_point(name, m, label, config, tensors, spec, reference,
                                       device, args.replays, flush, seed)  # fmt: skip
                except Exception as exc:
                    traceback.print_exc()
                    result = Result(name, m, label, describe(config), note=repr(exc)[:120])
                results.append(result)
                print(f"[{time.perf_counter() - started:6.1f}s] {table([result]).splitlines()[-1]}",
                      flush=True)  # fmt: skip
    markdown = (
        f"Device {gpu}; per-node medians of {args.replays} profiled graph replays, each after "
        f"a 256 MB L2 flush; graph µs: do_bench median, L2 flushed; span: first node start "
        f"to last node end.{' Cut by --budget-s.' if cut else ''}\n\n{table(results)}"
    )
    print("\n" + markdown, flush=True)
    write_results(out_dir, "profile_forward", markdown,
                  {"device": gpu, "results": [asdict(r) for r in results]})  # fmt: skip
    print(f"total {time.perf_counter() - started:.1f}s", flush=True)
    return 0 if results and all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
