"""Case functions the vLLM-side checker (`tests/formats/vllm_checker.py`) can run.

These modules run inside the vLLM 0.33.0 environment (never the product's): each exposes
functions that take one case's spec (JSON) and input tensors, drive vLLM's own code, and
return vLLM's tensors. The product-side tests then compare them with our writers.

Adding a case family (e.g. the Marlin writers)
----------------------------------------------
Create one module in this package, say ``vllm_cases/marlin.py``, and register functions
with the decorator::

    from vllm_cases import CaseOutput, register

    @register("marlin_repack")
    def marlin_repack(spec: dict, inputs: dict[str, torch.Tensor]) -> CaseOutput:
        from vllm.model_executor.layers.quantization.utils import marlin_utils_test
        ...
        return {"weight": repacked, "scales": None}, {"note": "anything JSON"}

Every module of the package is imported by `load_all()`, so the file is all it takes; no
list to edit. A case function returns a dict of output tensors (None for an output vLLM
leaves empty; names are free) and a JSON-able dict of metadata. An exception it raises is
recorded as the case's outcome (type and message), which is how "vLLM refuses this" is
tested; it never stops the other cases. Import vLLM inside the functions, so that the
package stays importable (and lintable) where vLLM is absent. Case names must be unique
across modules.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from typing import Any

import torch

CaseOutput = tuple[dict[str, torch.Tensor | None], dict[str, Any]]
CaseFunction = Callable[[Mapping[str, Any], dict[str, torch.Tensor]], CaseOutput]

CASES: dict[str, CaseFunction] = {}


def register(name: str) -> Callable[[CaseFunction], CaseFunction]:
    """Register `function` under `name` (unique across the package)."""

    def decorate(function: CaseFunction) -> CaseFunction:
        if name in CASES:
            raise ValueError(f"vLLM case {name!r} registered twice")
        CASES[name] = function
        return function

    return decorate


def load_all() -> dict[str, CaseFunction]:
    """Import every module of this package (each registers its cases); return the table."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    return CASES
