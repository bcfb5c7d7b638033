#!/usr/bin/env python
"""The MoE forward benchmark: every backend the worker runs, against the floor, on one H200.

One process, one device call (scripts/bench_gpu.sh; `make bench-gpu` prints the command):

1. the ceilings, measured here: device-to-device copy bandwidth (bytes read + written, a
   1 GiB copy) and the bf16 matmul rate (8192^3), by bench/_common.py's `ceilings`;
2. for each case (layer shape x quantization variant) of the plan: fresh random codes,
   scales and zero points on the GPU, written into each backend's layout by the service's
   own writers (bench/gpu_suite.py's `build_backend`), every backend prepared (humming's JIT
   warmed for the plan's token counts);
3. for each token count M: fresh bf16 hidden states and router logits, vLLM's softmax top-k
   routing (uniform on random logits); the floor of the point; each backend's forward into
   an output filled with NaN, checked against the fp32 dequantized reference (EMULATION's
   `reference_forward`: dequantize in fp32, compute in fp32) by ||out - ref|| / ||ref|| <
   1e-2, every element finite; then the whole forward (alignment, both GEMMs, activation,
   weighted top-k sum) captured in one CUDA graph and timed as the median of do_bench
   replays with the L2 flushed (a 256 MB buffer zeroed before each replay, outside the
   timed region); the graph's own output is poisoned and checked again after timing.

The floor of a point is max(bytes / copy bandwidth, FLOPs / matmul rate): bytes are the
quantized weights, scales and zero points of the experts the point's routing actually
touches, plus the activations read and written (hidden states in, output out, top-k ids and
weights); FLOPs are 2 * M * top_k * 3 * H * I. The peers' figures of
shared/reference/peer_bench.md (same machine kind, int4 g128 sym) are printed beside.

    python bench/moe_bench.py [--quick] [--out DIR] [--budget-s 390]
    python bench/moe_bench.py --dry-run [--bandwidth 4.284e12 --matmul-rate 6.73e14]

`--dry-run` needs no GPU: it prints the plan, each point's floor from the given ceilings
(expected distinct experts), and the estimated device time of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_suite import VARIANTS, Shape, Variant

from service.kernels.registry import RUNNABLE

SHAPES: dict[str, Shape] = {
    "mixtral": Shape("Mixtral-8x7B", experts=8, top_k=2, hidden=4096, intermediate=14336),
    "qwen15": Shape("Qwen1.5-MoE-A2.7B", experts=60, top_k=4, hidden=2048, intermediate=1408),
    "qwen3": Shape("Qwen3-30B-A3B", experts=128, top_k=8, hidden=2048, intermediate=768),
    "deepseek": Shape("DeepSeek-V3", experts=256, top_k=8, hidden=7168, intermediate=2048),
    "small": Shape("small", experts=8, top_k=2, hidden=512, intermediate=256),
}
TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
#: The backend table's backends (service/kernels/registry.py), ours first and the float32
#: reference last: the table's column order.
BACKENDS = tuple(sorted(RUNNABLE, key=lambda n: (n != "TRITON", n == "EMULATION")))
#: EMULATION loops over experts in float32 on the host's command: only where that is short.
EMULATION_MAX_TOKENS = 16
PRIMARY = "int4-g128-sym"

#: shared/reference/peer_bench.md (H200, int4 g128 sym, full forward, CUDA graph, L2 flushed):
#: (shape, M) -> (vLLM Triton µs, humming µs, vLLM Marlin µs).
PEERS: dict[tuple[str, int], tuple[float, float, float]] = {
    ("Mixtral-8x7B", 1): (704.3, 80.3, 89.6),
    ("Mixtral-8x7B", 4): (1011.4, 151.5, 170.9),
    ("Mixtral-8x7B", 16): (2860.3, 227.2, 253.7),
    ("Mixtral-8x7B", 64): (1710.3, 301.7, 376.5),
    ("Mixtral-8x7B", 256): (2615.8, 520.4, 916.5),
    ("Mixtral-8x7B", 1024): (7358.9, 1671.2, 2747.5),
    ("Mixtral-8x7B", 4096): (26061.4, 5522.5, 10136.5),
    ("Qwen1.5-MoE-A2.7B", 1): (95.5, 35.9, 35.3),
    ("Qwen1.5-MoE-A2.7B", 4): (180.9, 55.3, 52.5),
    ("Qwen1.5-MoE-A2.7B", 16): (674.4, 85.6, 88.9),
    ("Qwen1.5-MoE-A2.7B", 64): (873.0, 114.7, 124.0),
    ("Qwen1.5-MoE-A2.7B", 256): (652.1, 152.3, 172.5),
    ("Qwen1.5-MoE-A2.7B", 1024): (1058.7, 221.4, 457.1),
    ("Qwen1.5-MoE-A2.7B", 4096): (2877.2, 661.2, 1220.4),
    ("Qwen3-30B-A3B", 1): (80.2, 36.6, 36.1),
    ("Qwen3-30B-A3B", 4): (186.9, 51.8, 55.4),
    ("Qwen3-30B-A3B", 16): (681.5, 90.6, 96.5),
    ("Qwen3-30B-A3B", 64): (1017.7, 122.4, 141.2),
    ("Qwen3-30B-A3B", 256): (751.7, 144.9, 211.2),
    ("Qwen3-30B-A3B", 1024): (1069.5, 256.3, 473.9),
    ("Qwen3-30B-A3B", 4096): (3132.5, 753.7, 1410.4),
    ("DeepSeek-V3", 1): (418.9, 82.6, 91.7),
    ("DeepSeek-V3", 4): (1450.2, 238.6, 257.7),
    ("DeepSeek-V3", 16): (6771.1, 612.8, 773.3),
    ("DeepSeek-V3", 64): (15641.9, 1578.7, 1642.4),
    ("DeepSeek-V3", 256): (12147.9, 2002.0, 2230.7),
    ("DeepSeek-V3", 1024): (12230.6, 2653.0, 3850.9),
    ("DeepSeek-V3", 4096): (29644.0, 6937.6, 12269.5),
}

#: Ceilings of peer_bench.md's run, used by --dry-run when none are given.
PEER_BANDWIDTH = 4.284e12
PEER_MATMUL_RATE = 673e12


@dataclass(frozen=True)
class Case:
    """One layer built once and run at several token counts by several backends."""

    shape: str
    variant: str
    tokens: tuple[int, ...]
    backends: tuple[str, ...]


def plan(quick: bool = False, shapes: list[str] | None = None) -> list[Case]:
    """The cases of a run: the primary variant on every shape at every token count, then
    int8 and group-32 asymmetric at a few points of one shape (variant-major, so a time
    budget cuts the extras first)."""
    if quick:
        keys = shapes or ["mixtral", "qwen3"]
        main = [Case(k, PRIMARY, (1, 16, 256, 4096), BACKENDS) for k in keys]
        extra = [Case("qwen3", "int8-g128-sym", (16,), BACKENDS)]
    else:
        keys = shapes or ["mixtral", "qwen15", "qwen3", "deepseek"]
        main = [Case(k, PRIMARY, TOKENS, BACKENDS) for k in keys]
        extra = [
            Case("qwen3", "int8-g128-sym", (1, 16, 256, 4096), BACKENDS),
            Case("qwen3", "int4-g32-zp", (1, 16, 256, 4096), BACKENDS),
        ]
    if shapes:
        extra = [c for c in extra if c.shape in shapes]
    return main + extra


# ---------------------------------------------------------------------------------------
# The floor (pure arithmetic: --dry-run and the tests use it without a device)


def expected_experts(shape: Shape, m: int) -> float:
    """E * (1 - (1 - k/E)^M): distinct experts touched by M uniformly routed tokens."""
    e, k = shape.experts, shape.top_k
    return float(e * (1 - (1 - k / e) ** m))


def expert_bytes(shape: Shape, variant: Variant, scale_bytes: int = 2) -> float:
    """Bytes of one expert's quantized weights (w13 and w2): codes, scales, zero points."""
    total = 0.0
    for n, k in ((2 * shape.intermediate, shape.hidden), (shape.hidden, shape.intermediate)):
        groups = 1 if variant.group_size == -1 else k // variant.group_size
        total += n * k * variant.bits / 8 + n * groups * scale_bytes
        if variant.zero_points:
            total += n * groups * variant.bits / 8
    return total


def activation_bytes(shape: Shape, m: int, elem: int = 2) -> float:
    """Hidden states read, output written, top-k ids (int32) and weights (fp32) read."""
    return float(2 * m * shape.hidden * elem + m * shape.top_k * 8)


def flops(shape: Shape, m: int) -> float:
    """2 * M * k * (2I*H + H*I): both GEMMs over every routed token."""
    return float(2 * m * shape.top_k * 3 * shape.hidden * shape.intermediate)


@dataclass(frozen=True)
class Floor:
    experts: float
    bytes: float
    flops: float
    memory_us: float
    compute_us: float

    @property
    def us(self) -> float:
        return max(self.memory_us, self.compute_us)

    @property
    def bound(self) -> str:
        return "mem" if self.memory_us >= self.compute_us else "compute"


def floor(
    shape: Shape, variant: Variant, m: int, *, bandwidth: float, rate: float, experts: float
) -> Floor:
    """The point's floor for `experts` distinct experts touched (seen or expected)."""
    nbytes = experts * expert_bytes(shape, variant) + activation_bytes(shape, m)
    work = flops(shape, m)
    return Floor(experts, nbytes, work, nbytes / bandwidth * 1e6, work / rate * 1e6)


def estimate_s(cases: list[Case]) -> float:
    """Rough device seconds of a run (set from the H200 runs of gpu_suite/kernel_check):
    layer build and conversion ~2.5 s per GB of int4 weights per backend, humming's JIT
    ~12 s per case (its configs compile in parallel), our Triton kernel's JIT ~1.5 s per
    token count, ~0.35 s per timed point."""
    total = 15.0  # ceilings, imports, CUDA context
    for case in cases:
        shape, variant = SHAPES[case.shape], VARIANTS[case.variant]
        gb = shape.experts * expert_bytes(shape, variant) / 1e9
        total += 2.5 * gb * len(case.backends) + (12 if "HUMMING" in case.backends else 0)
        total += 0.35 * len(case.tokens) * len(case.backends)
        total += 1.5 * len(case.tokens) if "TRITON" in case.backends else 0
    return total


# ---------------------------------------------------------------------------------------
# Rows and the table


@dataclass
class Result:
    backend: str
    status: str  # pass | FAIL | unavailable | error | skipped
    us: float | None = None
    mode: str = ""
    rel_err: float | None = None
    graph_rel_err: float | None = None
    note: str = ""


@dataclass
class Point:
    shape: str
    variant: str
    tokens: int
    experts_expected: float
    experts_seen: int | None
    floor_us: float
    bound: str
    results: dict[str, Result] = field(default_factory=dict)

    def fastest(self) -> Result | None:
        ok = [r for r in self.results.values() if r.status == "pass" and r.us is not None]
        return min(ok, key=lambda r: r.us or 0.0) if ok else None


def _fmt(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def table(points: list[Point], backends: tuple[str, ...] = BACKENDS) -> str:
    head = (
        ["shape", "variant", "M", "experts exp. (seen)", "floor µs (bound)"]
        + [f"{b} µs" for b in backends]
        + ["fastest", "best/floor", "TRITON vs vLLM-Triton", "TRITON/humming"]
        + ["peer vLLM-Triton / humming / Marlin µs", "rel err " + " / ".join(backends)]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        shape = SHAPES_BY_NAME.get(p.shape)
        seen = "" if p.experts_seen is None else f" ({p.experts_seen})"
        cells = [p.shape, p.variant, str(p.tokens), f"{p.experts_expected:.1f}{seen}"]
        cells.append(f"{p.floor_us:.1f} ({p.bound})")
        for b in backends:
            r = p.results.get(b)
            if r is None:
                cells.append("")
            elif r.status == "pass":
                mark = "" if r.mode == "graph" else f" [{r.mode}]"
                cells.append(f"{_fmt(r.us)}{mark}")
            else:
                cells.append(r.status)
        best = p.fastest()
        best_us = best.us if best else None
        cells += [best.backend if best else "", _fmt(best_us / p.floor_us, 2) if best_us else ""]
        peer = PEERS.get((p.shape, p.tokens)) if p.variant == PRIMARY and shape else None
        tri = p.results.get("TRITON")
        tri_us = tri.us if tri and tri.status == "pass" else None
        cells.append(_fmt(peer[0] / tri_us, 1) + "x" if peer and tri_us else "")
        hum = p.results.get("HUMMING")
        hum_us = hum.us if hum and hum.status == "pass" else None
        cells.append(_fmt(tri_us / hum_us, 2) if tri_us and hum_us else "")
        cells.append(" / ".join(_fmt(v) for v in peer) if peer else "")
        errs = []
        for b in backends:
            r = p.results.get(b)
            errs.append("–" if r is None or r.rel_err is None else f"{r.rel_err:.1e}")
        cells.append(" / ".join(errs))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


SHAPES_BY_NAME = {s.name: s for s in SHAPES.values()}


def _passed_us(point: Point, backend: str) -> float | None:
    r = point.results.get(backend)
    return r.us if r is not None and r.status == "pass" else None


def goals(points: list[Point]) -> str:
    """Issue 6's goals, each with the points that meet it and the worst value (primary
    variant only; a point whose backend did not pass counts as missed)."""
    primary = [p for p in points if p.variant == PRIMARY]
    lines = []

    def line(
        text: str, values: list[tuple[Point, float | None]], limit: float, at_least: bool
    ) -> None:
        known = [(p, v) for p, v in values if v is not None]
        met = [v for _, v in known if (v >= limit if at_least else v <= limit)]
        worst = ""
        if known:
            p, v = (min if at_least else max)(known, key=lambda item: item[1])
            worst = f"; worst {v:.2f} at {p.shape} M={p.tokens}"
        lines.append(f"- {text}: {len(met)} of {len(values)} points{worst}")

    vs_vllm: list[tuple[Point, float | None]] = []
    vs_humming: list[tuple[Point, float | None]] = []
    for p in primary:
        ours, peer = _passed_us(p, "TRITON"), PEERS.get((p.shape, p.tokens))
        vs_vllm.append((p, peer[0] / ours if ours and peer else None))
        hum = _passed_us(p, "HUMMING")
        vs_humming.append((p, ours / hum if ours and hum else None))
    line("TRITON >= 5x faster than vLLM's Triton (peer figure)", vs_vllm, 5, at_least=True)
    line("TRITON within 1.5x of humming (same run)", vs_humming, 1.5, at_least=False)
    floor_ratios: list[tuple[Point, float | None]] = []
    for p in primary:
        if p.tokens >= 16:
            best = p.fastest()
            floor_ratios.append((p, best.us / p.floor_us if best and best.us else None))
    line("fastest within 1.25x of the floor, M >= 16", floor_ratios, 1.25, at_least=False)
    decode = [
        (p, best.us if (best := p.fastest()) else None)
        for p in primary
        if p.tokens == 1 and p.shape in ("Qwen3-30B-A3B", "Qwen1.5-MoE-A2.7B")
    ]
    line("fastest forward at M = 1 on the Qwen shapes <= 15 µs", decode, 15, at_least=False)
    return "\n".join(lines)


def dry_run(cases: list[Case], bandwidth: float, rate: float) -> list[Point]:
    """The plan's points with floors from the given ceilings (expected distinct experts)."""
    points = []
    for case in cases:
        shape, variant = SHAPES[case.shape], VARIANTS[case.variant]
        for m in case.tokens:
            fl = floor(
                shape,
                variant,
                m,
                bandwidth=bandwidth,
                rate=rate,
                experts=expected_experts(shape, m),
            )
            points.append(Point(shape.name, variant.name, m, fl.experts, None, fl.us, fl.bound))
    return points


# ---------------------------------------------------------------------------------------
# The device run


def log(message: str) -> None:
    print(message, flush=True)


def run_case(
    case: Case,
    *,
    device: Any,
    ceilings: tuple[float, float],
    seed: int,
    rep_ms: int,
    deadline: float,
) -> list[Point]:
    import torch
    from _common import TOLERANCE, rel_err, time_forward
    from gpu_suite import KernelUnavailable, build_backend, poison, random_layer

    from service.formats.errors import ConversionUnsupported
    from service.kernels.activation import resolve
    from service.kernels.emulation import reference_forward
    from service.kernels.errors import KernelError
    from service.kernels.routing import topk_route

    shape, variant = SHAPES[case.shape], VARIANTS[case.variant]
    start = time.perf_counter()
    layer = random_layer(shape, variant, seed, device)
    log(f"  layer: {time.perf_counter() - start:.1f} s")
    built: dict[str, Any] = {}
    unavailable: dict[str, Result] = {}
    for name in case.backends:
        start = time.perf_counter()
        try:
            backend, info = build_backend(name, layer, device)
            warm = getattr(backend, "warm_up", None)
            if warm is not None:
                warm(list(case.tokens), shape.top_k)
            sync(device)
            built[name] = backend
            log(f"  {name}: ready in {time.perf_counter() - start:.1f} s {info}")
        except (KernelUnavailable, ConversionUnsupported, KernelError) as exc:
            unavailable[name] = Result(name, "unavailable", note=str(exc)[:160])
            log(f"  {name}: unavailable: {exc}")
        except Exception as exc:
            unavailable[name] = Result(name, "error", note=repr(exc)[:160])
            log(f"  {name}: prepare failed: {exc!r}\n{traceback.format_exc(limit=-3)}")
    act = resolve("silu")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + 1)
    bandwidth, rate = ceilings
    points: list[Point] = []
    for m in case.tokens:
        x = torch.randn((m, shape.hidden), generator=gen, device=device).to(torch.bfloat16)
        logits = torch.randn((m, shape.experts), generator=gen, device=device)
        weights, ids = topk_route(logits, shape.top_k, renormalize=True)
        seen = int(torch.unique(ids).numel())
        fl = floor(shape, variant, m, bandwidth=bandwidth, rate=rate, experts=seen)
        point = Point(
            shape.name, variant.name, m, expected_experts(shape, m), seen, fl.us, fl.bound
        )
        point.results.update(unavailable)
        ref = reference_forward(layer, x, ids, weights, act)
        for name, backend in built.items():
            result = Result(name, "error")
            point.results[name] = result
            if name == "EMULATION" and m > EMULATION_MAX_TOKENS:
                result.status, result.note = "skipped", f"M > {EMULATION_MAX_TOKENS}"
                continue
            if time.perf_counter() > deadline:
                result.status, result.note = "skipped", "time budget"
                continue
            try:
                poison(device, 64 << 20)
                out = torch.full_like(x, float("nan"))
                backend.forward(x, ids, weights, "silu", out=out)
                sync(device)
                result.rel_err = rel_err(out, ref)
                ok = bool(torch.isfinite(out).all()) and result.rel_err < TOLERANCE
                graph_out = torch.full_like(x, float("nan"))

                def call(
                    b: Any = backend,
                    o: torch.Tensor = graph_out,
                    args: tuple[torch.Tensor, ...] = (x, ids, weights),
                ) -> Any:
                    return b.forward(*args, "silu", out=o)

                timing, graph = time_forward(
                    call, device, rep_ms=rep_ms, graph=backend.graph_capturable
                )
                result.us, result.mode, result.note = timing.us, timing.mode, timing.note
                if graph is not None:
                    graph_out.fill_(float("nan"))
                    graph.replay()
                sync(device)
                result.graph_rel_err = rel_err(graph_out, ref)
                ok = ok and result.graph_rel_err < TOLERANCE
                result.status = "pass" if ok else "FAIL"
                del graph
            except Exception as exc:
                result.note = repr(exc)[:160]
                log(f"  {name} M={m}: {exc!r}\n{traceback.format_exc(limit=-3)}")
            log(
                f"  {name:9s} M={m:5d} {result.status:5s} us={_fmt(result.us)} "
                f"({result.mode}) rel={result.rel_err} graph_rel={result.graph_rel_err} "
                f"floor={fl.us:.1f}"
            )
        points.append(point)
    del built, layer
    torch.cuda.empty_cache()
    return points


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def environment(device: Any) -> dict[str, Any]:
    from gpu_suite import environment as suite_environment

    env: dict[str, Any] = suite_environment(device)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two shapes, four token counts")
    parser.add_argument("--dry-run", action="store_true", help="plan and floors only, no GPU")
    parser.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shapes", default="", help=f"subset of {sorted(SHAPES)}")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--bandwidth", type=float, default=PEER_BANDWIDTH, help="dry run, B/s")
    parser.add_argument("--matmul-rate", type=float, default=PEER_MATMUL_RATE, help="FLOP/s")
    parser.add_argument("--rep-ms", type=int, default=60, help="do_bench time per point")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument(
        "--budget-s", type=float, default=390, help="start no case or point after this"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", ""))
    args = parser.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s] or None
    backends = tuple(b for b in args.backends.split(",") if b)
    cases = [
        Case(c.shape, c.variant, c.tokens, tuple(b for b in c.backends if b in backends))
        for c in plan(args.quick, shapes)
    ]
    out_dir = Path(args.out) if args.out else None
    from _common import write_results

    if args.dry_run:
        planned = dry_run(cases, args.bandwidth, args.matmul_rate)
        text = table(planned, backends)
        est = estimate_s(cases)
        log(f"plan: {len(cases)} cases, {len(planned)} points, estimated device time {est:.0f} s")
        log(
            f"ceilings (given): copy {args.bandwidth / 1e12:.3f} TB/s, "
            f"bf16 matmul {args.matmul_rate / 1e12:.0f} TFLOP/s"
        )
        log(text)
        payload = {"dry_run": True, "estimate_s": est, "points": [asdict(p) for p in planned]}
        write_results(out_dir, "moe_bench_plan", text, payload)
        return 0

    import torch
    from _common import ceilings as measure_ceilings

    started = time.perf_counter()
    deadline = started + args.budget_s
    if args.cpu_smoke:
        # The device path on the CPU at a tiny shape (EMULATION only): tests run it.
        device = torch.device("cpu")
        cases = [Case("small", PRIMARY, (1, 4), ("EMULATION",))]
        env: dict[str, Any] = {"gpu": "cpu"}
        bandwidth, rate = args.bandwidth, args.matmul_rate
    elif not torch.cuda.is_available():
        log("no CUDA device: use --dry-run on a machine without one")
        return 2
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        env = environment(device)
        bandwidth, rate = measure_ceilings(device)
    log("environment: " + json.dumps(env))
    log(f"ceilings: copy {bandwidth / 1e12:.3f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    log(f"plan: {len(cases)} cases, estimated {estimate_s(cases):.0f} s")
    points: list[Point] = []
    skipped: list[str] = []
    for case in cases:
        elapsed = time.perf_counter() - started
        if elapsed > args.budget_s:
            skipped.append(f"{case.shape} {case.variant}")
            continue
        log(f"== {case.shape} {case.variant} M={list(case.tokens)} (t={elapsed:.0f} s)")
        points += run_case(
            case,
            device=device,
            ceilings=(bandwidth, rate),
            seed=args.seed,
            rep_ms=args.rep_ms,
            deadline=deadline,
        )
        header = (
            f"{env.get('gpu')}; ceilings measured in this run: copy {bandwidth / 1e12:.3f} "
            f"TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s; tolerance rel err < 1e-2 vs fp32 "
            f"dequantized reference; µs = CUDA-graph median, L2 flushed"
        )
        payload = {
            "environment": env,
            "ceilings": {"copy_Bps": bandwidth, "matmul_flops": rate},
            "points": [asdict(p) for p in points],
            "skipped": skipped,
            "elapsed_s": time.perf_counter() - started,
        }
        markdown = f"{header}\n\n{table(points, backends)}\n\nGoals:\n{goals(points)}"
        write_results(out_dir, "moe_bench", markdown, payload)
    text = table(points, backends) + "\n\nGoals (issue 6):\n" + goals(points)
    log(
        f"\nMoE forward on {env.get('gpu')} ({time.perf_counter() - started:.0f} s): "
        f"copy {bandwidth / 1e12:.3f} TB/s, matmul {rate / 1e12:.0f} TFLOP/s"
    )
    log(text)
    if skipped:
        log(f"\nnot run (time budget {args.budget_s:g} s): {', '.join(skipped)}")
    failed = [
        f"{p.shape} M={p.tokens} {r.backend}"
        for p in points
        for r in p.results.values()
        if r.status in ("FAIL", "error")
    ]
    log(f"\npoints: {len(points)}, failed: {len(failed)} {failed[:10]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
