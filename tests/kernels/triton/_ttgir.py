"""What the Triton interpreter cannot show: the dot layouts of a kernel compiled for sm_90a.

Triton 3.6 gives an upcast MMAv2 dot operand kWidth 8 even at a K tile of 16, where the
layout (4 threads x kWidth inputs per K step) wraps and the compiled m16n8k16 reads half its
inputs twice (triton-lang/triton#11691). The interpreter computes such dots correctly, so the
CPU tests compile the kernels here (no GPU needed) and read the layouts from the TTGIR.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

#: Run in a fresh interpreter with TRITON_INTERPRET off (the test process decorated the
#: kernels for the interpreter): compile each variant of one kernel for sm_90a and print
#: its TTGIR and PTX. argv: module, kernel, JSON of {"types": {param: triton type},
#: "aligned": [params specialized as multiples of 16, as a launch does for such pointers
#: and ints], "options": [{...} per variant], "variants": [constexprs per variant]}.
_COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
fn = getattr(importlib.import_module(sys.argv[1]), sys.argv[2])
job = json.loads(sys.argv[3])
result = []
for consts, options in zip(job["variants"], job["options"]):
    signature = {}
    for p in fn.params:
        if p.name in consts:
            signature[p.name] = "constexpr"
        elif p.name in job["types"]:
            signature[p.name] = job["types"][p.name]
        elif p.name.endswith("_ptr"):
            signature[p.name] = "*bf16"
        else:
            signature[p.name] = "i32"
    attrs = {(i,): [["tt.divisibility", 16]]
             for i, p in enumerate(fn.params) if p.name in job["aligned"]}
    compiled = triton.compile(
        triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs),
        target=GPUTarget("cuda", 90, 32), options=options,
    )
    result.append({"ttgir": compiled.asm["ttgir"], "ptx": compiled.asm["ptx"]})
print(json.dumps(result))
"""

#: A register dot operand in TTGIR: rows, cols, opIdx, kWidth.
_DOT_OPERAND = re.compile(
    r"tensor<(\d+)x(\d+)x\w+, #ttg\.dot_op<\{opIdx = (\d), parent = #mma\d*, kWidth = (\d+)"
)

#: Triton types of the pointer and scalar kernel parameters that are not bfloat16 pointers
#: or int32 (the defaults), across our kernels.
TYPES = {
    "z_ptr": "*u8", "acc_ptr": "*fp32", "topk_w_ptr": "*fp32", "count_ptr": "*i32",
    "ids_ptr": "*i32", "sorted_ptr": "*i32", "expert_ids_ptr": "*i32", "s_ptr": "*fp16",
    "bias_ptr": "*fp16", "limit": "fp32", "alpha": "fp32", "beta": "fp32",
}  # fmt: skip


def compiled_asm(
    module: str,
    kernel: str,
    variants: list[dict[str, Any]],
    types: dict[str, str] | None = None,
    options: dict[str, Any] | list[dict[str, Any]] | None = None,
    *,
    aligned: tuple[str, ...] = (),
) -> list[dict[str, str]]:
    """For each constexpr set in `variants`, `module.kernel` compiled for sm_90a (no GPU
    needed): {"ttgir": ..., "ptx": ...}. Parameters named in `types` (over `TYPES`) take
    that Triton type, other `*_ptr` ones bfloat16 pointers, the rest int32; those in
    `aligned` are known multiples of 16 (bytes for a pointer), as a launch specializes
    them, which is what lets the compiler vectorize a contiguous access. `options`
    (num_warps, num_stages): one dict for all variants or one per variant. A kernel the
    compiler rejects fails the assertion with the compiler's message."""
    per_variant = options if isinstance(options, list) else [options or {}] * len(variants)
    job = {
        "types": {**TYPES, **(types or {})},
        "aligned": list(aligned),
        "options": [{"num_warps": 4, "num_stages": 3, **o} for o in per_variant],
        "variants": variants,
    }
    path = os.pathsep.join(filter(None, [str(Path.cwd()), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE, module, kernel, json.dumps(job)],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result: list[dict[str, str]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def compiled_dots(
    module: str,
    kernel: str,
    variants: list[dict[str, Any]],
    types: dict[str, str] | None = None,
    options: dict[str, Any] | list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """For each constexpr set in `variants`, the dots of `module.kernel` compiled for sm_90a:
    {"mma": the register operands of its dots (`tt.dot`, `warp_group_dot`; not other
    tensors that merely share a dot-operand layout) as [rows, cols, opIdx, kWidth],
    "wgmma": whether a wgmma is there}."""
    result = []
    for asm in compiled_asm(module, kernel, variants, types, options):
        ttgir = asm["ttgir"]
        dots = [
            line
            for line in ttgir.splitlines()
            if " tt.dot " in line or " ttng.warp_group_dot " in line
        ]
        found = {tuple(int(v) for v in f) for line in dots for f in _DOT_OPERAND.findall(line)}
        result.append(
            {"mma": [list(f) for f in sorted(found)], "wgmma": "ttng.warp_group_dot " in ttgir}
        )
    return result


def mma_operands(
    module: str,
    kernel: str,
    variants: list[dict[str, Any]],
    types: dict[str, str] | None = None,
    options: dict[str, Any] | list[dict[str, Any]] | None = None,
) -> list[list[list[int]]]:
    """The register MMA operands of each variant (`compiled_dots`' "mma"; an empty list: no
    register-operand tensor-core dot)."""
    return [d["mma"] for d in compiled_dots(module, kernel, variants, types, options)]


def wrapped(operands: list[list[int]]) -> bool:
    """An MMA operand whose 4 x kWidth inputs per K step exceed the tile's K (A is [M, K],
    B is [K, N]): the layout wraps and the dot reads half its inputs twice."""
    return any(4 * kw > (cols if op == 0 else rows) for rows, cols, op, kw in operands)
