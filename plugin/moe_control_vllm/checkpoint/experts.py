"""A converted MoE layer's method: vLLM's own method for the source, its weights step replaced.

vLLM builds the source checkpoint's MoE method (AutoGPTQ, AutoAWQ, compressed-tensors
WNA16, MoeWNA16) with the converted backend forced, so everything but the weights (backend
and experts class, the platform's checks, the kernel set-up, `apply`) is vLLM's own code.
`adopt` then replaces three of that object's steps with a `ConvertedWeights`' own (bound
on the object: vLLM calls them there, and everything else stays the method's):

- `create_weights` runs the method's own `create_weights` on the meta device (it sets the
  layer attributes its kernel set-up reads, and checks the shapes) and replaces the
  source-layout parameters it registered with the converted ones: the kernel layout's
  shapes and dtypes, as the manifest records them, allocated where vLLM allocates weights;
- the layer's `load_weights` takes each converted tensor whole, checks its dtype and shape
  against the manifest, copies it in, and has its SHA-256 checked against the manifest's
  (`verify`: in the background; a damaged tensor is refused, named, before the layer is
  put together).
  vLLM's `RoutedExperts.load_weights` matches per-expert and fused checkpoint names by
  substring ("experts.w13" is in "experts.w13_qweight") and would slice a stacked
  kernel-layout tensor as if it were a fused checkpoint weight;
- `process_weights_after_loading` does no repack: it moves each tensor to the parameter
  the method's own step would have stored that output in (`slots`), sets the kernel's
  ``w13_weight`` / ``w2_weight`` aliases as that step does, and sets up the kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from moe_control_vllm.checkpoint import slots
from moe_control_vllm.checkpoint.manifest import (
    ConvertedCheckpointError,
    ConvertedLayer,
    TensorRecord,
)
from moe_control_vllm.checkpoint.verify import Verifier

__all__ = ["ConvertedWeights", "adopt", "torch_dtype"]

#: safetensors dtype codes -> torch dtypes.
TORCH_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
}


def torch_dtype(record: TensorRecord) -> torch.dtype:
    dtype = TORCH_DTYPES.get(record.dtype)
    if dtype is None:
        raise ConvertedCheckpointError(f"{record.checkpoint_name}: unknown dtype {record.dtype}")
    return dtype


def _parameter(layer: torch.nn.Module, name: str) -> torch.nn.Parameter:
    param = layer._parameters.get(name)
    if param is None:
        raise ConvertedCheckpointError(f"{name}: not a parameter of this layer")
    return param


def _backend_of(method: Any) -> str:
    for attribute in slots.BACKEND_ATTRIBUTES:
        backend = getattr(method, attribute, None)
        if backend is not None:
            return str(backend.name)
    raise ConvertedCheckpointError(f"{type(method).__name__} has no WNA16 backend")


class ConvertedWeights:
    """The weights steps of one converted layer's MoE method; see the module doc."""

    def __init__(self, method: Any, converted: ConvertedLayer, backend: str) -> None:
        self.method = method
        self.source = type(method)
        self.converted = converted
        self.backend = backend
        self._loaded: set[str] = set()
        self._verifier = Verifier(converted.file)

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        before = set(layer._parameters)
        with torch.device("meta"):
            self.source.create_weights(
                self.method,
                layer,
                num_experts,
                hidden_size,
                intermediate_size_per_partition,
                params_dtype,
                **extra_weight_attrs,
            )
        for name in set(layer._parameters) - before:
            del layer._parameters[name]
        self._loaded = set()
        for record in self.converted.tensors.values():
            param = torch.nn.Parameter(
                torch.empty(record.shape, dtype=torch_dtype(record)), requires_grad=False
            )
            param.weight_loader = functools.partial(self._load_tensor, record)  # type: ignore[attr-defined]
            layer.register_parameter(record.name, param)
        # An instance attribute: vLLM's runner calls `routed_experts.load_weights`.
        layer.__dict__["load_weights"] = functools.partial(self._load_weights, layer)

    def _load_weights(
        self, layer: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[str]:
        """The layer's `load_weights`: names relative to the experts module."""
        for name, loaded in weights:
            record = self.converted.tensors.get(name)
            if record is None:
                raise ConvertedCheckpointError(
                    f"{self.converted.module}.{name}: not a tensor of this converted layer "
                    f"(its manifest lists {sorted(self.converted.tensors)})"
                )
            self._load_tensor(record, _parameter(layer, name), loaded)
            yield name

    def _load_tensor(
        self, record: TensorRecord, param: torch.Tensor, loaded: torch.Tensor, *_: Any, **__: Any
    ) -> bool:
        """Copy one converted tensor into `param`, its dtype and shape checked against the
        manifest, its SHA-256 being checked in the background (`verify`)."""
        where = record.checkpoint_name
        if tuple(loaded.shape) != record.shape or loaded.dtype != torch_dtype(record):
            raise ConvertedCheckpointError(
                f"{where}: {loaded.dtype}{list(loaded.shape)} in the checkpoint, the manifest "
                f"says {record.dtype}{list(record.shape)}"
            )
        param.data.copy_(loaded)
        self._verifier.submit(record, loaded)
        self._loaded.add(record.name)
        return True

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        missing = sorted(set(self.converted.tensors) - self._loaded)
        if missing:
            raise ConvertedCheckpointError(
                f"{self.converted.module}: not in the checkpoint: {', '.join(missing)}"
            )
        self._verifier.check()
        names = slots.parameter_names(self.source.__name__)
        by_slot = {
            record.slot: _parameter(layer, record.name)
            for record in self.converted.tensors.values()
        }
        for record in self.converted.tensors.values():
            del layer._parameters[record.name]
        device = by_slot["w13_qweight"].device
        for slot, (value, dtype) in slots.PLACEHOLDERS.get(self.backend, {}).items():
            if slot not in by_slot:
                placeholder = torch.full((1,), value, dtype=getattr(torch, dtype), device=device)
                by_slot[slot] = torch.nn.Parameter(placeholder, requires_grad=False)
        for slot, param in by_slot.items():
            layer.register_parameter(names[slot], param)
        for alias, slot in slots.ALIASES.items():
            setattr(layer, alias, getattr(layer, names[slot]))
        self.method._setup_kernel(layer)


def adopt(method: Any, converted: ConvertedLayer, backend: str, prefix: str) -> Any:
    """Make vLLM's MoE `method` (built with `backend` forced) load `converted`."""
    source = type(method)
    if source.__name__ not in slots.PARAMETERS:
        raise ConvertedCheckpointError(
            f"{prefix}: vLLM builds this layer with {source.__name__}; converted tensors load "
            f"into {', '.join(sorted(slots.PARAMETERS))} only"
        )
    selected = _backend_of(method)
    if selected != backend:
        raise ConvertedCheckpointError(
            f"{prefix}: converted for {backend}, but vLLM selected {selected} for it"
        )
    if getattr(method.experts_cls, "requires_interleaved_w13", False):
        raise ConvertedCheckpointError(
            f"{prefix}: {method.experts_cls.__name__} wants w13 interleaved, which the "
            "conversion does not do"
        )
    weights = ConvertedWeights(method, converted, backend)
    method.create_weights = weights.create_weights
    method.process_weights_after_loading = weights.process_weights_after_loading
    method.moe_control = weights
    return method
