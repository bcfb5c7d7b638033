"""Where one layer's conversion time goes on a GPU: the direct routes' stages, timed apart.

`direct.try_direct` is read (`read_packed`: checks, one stack per role, the zero-point and
g_idx content checks on the device with the layer's one host sync), two weight writes
(w13: every expert's gate and up; w2), the target's other tensors (scales, zero points,
bias) and `finish`. This script runs those same steps on one Mixtral-8x7B layer (as
bench/convert_bench.py builds it) for each (source, target) and each weight path
(`direct`: the torch transforms, expert by expert; `triton`: the fused kernels, one launch
per projection; `table`: the generic table kernel where a dedicated kernel replaced it),
and reports the whole call timed as bench/convert_bench.py times it, and per stage:

- device ms: CUDA events recorded between the stages of one call (no synchronize in
  between, so a stage whose host work outruns the GPU shows its host time: what a
  conversion costs as run), median of --rounds after a warm-up;
- host ms: the stage's Python time (perf_counter, no synchronize): the dispatch cost;
- weight-only device ms: the weight writes alone, their inputs and output views prepared
  beforehand (the kernel, or the torch ops, and nothing else), against the copy floor of
  the weight's bytes;

then one call under torch.profiler: the CUDA kernels by device time (name, count, total),
the number of kernel launches, and the sum of kernel time against the call's wall time
(the rest is the GPU waiting on the host). Each route's result is checked byte for byte
against the canonical route.

    python bench/repack_profile.py --device cuda:0 --markdown $OUT/repack_profile.md
    python bench/repack_profile.py --quick          # CPU smoke run (no kernels, no events)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import repack_variants
from bench.convert_bench import GB, Timer, bench_layer, copy_bandwidth, identical, markdown
from service.formats import registry
from service.formats.readers import LAYOUTS, SourceQuantization, write_checkpoint
from service.formats.routes import direct, gpu_repack
from service.formats.routes.canonical import canonical
from service.formats.routes.read import read_packed
from service.formats.writers import DEFAULT_OPTIONS, finish, weight_type

STAGES = ("read_packed", "w13 weight", "w2 weight", "other tensors", "finish")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Marks:
    """Timestamps between stages: CUDA events on a GPU (device timeline), perf_counter
    always (host)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.events: list[Any] = []
        self.host: list[float] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            self.events.append(event)
        self.host.append(time.perf_counter())

    def spans(self) -> tuple[list[float], list[float]]:
        """(device ms, host ms) of each interval between marks (device = host on a CPU)."""
        host = [1e3 * (b - a) for a, b in zip(self.host, self.host[1:], strict=False)]
        if not self.cuda:
            return host, host
        self.events[-1].synchronize()
        dev = [float(a.elapsed_time(b)) for a, b in zip(self.events, self.events[1:], strict=False)]
        return dev, host


ROUTE_FLAGS = {
    "direct": {"kernels": False, "table_kernels": False},
    "triton": {"kernels": True, "table_kernels": False},
    "table": {"kernels": True, "table_kernels": True},
}
"""Profiled route -> its weight path: the torch transforms, the route's kernels,
the generic table kernel where a dedicated one replaced it (only for those pairs)."""


def _weight_fn(
    layout: str, backend: str, bits: int, kernels: bool, table_kernels: bool = False
) -> tuple[Any, Any]:
    found = direct.direct_route(layout, backend, bits)
    assert found is not None, (layout, backend, bits)
    route, fn = found
    if kernels:
        table = repack_variants.TABLE_KERNELS.get((layout, backend), {}) if table_kernels else {}
        fn = table.get(bits) or route.kernels.get(bits, fn)
    return route, fn


def staged(
    layout: str,
    tensors: dict[str, torch.Tensor],
    quant: SourceQuantization,
    backend: str,
    *,
    num_experts: int,
    kernels: bool,
    marks: _Marks,
    table_kernels: bool = False,
) -> registry.ConvertedLayer:
    """`direct.try_direct`'s steps, a mark between each (the same calls, in the same
    order, for a layer the route takes; the deferred content checks, GPTQ's one sync, end
    the "other tensors" stage)."""
    route, fn = _weight_fn(layout, backend, quant.bits, kernels, table_kernels)
    marks.mark()
    deferred: list[Callable[[], bool]] = []
    packed = read_packed(
        LAYOUTS[layout], tensors, quant, num_experts=num_experts, deferred=deferred
    )
    assert route.target.applies(packed, DEFAULT_OPTIONS)
    marks.mark()
    device = packed.w13.device
    w13 = direct.write_weight(route, fn, packed.w13, device)
    marks.mark()
    w2 = direct.write_weight(route, fn, packed.w2, device)
    marks.mark()
    named = route.target.tensors(packed, w13, w2)
    assert all(holds() for holds in deferred)  # the content checks' sync, as try_direct
    marks.mark()
    result = finish(
        named,
        backend=backend,
        source=layout,
        layer=packed,
        weight_type_name=weight_type(packed.w13),
        options=DEFAULT_OPTIONS,
    )
    marks.mark()
    return result


def weight_only(
    layout: str,
    tensors: dict[str, torch.Tensor],
    quant: SourceQuantization,
    backend: str,
    *,
    num_experts: int,
    kernels: bool,
    device: torch.device,
    rounds: int,
    table_kernels: bool = False,
) -> tuple[float, int]:
    """Median device ms of both weight writes with everything prepared (read, output
    allocated, views cut), and the bytes they read + write."""
    route, fn = _weight_fn(layout, backend, quant.bits, kernels, table_kernels)
    packed = read_packed(LAYOUTS[layout], tensors, quant, num_experts=num_experts)
    jobs = []
    moved = 0
    for projection in (packed.w13, packed.w2):
        bits = projection.bits
        out = route.target.allocate(
            projection.num_experts, projection.n, projection.k, bits, device
        )
        pairs = []
        for expert, shards in enumerate(projection.weights):
            rows = projection.n // len(shards)
            for index, stored in enumerate(shards):
                view = route.target.rows(out[expert], index * rows, (index + 1) * rows, bits)
                pairs.append((stored, view))
                moved += 2 * stored.numel() * stored.element_size()
        jobs.append(pairs)

    def once() -> None:
        for pairs in jobs:
            if isinstance(fn, gpu_repack.Repack):
                fn.run(pairs, quant.bits)
            else:
                for stored, view in pairs:
                    fn(stored, view, quant.bits)

    once()
    times = []
    for _ in range(rounds):
        marks = _Marks(device)
        _sync(device)
        marks.mark()
        once()
        marks.mark()
        times.append(marks.spans()[0][0])
    return statistics.median(times), moved


def kernel_table(
    run: Callable[[], object], device: torch.device, top: int = 8
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One call of `run` under torch.profiler: the top CUDA kernels by device time, and
    the totals (launches, kernel ms, wall ms)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    _sync(device)
    began = time.perf_counter()
    with profile(activities=activities) as prof:
        run()
        _sync(device)
    wall = 1e3 * (time.perf_counter() - began)
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if not str(getattr(event, "device_type", "")).endswith("CUDA"):
            continue
        micros = getattr(event, "device_time", None)  # `cuda_time` before torch 2.4
        micros = event.cuda_time if micros is None else micros
        kernels.setdefault(event.name, []).append(float(micros) / 1e3)
    totals_ms = {name: sum(times) for name, times in kernels.items()}
    ranked = sorted(kernels, key=lambda name: -totals_ms[name])
    rows: list[dict[str, Any]] = [
        {"kernel": name[:90], "count": len(kernels[name]), "ms": round(totals_ms[name], 3)}
        for name in ranked
    ]
    totals: dict[str, Any] = {
        "launches": sum(len(times) for times in kernels.values()),
        "kernel ms": round(sum(totals_ms.values()), 3),
        "wall ms (profiled)": round(wall, 3),
        "ops": _op_table(prof),
    }
    return rows[:top], totals


def _op_table(prof: Any) -> str:
    """torch's own per-op table (device time first), in case the kernel events above are
    named or typed differently by this torch version."""
    for key in ("self_device_time_total", "self_cuda_time_total", "self_cpu_time_total"):
        try:
            return str(prof.key_averages().table(sort_by=key, row_limit=15))
        except (AttributeError, KeyError, ValueError):
            continue
    return ""


def _profile_route(
    source: str,
    target: str,
    *,
    tensors: dict[str, torch.Tensor],
    quant: SourceQuantization,
    experts: int,
    kernels: bool,
    device: torch.device,
    rounds: int,
    bandwidth: float,
    reference: registry.ConvertedLayer,
    table_kernels: bool = False,
) -> dict[str, Any]:
    def call(marks: _Marks, kernels: bool = kernels) -> registry.ConvertedLayer:
        return staged(
            source,
            tensors,
            quant,
            target,
            num_experts=experts,
            kernels=kernels,
            marks=marks,
            table_kernels=table_kernels,
        )

    def whole() -> object:
        if table_kernels:
            return repack_variants.try_table(source, tensors, quant, target, num_experts=experts)
        return direct.try_direct(
            source, tensors, quant, target, num_experts=experts, kernels=kernels
        )

    first = call(_Marks(device))
    same = identical(first, reference)
    del first
    device_ms: list[list[float]] = []
    host_ms: list[list[float]] = []
    for _ in range(rounds):
        marks = _Marks(device)
        _sync(device)
        call(marks)
        dev, host = marks.spans()
        device_ms.append(dev)
        host_ms.append(host)
    # The whole `try_direct` call timed as bench/convert_bench.py times it (synchronize,
    # event, call, event): set against the staged total, it tells a cost of the call
    # itself from a difference between the two scripts' runs.
    timer = Timer(device)
    call_ms = statistics.median(1e3 * timer(whole) for _ in range(rounds))
    weight_ms, moved = weight_only(
        source,
        tensors,
        quant,
        target,
        num_experts=experts,
        kernels=kernels,
        device=device,
        rounds=rounds,
        table_kernels=table_kernels,
    )
    try:
        top, totals = kernel_table(lambda: call(_Marks(device)), device)
    except Exception as exc:  # the profiler is extra: its failure keeps the timings
        top, totals = [], {"launches": "-", "kernel ms": "-", "ops": f"profiler: {exc!r}"}
    stages = [
        {
            "stage": name,
            "device ms": round(statistics.median(d[i] for d in device_ms), 3),
            "host ms": round(statistics.median(h[i] for h in host_ms), 3),
        }
        for i, name in enumerate(STAGES)
    ]
    total = statistics.median(sum(d) for d in device_ms)
    floor = moved / bandwidth * 1e3
    return {
        "identical to canonical": same,
        "total device ms": round(total, 3),
        "call ms (as the bench)": round(call_ms, 3),
        "stages": stages,
        "weight-only device ms": round(weight_ms, 3),
        "weight floor ms": round(floor, 3),
        "weight fraction of bandwidth": f"{100 * floor / weight_ms:.1f} %",
        "kernels": top,
        **totals,
    }


def profile_pair(
    source: str,
    target: str,
    *,
    tensors: dict[str, torch.Tensor],
    shape: dict[str, int],
    device: torch.device,
    rounds: int,
    bandwidth: float,
    routes: tuple[str, ...] = ("direct", "triton"),
) -> dict[str, Any]:
    quant = SourceQuantization(bits=4, group_size=shape["group_size"])
    experts = shape["num_experts"]
    reference = canonical(source, tensors, quant, target, num_experts=experts)
    out: dict[str, Any] = {"source": source, "target": target, "routes": {}}
    for route in routes:
        flags = ROUTE_FLAGS[route]
        kernels, table_kernels = flags["kernels"], flags["table_kernels"]
        if kernels and not gpu_repack.usable(device):
            continue
        if table_kernels and (source, target) not in repack_variants.TABLE_KERNELS:
            continue
        try:
            out["routes"][route] = _profile_route(
                source,
                target,
                tensors=tensors,
                quant=quant,
                experts=experts,
                kernels=kernels,
                device=device,
                rounds=rounds,
                bandwidth=bandwidth,
                reference=reference,
                table_kernels=table_kernels,
            )
        except Exception as exc:  # one failing route keeps the other's figures
            out["routes"][route] = {"failed": f"{exc!r}"[:400]}
        brief = {k: v for k, v in out["routes"][route].items() if k != "ops"}
        print(
            f"  {source} -> {target} ({route}): {json.dumps(brief)}",
            file=sys.stderr,
            flush=True,
        )
    return out


def report(results: list[dict[str, Any]], header: str) -> str:
    lines = [header, ""]
    summary = []
    for pair in results:
        for route, r in pair["routes"].items():
            if "failed" in r:
                failed = {"source": pair["source"], "target": pair["target"], "route": route}
                summary.append({**failed, "total ms": r["failed"]})
                continue
            summary.append(
                {
                    "source": pair["source"],
                    "target": pair["target"],
                    "route": route,
                    "total ms": r["total device ms"],
                    "call ms": r["call ms (as the bench)"],
                    **{s["stage"]: f"{s['device ms']} ({s['host ms']})" for s in r["stages"]},
                    "weight only ms": r["weight-only device ms"],
                    "weight floor ms": r["weight floor ms"],
                    "weight % BW": r["weight fraction of bandwidth"],
                    "launches": r["launches"],
                    "kernel ms": r["kernel ms"],
                    "identical": r["identical to canonical"],
                }
            )
    lines += [
        "Stages: device ms (host ms) per stage of one call, medians; call ms: the whole "
        "try_direct call timed as convert_bench times it; weight only: both weight "
        "writes with inputs and views prepared; launches and kernel ms from torch.profiler "
        "(one call).",
        "",
        markdown(summary),
        "",
    ]
    for pair in results:
        for route, r in pair["routes"].items():
            if "failed" in r:
                continue
            lines += [f"Top kernels, {pair['source']} -> {pair['target']} ({route}):", ""]
            lines += [markdown(r["kernels"]) if r["kernels"] else "(no CUDA kernels)", ""]
            lines += ["```", r["ops"].rstrip(), "```", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sources", nargs="+", default=["gptq", "awq"])
    parser.add_argument("--targets", nargs="+", default=["TRITON", "MARLIN"])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--routes",
        nargs="+",
        default=["direct", "triton"],
        choices=list(ROUTE_FLAGS),
        help="`table` (the int4 Marlin pairs only) is off by default: it lengthens the run",
    )
    parser.add_argument("--quick", action="store_true", help="smaller shapes (a smoke run)")
    parser.add_argument("--markdown", help="also write the report to this file")
    parser.add_argument("--json", help="also write the raw figures to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    shape, layer = bench_layer(args.quick, device)
    bandwidth = copy_bandwidth(device, size=(1 << 30) if device.type == "cuda" else 1 << 26)
    results = []
    for source in args.sources:
        quant = SourceQuantization(bits=4, group_size=shape["group_size"])
        tensors = write_checkpoint(LAYOUTS[source], layer, quant, naming="mixtral")
        for target in args.targets:
            results.append(
                profile_pair(
                    source,
                    target,
                    tensors=tensors,
                    shape=shape,
                    device=device,
                    rounds=args.rounds,
                    bandwidth=bandwidth,
                    routes=tuple(args.routes),
                )
            )
        del tensors
    where = str(device)
    if device.type == "cuda":
        where += f" ({torch.cuda.get_device_name(device)})"
    header = (
        f"Repack profile: layer {shape} int4 on {where}, torch {torch.__version__}; copy "
        f"bandwidth {bandwidth / GB:.1f} GB/s; medians of {args.rounds} after a warm-up"
    )
    text = report(results, header)
    print("\n" + text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
