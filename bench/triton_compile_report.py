#!/usr/bin/env python
"""Compiler report of our Triton WNA16 GEMMs for Hopper, on a machine without a GPU.

`triton.compile` targets sm_90a from the kernel source alone (no driver needed), and the
ptxas that Triton ships reports registers, stack frame and spills. For the prefill kernel at
tiles the configuration tables use, this prints: registers, spill stores, shared memory,
whether the MMA is wgmma or mma.sync, whether weight loads are software-pipelined
(cp.async) and the widest cp.async. bench/KERNEL_NOTES.md quotes it.

    PYTHONPATH=. python bench/triton_compile_report.py
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget

from service.kernels.triton import prefill

PTXAS = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
POINTERS = {
    "x_ptr": "*bf16", "a_ptr": "*bf16", "out_ptr": "*bf16", "s_ptr": "*fp16",
    "z_ptr": "*u8", "bias_ptr": "*fp16", "topk_w_ptr": "*fp32", "acc_ptr": "*fp32",
    "count_ptr": "*i32", "ids_ptr": "*i32", "sorted_ptr": "*i32", "expert_ids_ptr": "*i32",
}  # fmt: skip
#: Qwen3-30B-A3B, int4 g128 symmetric, silu.
LAYER = {"TOP_K": 8, "BITS": 4, "GROUP": 128, "HAS_ZP": False, "HAS_BIAS": False}
W13 = {"K": 2048, "ACT": 0, "GATED": True, "INTERLEAVED": False}


def compile_report(fn: Any, consts: dict[str, Any], warps: int, stages: int) -> dict[str, Any]:
    signature = {}
    for param in fn.params:
        if param.name in consts:
            signature[param.name] = "constexpr"
        elif param.name == "q_ptr":
            signature[param.name] = "*u8"
        elif param.name in POINTERS:
            signature[param.name] = POINTERS[param.name]
        elif param.name in ("limit", "alpha", "beta"):
            signature[param.name] = "fp32"
        else:
            signature[param.name] = "i32"
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=consts)
    compiled = triton.compile(
        source,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps, "num_stages": stages},
    )
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        info = subprocess.run(
            [str(PTXAS), "-arch=sm_90a", "-v", str(path), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores", info)
    widths = [
        int(w, 16) for w in re.findall(r"cp\.async\.c[ag]\.shared\.global[^;]*, (0x\d+)", ptx)
    ]
    return {
        "regs": int(regs.group(1)) if regs else -1,
        "spill_bytes": int(spills.group(1)) if spills else 0,
        "smem": compiled.metadata.shared,
        "mma": "wgmma" if "wgmma" in ptx else ("mma.sync" if "mma.sync" in ptx else "none"),
        "cp_async_max_bytes": max(widths, default=0),
    }


def w13(bm: int, bn: int, bk: int, swap: bool = False) -> tuple[Any, dict[str, Any]]:
    tiles = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SWAP_AB": swap, "DOT_F32": False}
    return prefill._moe_w13_kernel, {**LAYER, **W13, **tiles}


CASES = [
    ("decode bm16 bn32 bk128", 4, 4, w13(16, 32, 128)),
    ("swap bm16 bn64 bk128", 4, 4, w13(16, 64, 128, True)),
    ("bm64 bn64 bk64", 4, 3, w13(64, 64, 64)),
    ("bm128 bn64 bk64 w8", 8, 4, w13(128, 64, 64)),
]


def main() -> int:
    print("| w13 tile (Qwen3 int4 g128) | regs | spill B | smem B | MMA | cp.async max B |")
    print("|---|---:|---:|---:|---|---:|")
    for label, warps, stages, (fn, consts) in CASES:
        r = compile_report(fn, consts, warps, stages)
        print(
            f"| {label} | {r['regs']} | {r['spill_bytes']} | {r['smem']} | "
            f"{r['mma']} | {r['cp_async_max_bytes']} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
