#!/usr/bin/env python
"""The register-operand prefill kernels against v3 (TRITON as shipped) and humming, one GPU.

For each layer shape and token count (int4 g128 symmetric on every shape; the int8 and
group-32 asymmetric variants on Qwen3): fresh random codes, scales and inputs; the shipped
TRITON forward (its tuned table or heuristic: the v3 prefill kernels at these sizes),
HUMMING, and the register-operand kernels (`prefill_rs.py`) at a few candidate tiles
(the word layout where the layer allows it, and for the first candidate also the
re-paired byte layout), each
checked against the fp32 dequantized reference (output NaN-filled first, every element
finite, rel. err. < 1e-2) and timed as moe_bench.py times (the whole forward in one CUDA
graph, median of do_bench replays, L2 flushed). Also the re-layout's time per layer.

    PYTHONPATH=. python bench/prefill_rs_bench.py --out $OUT [--shapes mixtral,qwen3]

Writes prefill_rs_bench.md/.json under --out (the table, the best candidate's tiles per point,
every candidate's time and error) and `prefill_rs_rows.json`: the best candidate per point
as tuned-table rows (service/kernels/triton/configs/ format).
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

import torch
from _common import TOLERANCE, rel_err, time_forward, write_results
from _common import ceilings as measure_ceilings
from gpu_suite import VARIANTS, build_backend, environment, poison, random_layer
from moe_bench import PRIMARY, SHAPES, expected_experts, floor

from service.formats.registry import writer_for
from service.formats.writers import ConversionOptions
from service.kernels.activation import resolve
from service.kernels.emulation import reference_forward
from service.kernels.interface import LayerSpec
from service.kernels.routing import topk_route
from service.kernels.triton import prefill_rs
from service.kernels.triton.config import PREFILL_RS, GemmTile, KernelConfig
from service.kernels.triton.experts import TritonWNA16Experts
from service.kernels.triton.tuned import config_key, config_to_dict

TOKENS = (16, 64, 256, 1024, 4096)
EXTRA = (("qwen3", "int8-g128-sym", (16, 256, 4096)), ("qwen3", "int4-g32-zp", (16, 256, 4096)))


def log(message: str) -> None:
    print(message, flush=True)


def _rs(
    bm: int,
    bn: int,
    bk: int,
    warps: int,
    stages: int,
    *,
    bn2: int | None = None,
    after: bool = True,
    split: int = 1,
) -> KernelConfig:
    w13 = GemmTile(bn, bk, warps, stages, scale_after=after)
    w2 = GemmTile(bn2 or bn, bk, warps, stages, split_k=split, scale_after=after)
    return KernelConfig(bm, w13, w2, kernel=PREFILL_RS)


def candidates(m: int, top_k: int, experts: int, hidden: int, num_sms: int) -> list[KernelConfig]:
    """A few tiles per point, by routes per active expert (the first is the reference for
    the plain-dequantization comparison). w2 split-K where few programs exist."""
    routes = m * top_k
    active = min(experts, routes)
    per_expert = routes / active

    def split_for(bm: int, bn: int) -> int:
        programs = max(active, -(-routes // bm)) * -(-hidden // bn)
        split = 1
        while bm <= 32 and programs * split * 2 <= 4 * num_sms and split < 8:
            split *= 2
        return split

    out: list[KernelConfig] = []
    if per_expert <= 24:
        out += [
            _rs(16, 64, 128, 4, 4, split=split_for(16, 64)),
            _rs(16, 128, 128, 4, 3, split=split_for(16, 128)),
            _rs(16, 64, 128, 4, 3, split=2 * split_for(16, 64)),
        ]
    if 4 < per_expert <= 48:
        out += [_rs(32, 64, 128, 4, 4, split=split_for(32, 64)), _rs(32, 128, 128, 8, 3)]
    if 16 < per_expert <= 160:
        out += [_rs(64, 64, 128, 4, 3), _rs(64, 128, 128, 8, 3)]
    if per_expert > 96:
        out += [
            _rs(128, 128, 128, 8, 3, after=False),
            _rs(128, 64, 128, 4, 3, after=False),
            _rs(128, 128, 128, 8, 2, after=False),
        ]
    return out


def describe(c: KernelConfig) -> str:
    a, b = c.w13, c.w2
    tail = "" if a.scale_after else " fold"
    return (
        f"bm{c.block_m} w13 {a.block_n}x{a.block_k} w{a.num_warps}s{a.num_stages} "
        f"w2 {b.block_n}x{b.block_k} k{b.split_k}{tail}"
    )


@dataclass
class Trial:
    label: str
    status: str = "error"
    us: float | None = None
    rel_err: float | None = None
    graph_rel_err: float | None = None
    config: dict[str, Any] | None = None
    note: str = ""


@dataclass
class Row:
    shape: str
    variant: str
    tokens: int
    floor_us: float
    bound: str
    trials: list[Trial] = field(default_factory=list)

    def get(self, prefix: str) -> list[Trial]:
        return [t for t in self.trials if t.label.startswith(prefix) and t.status == "pass"]

    def best_rs(self) -> Trial | None:
        ok = [t for t in self.get("rs ") if t.us is not None]
        return min(ok, key=lambda t: t.us or 0.0) if ok else None


def trial(label: str, fn: Any, x: torch.Tensor, ref: torch.Tensor, device: Any) -> Trial:
    """Check `fn(out)` against `ref` (NaN-filled output), then time it in a CUDA graph."""
    result = Trial(label)
    try:
        poison(device, 64 << 20)
        out = torch.full_like(x, float("nan"))
        fn(out)
        torch.cuda.synchronize(device)
        result.rel_err = rel_err(out, ref)
        ok = bool(torch.isfinite(out).all()) and result.rel_err < TOLERANCE
        graph_out = torch.full_like(x, float("nan"))
        timing, graph = time_forward(lambda: fn(graph_out), device, rep_ms=60)
        result.us = timing.us
        if graph is not None:
            graph_out.fill_(float("nan"))
            graph.replay()
        torch.cuda.synchronize(device)
        result.graph_rel_err = rel_err(graph_out, ref)
        ok = ok and result.graph_rel_err < TOLERANCE and timing.mode == "graph"
        result.status = "pass" if ok else "FAIL"
        del graph
    except Exception as exc:
        result.note = repr(exc)[:200]
        log(f"    {label}: {exc!r}\n{traceback.format_exc(limit=-4)}")
    log(
        f"    {label:48s} {result.status:5s} {result.us or float('nan'):9.1f} us "
        f"rel {result.rel_err} graph {result.graph_rel_err}"
    )
    return result


def run_case(
    shape_key: str,
    variant_name: str,
    tokens: tuple[int, ...],
    *,
    device: Any,
    ceil: tuple[float, float],
    seed: int,
    deadline: float,
    humming: bool,
) -> tuple[list[Row], dict[str, Any]]:
    shape, variant = SHAPES[shape_key], VARIANTS[variant_name]
    layer = random_layer(shape, variant, seed, device)
    spec = LayerSpec.from_canonical(layer, layout="TRITON")
    options = ConversionOptions(device=device, activation_dtype=torch.bfloat16)
    tensors = dict(writer_for("TRITON")(layer, source="gptq", options=options).tensors)
    shipped = TritonWNA16Experts()
    shipped.prepare(tensors, spec)
    # The re-layout's time (median of 5, after one warm-up) and the tensors it makes.
    prefill_rs.relayout(tensors, spec)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        rs_t = prefill_rs.relayout(tensors, spec)
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end))
        del rs_t
    rs_t = prefill_rs.relayout(tensors, spec)
    relayout_ms = sorted(times)[2]
    # The re-paired byte layout too, where the word layout is the default (first candidate).
    rs_bytes = (
        prefill_rs.relayout(tensors, spec, words=False) if prefill_rs.word_layout(spec) else None
    )
    log(f"  re-layout: {relayout_ms:.3f} ms")
    hum = None
    if humming:
        try:
            hum, _ = build_backend("HUMMING", layer, device)
            warm = getattr(hum, "warm_up", None)
            if warm is not None:
                warm(list(tokens), shape.top_k)
        except Exception as exc:
            log(f"  HUMMING unavailable: {exc!r}")
    act = resolve("silu")
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + 1)
    bandwidth, rate = ceil
    rows: list[Row] = []
    for m in tokens:
        if time.perf_counter() > deadline:
            log(f"  M={m}: skipped (time budget)")
            continue
        x = torch.randn((m, shape.hidden), generator=gen, device=device).to(torch.bfloat16)
        logits = torch.randn((m, shape.experts), generator=gen, device=device)
        weights, ids = topk_route(logits, shape.top_k, renormalize=True)
        seen = int(torch.unique(ids).numel())
        fl = floor(shape, variant, m, bandwidth=bandwidth, rate=rate, experts=seen)
        row = Row(shape.name, variant.name, m, fl.us, fl.bound)
        ref = reference_forward(layer, x, ids, weights, act)
        log(f"  M={m} floor {fl.us:.1f} us ({fl.bound}), experts {seen} "
            f"(expected {expected_experts(shape, m):.1f})")  # fmt: skip
        v3 = shipped.config_for(m, shape.top_k, device)
        inputs = (x, ids, weights)
        peers = [(f"v3 {v3.kernel} bm{v3.block_m}", shipped)]
        if hum is not None:
            peers.append(("humming", hum))
        for label, backend in peers:

            def run_peer(o: torch.Tensor, b: Any = backend, a: Any = inputs) -> Any:
                return b.forward(*a, "silu", out=o)

            row.trials.append(trial(label, run_peer, x, ref, device))
        configs = candidates(m, shape.top_k, shape.experts, shape.hidden, num_sms)
        for n, config in enumerate(configs):
            layouts = [("rs ", rs_t)]
            if n == 0 and rs_bytes is not None:
                layouts.append(("rs-bytes ", rs_bytes))
            for prefix, lt in layouts:

                def fn(
                    o: torch.Tensor, c: KernelConfig = config, t: Any = lt, a: Any = inputs
                ) -> Any:
                    return prefill_rs.fused_moe_rs(*a, t, spec, act, c, out=o)

                label = prefix + describe(config)
                t = trial(label, fn, x, ref, device)
                t.config = config_to_dict(config)
                row.trials.append(t)
        rows.append(row)
    info = {"relayout_ms": relayout_ms, "key": config_key(spec, shape.top_k)}
    del shipped, hum, rs_t, rs_bytes, tensors, layer
    torch.cuda.empty_cache()
    return rows, info


def _us(trials: list[Trial]) -> float | None:
    ok = [t.us for t in trials if t.us is not None]
    return min(ok) if ok else None


def table(rows: list[Row]) -> str:
    lines = [
        "| shape | variant | M | floor µs (bound) | v3 µs | rs best µs | rs / v3 | humming µs "
        "| rs / humming | rs ×floor | rs, byte layout µs (first candidate's tiles) "
        "| rs best tiles | rel err v3 / rs / humming |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        v3, hum, best = _us(r.get("v3")), _us(r.get("humming")), r.best_rs()
        plain = _us(r.get("rs-bytes"))
        b = best.us if best else None

        def f(v: float | None) -> str:
            return "" if v is None else f"{v:.1f}"

        def ratio(a: float | None, c: float | None) -> str:
            return "" if a is None or c is None else f"{a / c:.2f}"

        errs = []
        for t in (r.get("v3"), [best] if best else [], r.get("humming")):
            errs.append(f"{t[0].rel_err:.1e}" if t and t[0].rel_err is not None else "–")
        fails = [t.label for t in r.trials if t.status != "pass"]
        lines.append(
            f"| {r.shape} | {r.variant} | {r.tokens} | {r.floor_us:.1f} ({r.bound}) | {f(v3)} "
            f"| {f(b)} | {ratio(b, v3)} | {f(hum)} | {ratio(b, hum)} | {ratio(b, r.floor_us)} "
            f"| {f(plain)} | {best.label[3:] if best else ''} | {' / '.join(errs)} |"
            + (f" FAILED: {', '.join(fails)}" if fails else "")
        )
    return "\n".join(lines)


def tuned_rows(rows: list[Row], keys: dict[tuple[str, str], str]) -> dict[str, Any]:
    """The best candidate per point where it beat v3, as tuned-table rows by layer key."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        best, v3 = r.best_rs(), _us(r.get("v3"))
        if best is None or best.config is None or v3 is None or (best.us or 0) >= v3:
            continue
        out.setdefault(keys[(r.shape, r.variant)], {})[str(r.tokens)] = best.config
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="mixtral,deepseek,qwen3,qwen15")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--no-extra", action="store_true", help="skip the int8 / g32-zp cases")
    parser.add_argument("--no-humming", action="store_true")
    parser.add_argument("--budget-s", type=float, default=420)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--out", default=os.environ.get("OUT", ""))
    parser.add_argument(
        "--merge-into",
        default="",
        help="a tuned table (configs/*.json) to add the winning rows to, written in place "
        "and to --out",
    )
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    started = time.perf_counter()
    deadline = started + args.budget_s
    env = environment(device)
    ceil = measure_ceilings(device)
    log("environment: " + json.dumps(env))
    log(f"ceilings: copy {ceil[0] / 1e12:.3f} TB/s, bf16 matmul {ceil[1] / 1e12:.0f} TFLOP/s")
    tokens = tuple(int(t) for t in args.tokens.split(","))
    cases = [(s, PRIMARY, tokens) for s in args.shapes.split(",") if s]
    if not args.no_extra:
        cases += list(EXTRA)
    rows: list[Row] = []
    infos: dict[str, Any] = {}
    keys: dict[tuple[str, str], str] = {}
    out_dir = Path(args.out) if args.out else None
    for n, (shape_key, variant, counts) in enumerate(cases):
        if time.perf_counter() > deadline:
            log(f"== {shape_key} {variant}: skipped (time budget)")
            continue
        log(f"== {shape_key} {variant} (t={time.perf_counter() - started:.0f} s)")
        got, info = run_case(
            shape_key, variant, counts, device=device, ceil=ceil, seed=args.seed + n,
            deadline=deadline, humming=not args.no_humming,
        )  # fmt: skip
        rows += got
        infos[f"{SHAPES[shape_key].name} {variant}"] = info
        keys[(SHAPES[shape_key].name, VARIANTS[variant].name)] = info["key"]
        text = table(rows)
        payload = {
            "environment": env,
            "ceilings": {"copy_Bps": ceil[0], "matmul_flops": ceil[1]},
            "cases": infos,
            "rows": [asdict(r) for r in rows],
        }
        write_results(out_dir, "prefill_rs_bench", text, payload)
        if out_dir is not None:
            rows_json = {"configs": tuned_rows(rows, keys)}
            (out_dir / "prefill_rs_rows.json").write_text(json.dumps(rows_json, indent=1))
    log(f"\n{env.get('gpu')} ({time.perf_counter() - started:.0f} s): copy "
        f"{ceil[0] / 1e12:.3f} TB/s, matmul {ceil[1] / 1e12:.0f} TFLOP/s")  # fmt: skip
    log("re-layout ms: " + ", ".join(f"{k} {v['relayout_ms']:.3f}" for k, v in infos.items()))
    log(table(rows))
    failed = [
        f"{r.shape} M={r.tokens} {t.label}" for r in rows for t in r.trials if t.status != "pass"
    ]
    log(f"\nfailed trials: {len(failed)} {failed[:12]}")
    if args.merge_into:
        merged = merge_rows(Path(args.merge_into), tuned_rows(rows, keys))
        if out_dir is not None:
            (out_dir / Path(args.merge_into).name).write_text(merged)
        log(f"merged the winning rows into {args.merge_into}")
    return 0


def merge_rows(path: Path, rows: dict[str, Any]) -> str:
    """Add `rows` (layer key -> token count -> config) to the tuned table at `path`, which is
    rewritten; a row of the same key and count is replaced. The new text."""
    table = json.loads(path.read_text()) if path.is_file() else {"configs": {}}
    for key, by_m in rows.items():
        table.setdefault("configs", {}).setdefault(key, {}).update(by_m)
        table["configs"][key] = dict(sorted(table["configs"][key].items(), key=lambda i: int(i[0])))
    table["made_by"] = (
        str(table.get("made_by", "")) + "; prefill_rs rows: bench/prefill_rs_bench.py"
    ).lstrip("; ")
    text = json.dumps(table, indent=1) + "\n"
    path.write_text(text)
    return text


if __name__ == "__main__":
    sys.exit(main())
