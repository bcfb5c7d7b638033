"""Run our Triton kernels in Triton's interpreter on machines without a CUDA GPU.

Triton decides interpret-or-compile when a kernel is decorated, so the switch must be on
before the kernel modules are imported; modules some earlier test imported compiled-mode
are reloaded.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    kernel_modules = (
        "service.kernels.align",
        "service.kernels.triton.jit",
        "service.kernels.triton.prefill",
        "service.kernels.triton.prefill_rs",
        "service.kernels.triton.decode",
    )
    for name in kernel_modules:
        if name in sys.modules:
            importlib.reload(sys.modules[name])
