"""Kernel-format writers: canonical `QuantizedMoELayer` -> the tensors one kernel consumes.

A writer is a plain function ``(layer, *, source, options) -> ConvertedLayer``; the registry
(`service.formats.registry.TARGET_BACKENDS`) maps vLLM's backend names to them. Writers are our
own torch code, run on CPU or GPU, and never call vLLM; the exactness tests compare them bit
for bit with vLLM 0.33.0's `convert_to_wna16_moe_kernel_format`.

`source` is the checkpoint layout the layer was read from ("gptq", "awq",
"compressed-tensors", "moe_wna16"). The canonical form makes most writers independent of it,
but vLLM's outputs sometimes depend on the integration (Marlin's AWQ path returns no g_idx,
for instance), and a writer that mirrors that needs to know.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from service.formats.canonical import QuantizedMoELayer
from service.oracle import DEFAULT_RULESET


@dataclass(frozen=True)
class ConversionOptions:
    """Knobs a caller may set; each writer reads the ones it understands.

    - `device`: where the output tensors go (None: the input's device).
    - `dense_dtype`: EMULATION's dense weight dtype (vLLM 0.33 hard-codes bfloat16).
    - `activation_dtype`: the activation dtype the kernel will see; vLLM's Marlin path
      changes scales for int8/fp8 activations (`VLLM_MARLIN_INPUT_DTYPE`). None: 16-bit.
    - `extra`: writer-specific settings, by name.
    - `ruleset`: the vLLM release whose layout to write, where releases lay the same
      checkpoint out differently (`Ruleset.conversions`; Marlin's act-order form where the
      release accepts act-order).
    - `integration`: the vLLM quantization method that loads the checkpoint
      (``--quantization``), where it changes the bytes and the layout does not say it: a
      GPTQ or AWQ checkpoint loaded by ``moe_wna16`` reaches XPU as MoeWNA16's tensors.
      None: the source layout's own integration.
    """

    device: str | torch.device | None = None
    dense_dtype: torch.dtype = torch.bfloat16
    activation_dtype: torch.dtype | None = None
    extra: Mapping[str, str] = field(default_factory=dict)
    ruleset: str = DEFAULT_RULESET
    integration: str | None = None


DEFAULT_OPTIONS = ConversionOptions()


@dataclass(frozen=True)
class TargetDescriptor:
    """What a kernel needs to know about converted tensors, besides the tensors.

    `weight_type` uses vLLM's scalar type names: ``uint4b8`` / ``uint8b128`` (symmetric,
    the midpoint subtracted), ``uint4`` / ``uint8`` (explicit zero points), or the dense
    dtype (``bfloat16``) for EMULATION. `group_size` is the source's (-1 channelwise).
    `dtypes` names each output tensor's dtype, in output order.
    """

    backend: str
    source: str
    bits: int
    group_size: int
    weight_type: str
    has_zero_points: bool
    act_order: bool
    has_bias: bool
    dtypes: Mapping[str, str]


@dataclass(frozen=True)
class ConvertedLayer:
    """A writer's result: tensors by name (insertion order is the output order) + descriptor."""

    tensors: dict[str, torch.Tensor]
    descriptor: TargetDescriptor


class ProjectionFacts(Protocol):
    """What a descriptor needs of one projection: a canonical `QuantizedExperts`, or the
    packed projection a direct route (`service.formats.routes.packed`) carries without codes."""

    @property
    def bits(self) -> int: ...
    @property
    def group_size(self) -> int: ...
    @property
    def symmetric(self) -> bool: ...
    @property
    def g_idx(self) -> torch.Tensor | None: ...
    @property
    def bias(self) -> torch.Tensor | None: ...


class LayerFacts(Protocol):
    @property
    def w13(self) -> ProjectionFacts: ...
    @property
    def w2(self) -> ProjectionFacts: ...


class Writer(Protocol):
    def __call__(
        self, layer: QuantizedMoELayer, *, source: str, options: ConversionOptions
    ) -> ConvertedLayer: ...


def weight_type(experts: ProjectionFacts) -> str:
    """vLLM's scalar type name for these codes (see `TargetDescriptor`)."""
    if experts.symmetric:
        return f"uint{experts.bits}b{1 << (experts.bits - 1)}"
    return f"uint{experts.bits}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def finish(
    tensors: dict[str, torch.Tensor | None],
    *,
    backend: str,
    source: str,
    layer: LayerFacts,
    weight_type_name: str,
    options: ConversionOptions,
) -> ConvertedLayer:
    """Drop absent tensors, move the rest to `options.device`, describe them."""
    present = {name: t for name, t in tensors.items() if t is not None}
    if options.device is not None:
        present = {name: t.to(options.device) for name, t in present.items()}
    descriptor = TargetDescriptor(
        backend=backend,
        source=source,
        bits=layer.w13.bits,
        group_size=layer.w13.group_size,
        weight_type=weight_type_name,
        has_zero_points=not layer.w13.symmetric,
        act_order=layer.w13.g_idx is not None or layer.w2.g_idx is not None,
        has_bias=layer.w13.bias is not None or layer.w2.bias is not None,
        dtypes={name: dtype_name(t.dtype) for name, t in present.items()},
    )
    return ConvertedLayer(tensors=present, descriptor=descriptor)


def descriptor_json(descriptor: TargetDescriptor) -> dict[str, Any]:
    """A writer's TargetDescriptor as JSON (plain fields; mappings as dicts)."""
    out: dict[str, Any] = {}
    for name in getattr(descriptor, "__dataclass_fields__", {}):
        value = getattr(descriptor, name)
        out[name] = dict(value) if isinstance(value, Mapping) else value
    return out
