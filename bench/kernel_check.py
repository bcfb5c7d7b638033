#!/usr/bin/env python
"""Check and time our Triton WNA16 MoE kernel on one GPU, against the fp32 reference and the floor.

For Mixtral-8x7B and Qwen3-30B-A3B layer shapes and token counts 1, 16, 256, 4096, with
fresh random TRITON-layout weights (codes, scales, zero points) and fresh bf16 hidden
states routed by vLLM's default top-k on random logits:

* correctness: the output is filled with NaN first (and the kernel's intermediate too),
  the forward writes into it, every element must be finite, and ||out - ref|| / ||ref||
  against EMULATION's float32 forward must be under the tolerance (1e-2 for bf16, 3e-3 for
  fp16 activations);
* time: the whole forward (alignment, both GEMMs, activation, weighted top-k sum, final
  cast) captured in one CUDA graph, median of `triton.testing.do_bench` replays with the
  L2 flushed before each (the graph's own output is checked again after timing);
* the floor: max(bytes of the expected distinct experts' weights, scales and zero points
  over the measured copy bandwidth, FLOPs over the measured bf16 matmul rate), the same
  definition as shared/reference/peer_bench.md, whose vLLM Triton and humming figures for
  the int4 g128 rows are printed beside ours.

The primary variant (int4, group 128, symmetric, bf16, silu) runs at every point; the
other variants (asymmetric, int8, channelwise, fp16, swigluoai) on Qwen3 at 16 and 4096
tokens. `--sweep` also times a few alternative tile configurations at key points. Results
go to stdout (the table last) and, with `--out DIR` or $OUT, to kernel_check.json/.md.

    PYTHONPATH=. python bench/kernel_check.py [--sweep] [--out DIR]
    PYTHONPATH=. python bench/kernel_check.py --smoke     # CPU, interpreted, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from service.kernels.emulation import EmulationExperts  # noqa: E402
from service.kernels.interface import LayerSpec  # noqa: E402
from service.kernels.layouts import triton_to_canonical  # noqa: E402
from service.kernels.routing import topk_route  # noqa: E402
from service.kernels.triton.config import GemmTile, KernelConfig, choose_config  # noqa: E402
from service.kernels.triton.experts import TritonWNA16Experts  # noqa: E402
from service.kernels.triton.prefill import _moe_w2_kernel, _moe_w13_kernel  # noqa: E402

SHAPES = {
    "Mixtral-8x7B": (8, 4096, 14336, 2),
    "Qwen3-30B-A3B": (128, 2048, 768, 8),
}
TOKENS = (1, 16, 256, 4096)
SMOKE_SHAPES = {"tiny": (4, 128, 128, 2)}
SMOKE_TOKENS = (1, 5)

#: shared/reference/peer_bench.md, main table (int4 g128 sym, H200): (vLLM Triton, humming) µs.
PEERS = {
    ("Mixtral-8x7B", 1): (704.3, 80.3),
    ("Mixtral-8x7B", 16): (2860.3, 227.2),
    ("Mixtral-8x7B", 256): (2615.8, 520.4),
    ("Mixtral-8x7B", 4096): (26061.4, 5522.5),
    ("Qwen3-30B-A3B", 1): (80.2, 36.6),
    ("Qwen3-30B-A3B", 16): (681.5, 90.6),
    ("Qwen3-30B-A3B", 256): (751.7, 144.9),
    ("Qwen3-30B-A3B", 4096): (3132.5, 753.7),
}

TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3}


@dataclass(frozen=True)
class Variant:
    name: str
    bits: int
    group: int
    zero_points: bool
    dtype: torch.dtype = torch.bfloat16
    activation: str = "silu"


PRIMARY = Variant("int4 g128 sym", 4, 128, False)
VARIANTS = (
    Variant("int4 g32 asym", 4, 32, True),
    Variant("int4 g64 asym fp16", 4, 64, True, torch.float16),
    Variant("int8 channelwise sym", 8, -1, False),
    Variant("int8 g128 asym", 8, 128, True),
    Variant("int4 g128 sym swigluoai", 4, 128, False, activation="swigluoai"),
)
VARIANT_SHAPE, VARIANT_TOKENS = "Qwen3-30B-A3B", (16, 4096)


#: Alternative tiles tried with --sweep: (label, block_m, w13 tile, w2 tile). The run of
#: 2026-11-30 that set the shipped table swept more (bench/KERNEL_NOTES.md).
def _t(
    bn: int, bk: int, warps: int = 4, stages: int = 3, *, swap: bool = False, split: int = 1
) -> GemmTile:
    return GemmTile(bn, bk, warps, stages, split, swap)


SWEEP = {
    ("Mixtral-8x7B", 1): [
        ("w13 plain bn32 bk256 s3", 16, _t(32, 256), _t(64, 128, 4, 4, swap=True, split=4)),
        ("all plain bn32 bk256", 16, _t(32, 256), _t(32, 256)),
    ],
    ("Mixtral-8x7B", 256): [
        ("w2 no split", 64, _t(64, 128), _t(128, 64)),
    ],
    ("Qwen3-30B-A3B", 1): [
        ("plain bn32 bk128 s4, no split", 16, _t(32, 128, 4, 4), _t(64, 128, 4, 4)),
    ],
}


def log(message: str) -> None:
    print(message, flush=True)


def make_layer(
    shape: tuple[int, int, int, int], variant: Variant, device: torch.device, seed: int
) -> tuple[dict[str, torch.Tensor], LayerSpec]:
    """Random TRITON-layout tensors (every byte random: codes and zero points in both nibbles)."""
    e, h, i, _ = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    levels = 1 << variant.bits
    per_byte = 8 // variant.bits
    tensors: dict[str, torch.Tensor] = {}
    for name, n, k in (("w13", 2 * i, h), ("w2", h, i)):
        groups = 1 if variant.group == -1 else k // variant.group
        tensors[f"{name}_qweight"] = torch.randint(
            0, 256, (e, n, k // per_byte), generator=gen, device=device, dtype=torch.uint8
        )
        scale = 2.0 / (levels * math.sqrt(k))
        rand = torch.rand((e, n, groups), generator=gen, device=device)
        tensors[f"{name}_scales"] = ((rand + 0.5) * scale).to(variant.dtype)
        if variant.zero_points:
            rows = n // 2 if variant.bits == 4 else n
            tensors[f"{name}_qzeros"] = torch.randint(
                0, 256, (e, rows, groups), generator=gen, device=device, dtype=torch.uint8
            )
    spec = LayerSpec(e, h, i, variant.bits, variant.group, has_zero_points=variant.zero_points)
    return tensors, spec


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = out.to(torch.float64) - ref.to(torch.float64)
    return float(torch.linalg.norm(diff) / torch.linalg.norm(ref.to(torch.float64)))


def ceilings(device: torch.device) -> tuple[float, float]:
    """(copy bandwidth B/s counting read + write, bf16 matmul FLOP/s), measured here."""
    if device.type != "cuda":
        return 1e12, 1e13
    buffers = [torch.empty(1 << 30, dtype=torch.uint8, device=device).random_()]
    buffers.append(torch.empty_like(buffers[0]))
    ms = triton.testing.do_bench(
        lambda: buffers[1].copy_(buffers[0]), warmup=25, rep=200, return_mode="median"
    )
    bandwidth = 2 * buffers[0].numel() / (ms * 1e-3)
    buffers.clear()
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    return bandwidth, 2 * 8192**3 / (ms * 1e-3)


def floor_us(
    shape: tuple[int, int, int, int], variant: Variant, m: int, bandwidth: float, rate: float
) -> tuple[float, str, float]:
    """(floor µs, bound, expected distinct experts): peer_bench.md's definition."""
    e, h, i, k = shape
    experts = e * (1 - (1 - k / e) ** m)
    weights = 3 * h * i
    groups = weights / (h if variant.group == -1 else variant.group)  # approx. per projection
    per_expert = weights * variant.bits / 8 + groups * 2
    if variant.zero_points:
        per_expert += groups * variant.bits / 8
    memory = experts * per_expert / bandwidth * 1e6
    compute = 2 * m * k * weights / rate * 1e6
    return (memory, "mem", experts) if memory >= compute else (compute, "compute", experts)


def time_graph(fn: Any, device: torch.device) -> tuple[float, torch.Tensor]:
    """Median µs of the CUDA-graph replay of `fn()`, L2 flushed before each; and its output."""
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
    ms = triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")
    graph.replay()
    torch.cuda.synchronize()
    return ms * 1e3, out


@dataclass
class Row:
    shape: str
    variant: str
    tokens: int
    config: str
    floor_us: float
    bound: str
    experts: float
    triton_us: float
    align_us: float
    rel_err: float
    graph_rel_err: float
    written: bool
    passed: bool
    note: str = ""


def describe(config: KernelConfig) -> str:
    c1, c2 = config.w13, config.w2
    return (
        f"bm{config.block_m} w13 {c1.block_n}x{c1.block_k} w{c1.num_warps}s{c1.num_stages} "
        f"w2 {c2.block_n}x{c2.block_k} w{c2.num_warps}s{c2.num_stages} k{c2.split_k}"
    )


def run_point(
    shape_name: str,
    shape: tuple[int, int, int, int],
    variant: Variant,
    m: int,
    *,
    tensors: dict[str, torch.Tensor],
    spec: LayerSpec,
    reference: EmulationExperts,
    device: torch.device,
    ceil: tuple[float, float],
    config: KernelConfig | None = None,
    label: str = "",
) -> Row:
    e, h, _, k = shape
    num_sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 4
    )
    config = config or choose_config(m, k, spec, num_sms)
    checked = TritonWNA16Experts(config, poison_workspace=True)
    checked.prepare(tensors, spec)
    timed = TritonWNA16Experts(config)
    timed.prepare(tensors, spec)
    x = torch.randn(m, h, device=device).to(variant.dtype)
    weights, ids = topk_route(torch.randn(m, e, device=device), k)
    out = torch.full((m, h), float("nan"), dtype=variant.dtype, device=device)
    checked.forward(x, ids, weights, variant.activation, out=out)
    written = bool(torch.isfinite(out).all())
    ref = reference.forward_fp32(x, ids, weights, variant.activation)
    err = rel_err(out, ref)
    t_us, graph_out = time_graph(lambda: timed.forward(x, ids, weights, variant.activation), device)
    graph_err = rel_err(graph_out, ref)
    from service.kernels.align import align_block_size

    align_us, _ = time_graph(lambda: align_block_size(ids, config.block_m, e), device)
    floor, bound, experts = floor_us(shape, variant, m, *ceil)
    tol = TOL[variant.dtype]
    passed = written and err < tol and graph_err < tol
    return Row(
        shape_name,
        variant.name,
        m,
        label or describe(config),
        floor,
        bound,
        experts,
        t_us,
        align_us,
        err,
        graph_err,
        written,
        passed,
    )


def kernel_report(device: torch.device) -> list[dict[str, Any]]:
    """Registers, spills, shared memory and MMA kind of every compiled GEMM specialisation."""
    report: list[dict[str, Any]] = []
    if device.type != "cuda":
        return report
    for fn in (_moe_w13_kernel, _moe_w2_kernel):
        try:
            caches = fn.device_caches[torch.cuda.current_device()][0]
        except Exception:
            continue
        for compiled in caches.values():
            try:
                ptx = compiled.asm.get("ptx", "")
                consts = getattr(getattr(compiled, "src", None), "constants", {})
                picked = {
                    str(key): value
                    for key, value in dict(consts).items()
                    if str(key).isupper() or "BLOCK" in str(key)
                }
                report.append(
                    {
                        "kernel": fn.__name__,
                        "constexprs": {k: str(v) for k, v in picked.items()},
                        "regs": compiled.n_regs,
                        "spills": compiled.n_spills,
                        "shared": compiled.metadata.shared,
                        "warps": compiled.metadata.num_warps,
                        "wgmma": "wgmma" in ptx,
                        "mma_sync": "mma.sync" in ptx,
                        "cp_async": "cp.async" in ptx,
                    }
                )
            except Exception as exc:  # introspection is best effort
                report.append({"kernel": fn.__name__, "error": repr(exc)})
    return report


def table(rows: list[Row]) -> str:
    lines = [
        "| shape | variant | M | floor µs (bound) | TRITON µs | ×floor | align µs | "
        "vLLM Triton µs | humming µs | vs humming | rel err (graph) | written | pass | tiles |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|",
    ]
    for r in rows:
        peers = PEERS.get((r.shape, r.tokens)) if r.variant == PRIMARY.name else None
        vllm = f"{peers[0]:.1f}" if peers else "-"
        humming = f"{peers[1]:.1f}" if peers else "-"
        versus = f"{r.triton_us / peers[1]:.2f}" if peers else "-"
        lines.append(
            f"| {r.shape} | {r.variant} | {r.tokens} | {r.floor_us:.1f} ({r.bound}) | "
            f"{r.triton_us:.1f} | {r.triton_us / r.floor_us:.2f} | {r.align_us:.1f} | {vllm} | "
            f"{humming} | {versus} | {r.rel_err:.1e} ({r.graph_rel_err:.1e}) | "
            f"{'yes' if r.written else 'NO'} | {'ok' if r.passed else 'FAIL'} | {r.config} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU/interpreter, tiny shapes")
    parser.add_argument("--sweep", action="store_true", help="also time alternative tiles")
    parser.add_argument("--no-variants", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    tokens = SMOKE_TOKENS if args.smoke else TOKENS
    started = time.perf_counter()
    ceil = ceilings(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log(f"device {name}; torch {torch.__version__}; triton {triton.__version__}")
    log(f"ceilings: copy {ceil[0] / 1e12:.3f} TB/s, bf16 matmul {ceil[1] / 1e12:.1f} TFLOP/s")
    rows: list[Row] = []
    sweep_rows: list[Row] = []
    plan: list[tuple[str, Variant, tuple[int, ...]]] = [(s, PRIMARY, tokens) for s in shapes]
    if not args.no_variants:
        vshape = next(iter(shapes)) if args.smoke else VARIANT_SHAPE
        vtokens = tokens if args.smoke else VARIANT_TOKENS
        plan += [(vshape, v, vtokens) for v in VARIANTS]
    out_dir = Path(args.out) if args.out else None

    def save() -> None:
        if out_dir is None:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        data = {
            "device": name,
            "ceilings": {"copy_Bps": ceil[0], "bf16_flops": ceil[1]},
            "rows": [asdict(r) for r in rows],
            "sweep": [asdict(r) for r in sweep_rows],
            "kernels": kernel_report(device),
            "command": " ".join(sys.argv),
        }
        (out_dir / "kernel_check.json").write_text(json.dumps(data, indent=1, default=str))
        (out_dir / "kernel_check.md").write_text(table(rows) + "\n\nsweep\n" + table(sweep_rows))

    for seed, (shape_name, variant, counts) in enumerate(plan):
        shape = shapes[shape_name]
        tensors, spec = make_layer(shape, variant, device, seed)
        reference = EmulationExperts()
        canonical = triton_to_canonical(tensors, bits=variant.bits, group_size=variant.group)
        reference.prepare(canonical, LayerSpec.from_canonical(canonical))
        for m in counts:
            try:
                row = run_point(
                    shape_name, shape, variant, m, tensors=tensors, spec=spec,
                    reference=reference, device=device, ceil=ceil,
                )  # fmt: skip
            except Exception:
                traceback.print_exc()
                row = Row(shape_name, variant.name, m, "error", 1, "-", 0, math.nan, math.nan,
                          math.nan, math.nan, False, False, "exception")  # fmt: skip
            rows.append(row)
            log(f"[{time.perf_counter() - started:6.1f}s] {table([row]).splitlines()[-1]}")
            if args.sweep and variant == PRIMARY:
                for label, bm, w13, w2 in SWEEP.get((shape_name, m), []):
                    config = KernelConfig(bm, w13, w2)
                    try:
                        srow = run_point(
                            shape_name, shape, variant, m, tensors=tensors, spec=spec,
                            reference=reference, device=device, ceil=ceil, config=config,
                            label=label,
                        )  # fmt: skip
                        sweep_rows.append(replace(srow, config=f"{label}: {describe(config)}"))
                        log(f"  sweep {label}: {srow.triton_us:.1f} µs err {srow.rel_err:.1e}")
                    except Exception as exc:
                        log(f"  sweep {label}: failed {exc!r}")
        save()
        del tensors, reference, canonical
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for entry in kernel_report(device):
        log(f"compiled {entry}")
    log(f"total {time.perf_counter() - started:.1f}s")
    if sweep_rows:
        log("\nsweep\n" + table(sweep_rows))
    log("\n" + table(rows))
    save()
    return 0 if all(r.passed for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
