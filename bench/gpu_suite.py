#!/usr/bin/env python
"""The GPU correctness table: every MoE backend against the fp32 dequantized reference.

Runs on the H200 (scripts/gpu_test.sh starts it). For each layer shape (Mixtral-8x7B and
Qwen3-30B-A3B by default), each quantization variant and each backend (EMULATION, TRITON,
HUMMING, MARLIN, BATCHED_MARLIN): fresh random codes, scales and zero points on the GPU, the
layer written by that backend's writer, the backend prepared, then for each token count
(1, 16, 256, 4096) fresh bf16 hidden states and router logits routed with vLLM's default
top-k. Each run writes into an output filled with NaN, from a poisoned allocator (a block
of NaN bytes is allocated and freed first, so the buffers the backend takes from
torch.empty start as NaN too): an element left unwritten, here or upstream, stays NaN.
A row passes when the output is all finite and its relative error ||out - ref|| / ||ref||
against the float32 reference (dequantize in float32, compute in float32) is under the
tolerance. Device time is the median of CUDA
events over repeated runs.

A backend that cannot run (no humming, no Marlin library, a variant it refuses) gets a row
saying why; it never counts as a pass. The exit status is 1 if any row that ran failed, or
if any of `--require` did not run.

    python bench/gpu_suite.py [--smoke] [--shapes mixtral,qwen3] [--variants ...]
        [--tokens 1,16,256,4096] [--backends EMULATION,TRITON,HUMMING,MARLIN,BATCHED_MARLIN]
        [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.formats.canonical import QuantizedExperts, QuantizedMoELayer
from service.formats.errors import ConversionUnsupported
from service.formats.registry import writer_for
from service.formats.writers import ConversionOptions
from service.kernels import registry
from service.kernels.activation import apply as apply_activation
from service.kernels.activation import resolve
from service.kernels.errors import KernelError
from service.kernels.interface import ExpertsBackend, LayerSpec, load_backend_class
from service.kernels.routing import topk_route


@dataclass(frozen=True)
class Shape:
    name: str
    experts: int
    top_k: int
    hidden: int
    intermediate: int


SHAPES = {
    "mixtral": Shape("Mixtral-8x7B", experts=8, top_k=2, hidden=4096, intermediate=14336),
    "qwen3": Shape("Qwen3-30B-A3B", experts=128, top_k=8, hidden=2048, intermediate=768),
    "small": Shape("small", experts=8, top_k=2, hidden=512, intermediate=256),
}


@dataclass(frozen=True)
class Variant:
    name: str
    bits: int
    group_size: int
    zero_points: bool
    bias: bool = False


VARIANTS = {
    v.name: v
    for v in (
        Variant("int4-g128-sym", 4, 128, False),
        Variant("int4-g128-zp", 4, 128, True),
        Variant("int4-g32-zp", 4, 32, True),
        Variant("int4-ch-sym", 4, -1, False),
        Variant("int8-ch-sym", 8, -1, False),
        Variant("int8-g128-sym", 8, 128, False),
        Variant("int4-g128-sym-bias", 4, 128, False, bias=True),
    )
}

#: The backend table's backends (service/kernels/registry.py), the float32 reference first and
#: ours next: the suite's default order. Each is written by its own writer and prepared in its
#: layout, but for EMULATION, which takes the canonical layer itself.
BACKENDS = tuple(sorted(registry.RUNNABLE, key=lambda n: (n != "EMULATION", n != "TRITON")))
TOLERANCE = 1e-2
"""bf16 activations: products rounded to bf16 between the GEMMs give about 3e-3."""
POISON_BYTE = 0xFF
"""0xFFFF is NaN in bfloat16 and float16."""


@dataclass
class Row:
    shape: str
    variant: str
    backend: str
    tokens: int
    status: str  # "pass", "FAIL", "unavailable", "error"
    rel_error: float | None = None
    finite: bool | None = None
    device_ms: float | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def log(message: str) -> None:
    print(message, flush=True)


# ---------------------------------------------------------------------------------------
# Data


def random_experts(
    gen: torch.Generator, shape: tuple[int, int, int], variant: Variant, device: torch.device
) -> QuantizedExperts:
    """Random codes over the whole range, scales of about 1/sqrt(K) per step, zero points
    inside the range; bf16 scales, so no backend loses precision casting them."""
    e, n, k = shape
    levels = 1 << variant.bits
    groups = 1 if variant.group_size == -1 else k // variant.group_size
    codes = torch.randint(0, levels, (e, n, k), generator=gen, device=device, dtype=torch.uint8)
    step = 2.0 / (levels * math.sqrt(k))
    scales = (torch.rand((e, n, groups), generator=gen, device=device) + 0.5) * step
    zeros = None
    if variant.zero_points:
        zeros = torch.randint(
            1, levels - 1, (e, n, groups), generator=gen, device=device, dtype=torch.uint8
        )
    bias = None
    if variant.bias:
        bias = (torch.randn((e, n), generator=gen, device=device) * 0.05).to(torch.bfloat16)
    return QuantizedExperts(
        codes=codes,
        scales=scales.to(torch.bfloat16),
        bits=variant.bits,
        group_size=variant.group_size,
        zeros=zeros,
        bias=bias,
    )


def random_layer(
    shape: Shape, variant: Variant, seed: int, device: torch.device
) -> QuantizedMoELayer:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    e, h, i = shape.experts, shape.hidden, shape.intermediate
    return QuantizedMoELayer(
        w13=random_experts(gen, (e, 2 * i, h), variant, device),
        w2=random_experts(gen, (e, h, i), variant, device),
    )


class Reference:
    """The float32 forward with the layer's dense float32 weights (computed once)."""

    def __init__(self, layer: QuantizedMoELayer) -> None:
        self.w13 = layer.w13.dequantize(torch.float32)
        self.w2 = layer.w2.dequantize(torch.float32)
        self.b13 = None if layer.w13.bias is None else layer.w13.bias.float()
        self.b2 = None if layer.w2.bias is None else layer.w2.bias.float()

    def __call__(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, activation: str
    ) -> torch.Tensor:
        act = resolve(activation)
        m, top_k = ids.shape
        xf = x.float()
        out = torch.zeros(m, self.w2.shape[1], dtype=torch.float32, device=x.device)
        flat = ids.reshape(-1).long()
        flat_w = weights.reshape(-1).float()
        for expert in torch.unique(flat).tolist():
            routes = torch.nonzero(flat == expert).reshape(-1)
            tokens = routes // top_k
            h = xf[tokens] @ self.w13[expert].T
            if self.b13 is not None:
                h = h + self.b13[expert]
            y = apply_activation(h, act) @ self.w2[expert].T
            if self.b2 is not None:
                y = y + self.b2[expert]
            out.index_add_(0, tokens, y * flat_w[routes, None])
        return out

    def release(self) -> None:
        del self.w13, self.w2


# ---------------------------------------------------------------------------------------
# Backends


def backend_class(name: str) -> type[ExpertsBackend]:
    row = registry.backend(name)
    if row is None:
        raise KeyError(f"{name} is not in the backend table; one of {registry.RUNNABLE}")
    return load_backend_class(row.experts)


def build_backend(
    name: str, layer: QuantizedMoELayer, device: torch.device
) -> tuple[ExpertsBackend, dict[str, Any]]:
    """Write the layer for `name` with the registry's writer, prepare the backend."""
    cls = backend_class(name)
    reason = cls.unavailable_reason(device)
    if reason is not None:
        raise KernelUnavailable(reason)
    backend = cls()
    info: dict[str, Any] = {}
    if name == "EMULATION":
        backend.prepare(layer, LayerSpec.from_canonical(layer, layout="CANONICAL"))
        return backend, info
    spec = LayerSpec.from_canonical(layer, layout=name)
    start = time.perf_counter()
    options = ConversionOptions(device=device, activation_dtype=torch.bfloat16)
    converted = writer_for(name)(layer, source="gptq", options=options)
    torch.cuda.synchronize(device)
    info["convert_s"] = round(time.perf_counter() - start, 3)
    backend.prepare(converted.tensors, spec)
    return backend, info


class KernelUnavailable(Exception):  # noqa: N818
    pass


def poison(device: torch.device, nbytes: int) -> None:
    """Leave a freed block of NaN bytes in the caching allocator for the next torch.empty."""
    block = torch.empty(nbytes, dtype=torch.uint8, device=device)
    block.fill_(POISON_BYTE)
    del block


def time_ms(fn: Callable[[], torch.Tensor], reps: int) -> float:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends, strict=True):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
    return times[len(times) // 2]


# ---------------------------------------------------------------------------------------
# The table


def run_case(
    shape: Shape,
    variant: Variant,
    *,
    backends: list[str],
    tokens: list[int],
    device: torch.device,
    seed: int,
    reps: int,
) -> list[Row]:
    rows: list[Row] = []
    start = time.perf_counter()
    layer = random_layer(shape, variant, seed, device)
    reference = Reference(layer)
    log(f"  layer + reference weights: {time.perf_counter() - start:.1f} s")
    built: dict[str, ExpertsBackend] = {}
    for name in backends:
        start = time.perf_counter()
        try:
            backend, info = build_backend(name, layer, device)
        except (KernelUnavailable, ConversionUnsupported, KernelError) as exc:
            log(f"  {name}: unavailable: {exc}")
            rows += [
                Row(shape.name, variant.name, name, t, "unavailable", note=str(exc)[:160])
                for t in tokens
            ]
            continue
        except Exception as exc:
            log(f"  {name}: prepare failed: {exc!r}\n{traceback.format_exc(limit=-3)}")
            rows += [
                Row(shape.name, variant.name, name, t, "error", note=repr(exc)[:160])
                for t in tokens
            ]
            continue
        warm = getattr(backend, "warm_up", None)
        if warm is not None:
            warm(tokens, shape.top_k)
        torch.cuda.synchronize(device)
        info["prepare_s"] = round(time.perf_counter() - start, 2)
        log(f"  {name}: ready {info}")
        built[name] = backend
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + 1)
    for m in tokens:
        x = torch.randn((m, shape.hidden), generator=gen, device=device).to(torch.bfloat16)
        logits = torch.randn((m, shape.experts), generator=gen, device=device)
        weights, ids = topk_route(logits, shape.top_k, renormalize=True)
        ref = reference(x, ids, weights, "silu")
        ref_norm = float(ref.norm())
        rows_bytes = m * shape.top_k * (3 * shape.intermediate + 2 * shape.hidden) * 2
        for name, backend in built.items():
            row = Row(shape.name, variant.name, name, m, "error")
            try:
                poison(device, min(rows_bytes * 2 + (64 << 20), 16 << 30))
                out = torch.full_like(x, float("nan"))
                backend.forward(x, ids, weights, "silu", out=out)
                torch.cuda.synchronize(device)
                row.finite = bool(torch.isfinite(out).all())
                row.rel_error = float((out.float() - ref).norm()) / max(ref_norm, 1e-30)
                ok = row.finite and row.rel_error < TOLERANCE
                row.status = "pass" if ok else "FAIL"
                if name != "EMULATION" and reps:

                    def call(
                        b: ExpertsBackend = backend,
                        x: torch.Tensor = x,
                        ids: torch.Tensor = ids,
                        weights: torch.Tensor = weights,
                    ) -> torch.Tensor:
                        return b.forward(x, ids, weights, "silu")

                    call()
                    row.device_ms = round(time_ms(call, reps), 4)
            except Exception as exc:
                row.note = repr(exc)[:160]
                log(f"  {name} M={m}: {exc!r}\n{traceback.format_exc(limit=-3)}")
            rows.append(row)
            log(
                f"  {name:9s} M={m:5d} {row.status:5s} rel={row.rel_error} "
                f"finite={row.finite} ms={row.device_ms}"
            )
    del built
    reference.release()
    del layer
    torch.cuda.empty_cache()
    return rows


def table(rows: list[Row]) -> str:
    lines = [
        "| shape | variant | backend | tokens | status | rel. error | all written | device ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rel = "" if r.rel_error is None else f"{r.rel_error:.2e}"
        ms = "" if r.device_ms is None else f"{r.device_ms:.3f}"
        fin = "" if r.finite is None else ("yes" if r.finite else "NO")
        status = r.status if not r.note or r.status == "pass" else f"{r.status}: {r.note[:70]}"
        cells = (r.shape, r.variant, r.backend, r.tokens, status, rel, fin, ms)
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def environment(device: torch.device) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(device)
    env: dict[str, Any] = {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        env["humming"] = importlib.import_module("humming").__version__
    except Exception as exc:
        env["humming"] = f"unavailable: {exc}"
    from service.kernels import marlin

    try:
        marlin.load_op()
        env["marlin_op"] = f"{marlin.OP_NAMESPACE}.{marlin.OP_NAME} from {marlin.find_library()}"
    except KernelError as exc:
        env["marlin_op"] = f"unavailable: {exc}"
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="mixtral,qwen3")
    parser.add_argument("--variants", default="int4-g128-sym,int4-g128-zp,int8-ch-sym")
    parser.add_argument("--tokens", default="1,16,256,4096")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument(
        "--require",
        default="EMULATION,TRITON,HUMMING,MARLIN,BATCHED_MARLIN",
        help="backends that must have run (else exit 1)",
    )
    parser.add_argument("--reps", type=int, default=10, help="timed runs per row (0: none)")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--smoke", action="store_true", help="small shape, two variants")
    parser.add_argument("--out", default=os.environ.get("OUT", ""))
    parser.add_argument(
        "--budget-s",
        type=float,
        default=0,
        help="start no new case after this many seconds (0: no limit); skipped cases are listed",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        log("no CUDA device: the GPU suite needs one")
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    if args.smoke:
        args.shapes, args.variants, args.tokens = "small", "int4-g128-sym,int4-g128-zp", "1,16,256"
    env = environment(device)
    log("environment: " + json.dumps(env))
    backends = [b for b in args.backends.split(",") if b]
    tokens = [int(t) for t in args.tokens.split(",")]
    rows: list[Row] = []
    started = time.perf_counter()
    out_dir = Path(args.out) if args.out else None
    # Variant-major order: with a time budget, every shape gets the first variant first.
    cases = [
        (SHAPES[shape_key], VARIANTS[variant_key])
        for variant_key in args.variants.split(",")
        for shape_key in args.shapes.split(",")
    ]
    skipped: list[str] = []
    for shape, variant in cases:
        elapsed = time.perf_counter() - started
        if args.budget_s and elapsed > args.budget_s:
            skipped.append(f"{shape.name} {variant.name}")
            continue
        log(f"== {shape.name} {variant.name} (t={elapsed:.0f} s)")
        rows += run_case(
            shape,
            variant,
            backends=backends,
            tokens=tokens,
            device=device,
            seed=args.seed,
            reps=args.reps,
        )
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            payload = {"environment": env, "rows": [asdict(r) for r in rows]}
            (out_dir / "gpu_suite.json").write_text(json.dumps(payload, indent=1))
    text = table(rows)
    if out_dir is not None:
        (out_dir / "gpu_suite.md").write_text(text + "\n")
    log(f"\nGPU correctness table (tolerance {TOLERANCE:g}, {time.perf_counter() - started:.0f} s)")
    log(text)
    failed = [r for r in rows if r.status in ("FAIL", "error")]
    ran = {r.backend for r in rows if r.status in ("pass", "FAIL")}
    missing = [b for b in args.require.split(",") if b and b in backends and b not in ran]
    if skipped:
        log(f"\nnot run (time budget {args.budget_s:g} s): {', '.join(skipped)}")
    log(
        f"\nrows: {len(rows)}, passed: {sum(r.status == 'pass' for r in rows)}, "
        f"failed: {len(failed)}, backends that never ran: {missing or 'none'}"
    )
    return 1 if failed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
