#!/usr/bin/env python
"""Tune our Triton WNA16 MoE kernel on one GPU; write the winning tiles as the package's table.

For Mixtral-8x7B (8, 4096, 14336, top 2), Qwen3-30B-A3B (128, 2048, 768, top 8) and
DeepSeek-V3 (256, 7168, 2048, top 8), int4 group 128 symmetric, bf16, silu, at token
counts 1, 16, 256, 4096 (each the bucket of the token counts up to it):

1. the baseline first, at every point: the prefill kernels with the heuristic's tiles;
2. then candidates from a small space per regime (decode / mid / large token counts),
   taken round-robin across points until the time budget is spent, so every point gets
   some search even when the budget is short;
3. every candidate is checked before it may win: output and intermediate poisoned with
   NaN, every element written, ||out - ref|| / ||ref|| < 1e-2 against EMULATION's float32
   forward on fresh random data (weights, routing, hidden states); timed as the whole
   forward in one CUDA graph, median of `triton.testing.do_bench` replays, L2 flushed
   before each (do_bench's cache clearing);
4. the fastest checked candidate per point (the heuristic included) is
   written to `$OUT/triton_configs/<device>.json` in the format
   `service.kernels.triton.tuned.tuned_config` reads (copy it to
   service/kernels/triton/configs/); every timing to
   `$OUT/tune_results.json`; the comparison table (with the floor and the peers of
   shared/reference/peer_bench.md) to `$OUT/tune_table.md` and stdout, last.

    PYTHONPATH=. python bench/tune_triton.py --out $OUT [--budget-s 240] [--shapes Qwen3-30B-A3B]
    PYTHONPATH=. python bench/tune_triton.py --smoke     # CPU, interpreted, a tiny shape
"""

# ruff: noqa: E501

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from bench.kernel_check import (  # noqa: E402
    PEERS,
    PRIMARY,
    ceilings,
    floor_us,
    make_layer,
    rel_err,
)
from service.kernels.emulation import EmulationExperts  # noqa: E402
from service.kernels.interface import LayerSpec  # noqa: E402
from service.kernels.layouts import triton_to_canonical  # noqa: E402
from service.kernels.routing import topk_route  # noqa: E402
from service.kernels.triton.config import (  # noqa: E402
    GemmTile,
    KernelConfig,
    choose_config,
    fit_block_k,
)
from service.kernels.triton.experts import TritonWNA16Experts  # noqa: E402
from service.kernels.triton.tuned import config_key, config_to_dict  # noqa: E402

SHAPES = {
    "Mixtral-8x7B": (8, 4096, 14336, 2),
    "Qwen3-30B-A3B": (128, 2048, 768, 8),
    "DeepSeek-V3": (256, 7168, 2048, 8),
}
TOKENS = (1, 16, 256, 4096)
SMOKE_SHAPES = {"tiny": (4, 128, 128, 2)}
SMOKE_TOKENS = (1, 24)
#: shared/reference/peer_bench.md, main table: (vLLM Triton, humming) µs.
ALL_PEERS = {
    **PEERS,
    ("DeepSeek-V3", 1): (418.9, 82.6),
    ("DeepSeek-V3", 16): (6771.1, 612.8),
    ("DeepSeek-V3", 256): (12147.9, 2002.0),
    ("DeepSeek-V3", 4096): (29644.0, 6937.6),
}
TOL = 1e-2


def log(message: str) -> None:
    print(message, flush=True)


def _t(bn: int, bk: int, warps: int = 4, stages: int = 3, **kw: Any) -> GemmTile:
    return GemmTile(bn, bk, warps, stages, **kw)


def _fit(config: KernelConfig, spec: LayerSpec, top_k: int, m: int, sms: int) -> KernelConfig:
    """K tiles fitted to the layer, N tiles capped, and w2 split-K (when asked for with
    split_k=0) set to about four programs per SM, as the heuristic does."""
    h, i = spec.hidden_size, spec.intermediate_size
    g13 = h if spec.group_size == -1 else spec.group_size
    g2 = i if spec.group_size == -1 else spec.group_size
    w13 = replace(
        config.w13,
        block_n=min(config.w13.block_n, triton.next_power_of_2(i)),
        block_k=fit_block_k(config.w13.block_k, h, g13),
    )
    w2 = replace(
        config.w2,
        block_n=min(config.w2.block_n, triton.next_power_of_2(h)),
        block_k=fit_block_k(config.w2.block_k, i, g2),
    )
    if w2.split_k == 0:
        routes = m * top_k
        blocks = max(min(spec.num_experts, routes), triton.cdiv(routes, config.block_m))
        programs = blocks * triton.cdiv(h, w2.block_n)
        split = 1
        while split * 2 <= i // w2.block_k and programs * split * 2 <= 4 * sms:
            split *= 2
        w2 = replace(w2, split_k=split)
    return replace(config, w13=w13, w2=w2)


def candidates(m: int, top_k: int, spec: LayerSpec, sms: int) -> list[tuple[str, KernelConfig]]:
    """The search space at one point, most promising first (split_k=0: auto)."""
    per_expert = m * top_k / max(1, min(spec.num_experts, m * top_k))
    out: list[tuple[str, KernelConfig]] = []
    if per_expert <= 8:  # few routes per expert: bytes and launches
        for label, w13, w2 in (
            ("bn32 bk256", _t(32, 256, 4, 4), _t(64, 256, 4, 4, split_k=0)),
            ("bn16 bk256", _t(16, 256, 4, 4), _t(32, 256, 4, 4, split_k=0)),
            ("bn32 bk128 s5", _t(32, 128, 4, 5), _t(64, 128, 4, 5, split_k=0)),
            ("swap bn64 bk128", _t(64, 128, 4, 4, swap_ab=True), _t(64, 128, 4, 4, swap_ab=True, split_k=0)),
            ("bn64 bk128 w2 split1", _t(64, 128, 4, 4), _t(128, 128, 4, 4)),
            ("bn16 bk128 s4", _t(16, 128, 4, 4), _t(32, 128, 4, 4, split_k=0)),
        ):  # fmt: skip
            out.append((label, KernelConfig(16, w13, w2)))
    elif per_expert <= 96:  # mid: bytes, with many experts touched
        for label, bm, w13, w2 in (
            ("swap bm32 bn128 bk64", 32, _t(128, 64, 4, 3, swap_ab=True), _t(128, 64, 4, 3, swap_ab=True)),
            ("swap bm32 bn64 bk128", 32, _t(64, 128, 4, 4, swap_ab=True), _t(64, 128, 4, 4, swap_ab=True)),
            ("swap bm16 bn64 bk128", 16, _t(64, 128, 4, 4, swap_ab=True), _t(64, 128, 4, 4, swap_ab=True, split_k=0)),
            ("bm64 bn64 bk64", 64, _t(64, 64, 4, 3), _t(64, 64, 4, 3)),
            ("bm64 bn32 bk64 s4", 64, _t(32, 64, 4, 4), _t(64, 64, 4, 4)),
            ("swap bm64 bn128 bk64 w8", 64, _t(128, 64, 8, 3, swap_ab=True), _t(128, 64, 8, 3, swap_ab=True)),
            ("bm32 bn64 bk128", 32, _t(64, 128, 4, 4), _t(64, 128, 4, 4, split_k=0)),
        ):  # fmt: skip
            out.append((label, KernelConfig(bm, w13, w2)))
    else:  # large: the wgmma rate
        for label, bm, w13, w2 in (
            ("bm128 bn64 bk64 w8", 128, _t(64, 64, 8, 3), _t(64, 64, 8, 4)),
            ("bm128 bn32 bk64 w8 s4", 128, _t(32, 64, 8, 4), _t(64, 64, 8, 4)),
            ("bm128 bn64 bk32 w8 s4", 128, _t(64, 32, 8, 4), _t(64, 32, 8, 4)),
            ("bm64 bn64 bk64 w4", 64, _t(64, 64, 4, 3), _t(64, 64, 4, 3)),
            ("bm64 bn32 bk64 w4 s4", 64, _t(32, 64, 4, 4), _t(64, 64, 4, 4)),
            ("bm128 bn64 bk64 w8 s5", 128, _t(64, 64, 8, 5), _t(64, 64, 8, 5)),
        ):  # fmt: skip
            out.append((label, KernelConfig(bm, w13, w2)))
    return [(label, _fit(c, spec, top_k, m, sms)) for label, c in out]


@dataclass
class Trial:
    label: str
    config: dict[str, Any]
    us: float = math.nan
    rel_err: float = math.nan
    passed: bool = False
    error: str = ""


@dataclass
class Point:
    shape: str
    tokens: int
    floor_us: float
    bound: str
    trials: list[Trial] = field(default_factory=list)

    def best(self) -> Trial | None:
        ok = [t for t in self.trials if t.passed]
        return min(ok, key=lambda t: t.us) if ok else None

    def get(self, label: str) -> Trial | None:
        return next((t for t in self.trials if t.label == label), None)


class Bench:
    """One layer shape on the device: weights, the fp32 reference, and a trial runner."""

    def __init__(self, shape: tuple[int, int, int, int], device: torch.device, seed: int):
        self.shape, self.device = shape, device
        self.tensors, self.spec = make_layer(shape, PRIMARY, device, seed)
        canonical = triton_to_canonical(self.tensors, bits=PRIMARY.bits, group_size=PRIMARY.group)
        self.reference = EmulationExperts()
        self.reference.prepare(canonical, LayerSpec.from_canonical(canonical))
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def inputs_for(self, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, ids, weights, fp32 reference) for m tokens: fresh random, made once per m."""
        if m not in self.inputs:
            e, h, _, k = self.shape
            x = torch.randn(m, h, device=self.device).to(PRIMARY.dtype)
            weights, ids = topk_route(torch.randn(m, e, device=self.device), k)
            ref = self.reference.forward_fp32(x, ids, weights, PRIMARY.activation)
            self.inputs[m] = (x, ids, weights, ref)
        return self.inputs[m]

    def trial(self, m: int, label: str, config: KernelConfig, rep_ms: int) -> Trial:
        result = Trial(label, config_to_dict(config))
        try:
            x, ids, weights, ref = self.inputs_for(m)
            checked = TritonWNA16Experts(config, poison_workspace=True)
            checked.prepare(self.tensors, self.spec)
            out = torch.full_like(x, float("nan"))
            checked.forward(x, ids, weights, PRIMARY.activation, out=out)
            written = bool(torch.isfinite(out).all())
            result.rel_err = rel_err(out, ref)
            timed = TritonWNA16Experts(config)
            timed.prepare(self.tensors, self.spec)
            us, graph_out = time_graph(
                lambda: timed.forward(x, ids, weights, PRIMARY.activation), self.device, rep_ms
            )
            graph_err = rel_err(graph_out, ref)
            result.us = us
            result.passed = written and result.rel_err < TOL and graph_err < TOL
            if not result.passed:
                result.error = f"written={written} err={result.rel_err:.2e} graph={graph_err:.2e}"
        except Exception as exc:
            traceback.print_exc()
            result.error = repr(exc)[:300]
        return result


def time_graph(fn: Any, device: torch.device, rep_ms: int) -> tuple[float, torch.Tensor]:
    """Median µs of the CUDA-graph replay of `fn()` (L2 flushed before each by do_bench);
    the output of the last replay (after many: a leak between replays shows there)."""
    if device.type != "cuda":
        start = time.perf_counter()
        out = fn()
        return (time.perf_counter() - start) * 1e6, out
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    ms = triton.testing.do_bench(graph.replay, warmup=5, rep=rep_ms, return_mode="median")
    graph.replay()
    torch.cuda.synchronize()
    return ms * 1e3, out


def table(points: list[Point]) -> str:
    lines = [
        "| shape | M | floor µs | heuristic µs | best µs | best / heuristic | best ×floor | "
        "vLLM Triton µs | humming µs | best / humming | rel err | best config |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for p in points:
        base, best = p.get("heuristic"), p.best()
        peers = ALL_PEERS.get((p.shape, p.tokens))

        def us(t: Trial | None) -> str:
            if t is None:
                return "-"
            return f"{t.us:.1f}" if t.passed else "FAIL"

        b = best.us if best else math.nan
        ratio = f"{b / base.us:.2f}" if best and base and base.passed else "-"
        lines.append(
            f"| {p.shape} | {p.tokens} | {p.floor_us:.1f} ({p.bound}) | {us(base)} | "
            f"{us(best)} | {ratio} | {b / p.floor_us:.2f} | "
            f"{peers[0] if peers else '-'} | {peers[1] if peers else '-'} | "
            f"{f'{b / peers[1]:.2f}' if peers and best else '-'} | "
            f"{f'{best.rel_err:.1e}' if best else '-'} | {best.label if best else '-'} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU/interpreter, a tiny shape")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop searching after")
    parser.add_argument("--shapes", nargs="*", default=None)
    parser.add_argument("--tokens", nargs="*", type=int, default=None)
    parser.add_argument("--rep-ms", type=int, default=40)
    args = parser.parse_args()
    started = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        shapes = {name: shapes[name] for name in args.shapes}
    tokens = tuple(args.tokens or (SMOKE_TOKENS if args.smoke else TOKENS))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 4
    )
    ceil = ceilings(device)
    log(f"device {name} ({sms} SMs); torch {torch.__version__}; triton {triton.__version__}")
    log(f"ceilings: copy {ceil[0] / 1e12:.3f} TB/s, bf16 matmul {ceil[1] / 1e12:.1f} TFLOP/s")
    out_dir = Path(args.out) if args.out else None
    benches = {s: Bench(shape, device, seed) for seed, (s, shape) in enumerate(shapes.items())}
    points: list[Point] = []
    queues: list[tuple[Point, list[tuple[str, KernelConfig]]]] = []
    for shape_name, shape in shapes.items():
        spec = benches[shape_name].spec
        for m in tokens:
            floor, bound, _ = floor_us(shape, PRIMARY, m, *ceil)
            point = Point(shape_name, m, floor, bound)
            points.append(point)
            base = [("heuristic", choose_config(m, shape[3], spec, sms))]
            queues.append((point, base + candidates(m, shape[3], spec, sms)))

    def elapsed() -> float:
        return time.perf_counter() - started

    def save() -> None:
        if out_dir is None:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        tables: dict[str, dict[str, Any]] = {}
        for p in points:
            best = p.best()
            if best is None:
                continue
            key = config_key(benches[p.shape].spec, shapes[p.shape][3])
            tables.setdefault(key, {})[str(p.tokens)] = best.config
        configs = {
            "device": name,
            "triton": triton.__version__,
            "made_by": "bench/tune_triton.py " + " ".join(sys.argv[1:]),
            "configs": tables,
        }
        cfg_dir = out_dir / "triton_configs"
        cfg_dir.mkdir(exist_ok=True)
        file = "".join(c if c.isalnum() else "_" for c in name) + ".json"
        (cfg_dir / file).write_text(json.dumps(configs, indent=1) + "\n")
        results = {
            "device": name,
            "ceilings": {"copy_Bps": ceil[0], "bf16_flops": ceil[1]},
            "points": [asdict(p) for p in points],
            "command": " ".join(sys.argv),
        }
        (out_dir / "tune_results.json").write_text(json.dumps(results, indent=1, default=str))
        (out_dir / "tune_table.md").write_text(table(points) + "\n")

    # Baselines everywhere first, then one candidate per point per round.
    round_no = 0
    while any(q for _, q in queues):
        for point, queue in queues:
            if not queue:
                continue
            if round_no >= 2 and elapsed() > args.budget_s:
                queue.clear()
                continue
            label, config = queue.pop(0)
            if any(t.config == config_to_dict(config) for t in point.trials):
                continue  # the same tiles under another name
            trial = benches[point.shape].trial(point.tokens, label, config, args.rep_ms)
            point.trials.append(trial)
            status = (
                f"{trial.us:8.1f} µs err {trial.rel_err:.1e}"
                if trial.passed
                else f"FAIL {trial.error}"
            )
            log(f"[{elapsed():6.1f}s] {point.shape} M={point.tokens} {label}: {status}")
        round_no += 1
        save()
    log(f"total {elapsed():.1f}s")
    log("\n" + table(points))
    save()
    baselines_ok = all((t := p.get("heuristic")) is not None and t.passed for p in points)
    return 0 if baselines_ok and all(p.best() for p in points) else 1


if __name__ == "__main__":
    sys.exit(main())
