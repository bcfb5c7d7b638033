"""`ParallelConfig`'s refusal of expert-parallel load balancing on a device a release does
not balance on.

vLLM validates `ParallelConfig` (a pydantic dataclass) when the engine config is built: with
`enable_eplb` on a device outside the release's list it raises pydantic's `ValidationError`,
whose text carries the constructor's arguments as pydantic abbreviates them. The arguments
rendered here are the parallel fields a deployment spec has, in the order the reference
harness passes them (`vllm serve` passes more, so there the elided middle differs). Which
devices balance is release data (`IntegrationRules.eplb_devices`).
"""

from __future__ import annotations

from typing import Any

from service.oracle.errors import ErrorInfo, SelectionError
from service.oracle.spec import ParallelSpec

#: The pydantic release vLLM's environments pin (its documentation link is in the text).
PYDANTIC_DOCS = "https://errors.pydantic.dev/2.14/v/value_error"
_DEVICE_NAMES = {"cuda": "CUDA", "rocm": "ROCm", "xpu": "XPU"}
#: pydantic-core shortens an input's repr longer than this to its head, "...", its tail.
_REPR_LIMIT = 50


def _abbreviated(text: str) -> str:
    if len(text) <= _REPR_LIMIT:
        return text
    return f"{text[:25]}...{text[-24:]}"


def _arguments(parallel: ParallelSpec) -> dict[str, Any]:
    return {
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "data_parallel_size": parallel.data_parallel_size,
        "enable_expert_parallel": parallel.enable_expert_parallel,
        "enable_eplb": parallel.enable_eplb,
        "all2all_backend": parallel.all2all_backend,
    }


def eplb_refusal(
    parallel: ParallelSpec, device: str, eplb_devices: tuple[str, ...], quantization: str
) -> SelectionError | None:
    """vLLM's error where `parallel` asks for load balancing on `device` and the release
    balances only on `eplb_devices` (in the order its message names them); else None."""
    if not parallel.enable_eplb or device in eplb_devices:
        return None
    names = " or ".join(f"{_DEVICE_NAMES[d]} devices" for d in eplb_devices)
    value = _abbreviated(f"ArgsKwargs((), {_arguments(parallel)!r})")
    message = (
        "1 validation error for ParallelConfig\n"
        f"  Value error, Expert parallelism load balancing is only supported on {names} now. "
        f"[type=value_error, input_value={value}, input_type=ArgsKwargs]\n"
        f"    For further information visit {PYDANTIC_DOCS}"
    )
    return SelectionError(
        ErrorInfo("moe_method", "ValidationError", message), quantization=quantization
    )
