"""Where our Triton kernels can run: on a CUDA device, or anywhere under Triton's interpreter.

Triton decides at decoration time whether a `@triton.jit` function is compiled or
interpreted (`TRITON_INTERPRET=1`), so the kernel modules read the same switch when they
choose a code path (the interpreter multiplies bfloat16 dot operands as raw integers, so
interpreted kernels feed `tl.dot` float32 operands instead).
"""

from __future__ import annotations

import torch
import triton


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return bool(triton.knobs.runtime.interpret)


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why our Triton kernels cannot run on `device`, or None when they can."""
    if interpreting():
        return None if device.type == "cpu" else "TRITON_INTERPRET=1 runs kernels on CPU only"
    if device.type != "cuda":
        return f"needs a CUDA device (or TRITON_INTERPRET=1 on CPU), got {device.type}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    return None


def fix_interpreter_index() -> None:
    """Let Triton 3.6's interpreter run loops whose bounds are kernel arguments under NumPy 2.4+.

    The interpreter holds every scalar as a one-element 1-D array and converts it with
    `int(array)`, which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted"), so
    `for k in range(0, K, BLOCK)` with a run-time K fails. We re-install its tensor
    `__index__` with `.item()` after its own patching; compiled (GPU) kernels are untouched.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "moe_control_fixed", False):
        return

    def patched(tensor: object, scope: interpreter._LangPatchScope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.moe_control_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched
