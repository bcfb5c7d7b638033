#!/usr/bin/env python
"""Time the two prefill generations of our Triton kernel (v3, v4) at every tuned-table point.

One H200 call decides which prefill generation stays. At each point of the shipped table
(Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V3; M = 1, 16, 256, 4096; int4 g128 sym, bf16, silu)
both generations run with their own heuristic tiles and with the shipped row's tiles (the row
holds whichever generation won the tuning run; its tiles are tried under the other one too).
Every trial is checked as bench/tune_triton.py checks candidates (NaN-poisoned output and
intermediate, every element written, ||out - ref|| / ||ref|| < 1e-2 against EMULATION's
float32 forward) and timed as the whole forward in one CUDA graph, median of do_bench
replays with the L2 flushed, twice (two graphs, interleaved rounds) for the spread.

    PYTHONPATH=. python bench/prefill_ab.py --out $OUT
"""

# ruff: noqa: E501

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.kernel_check import PRIMARY, ceilings, floor_us
from bench.tune_triton import SHAPES, TOKENS, Bench, Trial, time_graph
from service.kernels.triton_wna16 import (
    KernelConfig,
    TritonWNA16Experts,
    choose_config,
    choose_config_v4,
    tuned_config,
)


def configs(name: str, spec, m: int, top_k: int, sms: int) -> list[tuple[str, KernelConfig]]:
    out = [("v3 heuristic", choose_config(m, top_k, spec, sms)), ("v4 default", choose_config_v4(m, top_k, spec, sms))]
    row = tuned_config(name, spec, m, top_k)
    if row is not None:
        as_v3 = replace(row, version="v3", fused_routes=False)
        as_v4 = replace(row, version="v4")
        out += [("v3 row tiles", as_v3), ("v4 row tiles", as_v4)]
    seen: list[KernelConfig] = []
    unique = []
    for label, config in out:
        if config not in seen:
            seen.append(config)
            unique.append((label, config))
    return unique


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--rep-ms", type=int, default=40)
    args = parser.parse_args()
    started = time.perf_counter()
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    name = torch.cuda.get_device_name(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    ceil = ceilings(device)
    print(f"device {name} ({sms} SMs); ceilings copy {ceil[0] / 1e12:.3f} TB/s, bf16 {ceil[1] / 1e12:.1f} TFLOP/s", flush=True)
    rows = []
    for seed, (shape_name, shape) in enumerate(SHAPES.items()):
        bench = Bench(shape, device, seed)
        top_k = shape[3]
        for m in TOKENS:
            floor, bound, _ = floor_us(shape, PRIMARY, m, *ceil)
            trials: list[tuple[str, KernelConfig, Trial]] = []
            for label, config in configs(name, bench.spec, m, top_k, sms):
                trial = bench.trial(m, label, config, args.rep_ms)
                trials.append((label, config, trial))
                print(f"[{time.perf_counter() - started:6.1f}s] {shape_name} M={m} {label}: {trial.us:.1f} us err {trial.rel_err:.1e} {'ok' if trial.passed else 'FAIL ' + trial.error}", flush=True)
            second = {}
            x, ids, weights, _ = bench.inputs_for(m)
            for label, config, trial in trials:
                if trial.passed:
                    timed = TritonWNA16Experts(config)
                    timed.prepare(bench.tensors, bench.spec)
                    second[label], _ = time_graph(lambda t=timed: t.forward(x, ids, weights, PRIMARY.activation), device, args.rep_ms)
            rows.append({
                "shape": shape_name, "tokens": m, "floor_us": floor, "bound": bound,
                "trials": [{"label": lb, "config": t.config, "us": t.us, "us_again": second.get(lb, math.nan),
                            "rel_err": t.rel_err, "passed": t.passed, "error": t.error} for lb, _, t in trials],
            })
        del bench
        torch.cuda.empty_cache()
    lines = ["| shape | M | floor µs | v3 heuristic | v3 row tiles | v4 default | v4 row tiles | best v3 | best v4 | v4/v3 | rel err v3 / v4 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    logs = []
    for r in rows:
        by = {t["label"]: t for t in r["trials"]}

        def cell(label: str) -> str:
            t = by.get(label)
            if t is None:
                return "-"
            return f"{t['us']:.1f} / {t['us_again']:.1f}" if t["passed"] else "FAIL"

        def best(gen: str) -> dict | None:
            ok = [t for t in r["trials"] if t["label"].startswith(gen) and t["passed"]]
            return min(ok, key=lambda t: min(t["us"], t["us_again"])) if ok else None

        b3, b4 = best("v3"), best("v4")
        u3 = min(b3["us"], b3["us_again"]) if b3 else math.nan
        u4 = min(b4["us"], b4["us_again"]) if b4 else math.nan
        logs.append(math.log(u4 / u3))
        lines.append(f"| {r['shape']} | {r['tokens']} | {r['floor_us']:.1f} | {cell('v3 heuristic')} | {cell('v3 row tiles')} | {cell('v4 default')} | {cell('v4 row tiles')} | {u3:.1f} | {u4:.1f} | {u4 / u3:.2f} | {b3['rel_err'] if b3 else math.nan:.1e} / {b4['rel_err'] if b4 else math.nan:.1e} |")
    good = [v for v in logs if not math.isnan(v)]
    summary = f"geomean v4/v3 over {len(good)} points: {math.exp(sum(good) / len(good)):.3f}" if good else "no points"
    table = "\n".join(lines) + "\n\n" + summary + f"\ntotal {time.perf_counter() - started:.1f}s\n"
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "prefill_ab.json").write_text(json.dumps(rows, indent=1, default=str))
        (Path(args.out) / "prefill_ab.md").write_text(table)
    print("\n" + table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
