"""One MoE layer's tensors, named any way a client has them, into a kernel layout.

Inline conversions (the ConvertWeights stream, `moe-control convert FILE`) receive a bag of
named tensors. Three namings are accepted, and the first tensor decides which:

* per-expert names relative to the experts module: ``0.gate_proj.qweight``, ``3.w2.scales``;
* the same with the checkpoint's full prefix: ``model.layers.5.mlp.experts.0.up_proj.qzeros``
  (all tensors must share one experts module; outputs keep the prefix);
* vLLM's stacked layer parameters: ``w13_qweight``, ``w2_scales`` (optionally prefixed).

Anything else is an unknown tensor name, reported with the field
``tensors[<name>].name``. The canonical layer read from the tensors must match the declared
layer shape (experts, hidden size, intermediate size), or the mismatching field is named.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from service.formats import registry
from service.formats.errors import ConvertInputError
from service.formats.io.naming import normalize_names
from service.formats.routes.convert import convert
from service.formats.routes.spec import SourceSpec
from service.formats.writers import ConversionOptions, descriptor_json
from service.oracle import DEFAULT_RULESET


@dataclass(frozen=True)
class LayerShape:
    """The declared layer (from the deployment spec)."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    gated: bool = True


@dataclass
class InlineResult:
    tensors: dict[str, torch.Tensor]
    descriptor: dict[str, Any]
    #: Conversion math only (reader + writer), on the device.
    device_seconds: float


def _quantization(source: SourceSpec) -> registry.SourceQuantization:
    return registry.SourceQuantization(
        bits=source.bits,
        group_size=source.group_size,
        symmetric=source.symmetric,
        desc_act=source.desc_act,
        gptq_v2=source.gptq_v2,
    )


def convert_layer(
    tensors: Mapping[str, torch.Tensor],
    *,
    source: SourceSpec,
    backend: str,
    shape: LayerShape,
    device: str = "cpu",
    keep_device: bool = False,
    vllm_quantization: str | None = None,
    ruleset: str = DEFAULT_RULESET,
) -> InlineResult:
    """Read, check against `shape`, write in `backend`'s layout as `ruleset`'s release
    does. Outputs are on the CPU unless `keep_device` (a layer kept loaded on a GPU worker
    stays there). Stacked parameters under `--quantization moe_wna16` (`vllm_quantization`)
    are MoeWNA16's, and that integration's tensors are what the release converts.

    Per-expert tensors take `routes.convert`: packed words to packed words where a direct
    route covers the pair (fused Triton kernels on a GPU), the canonical route otherwise;
    the same bytes either way, and the declared shape is checked before anything is
    written. Stacked parameters take the canonical route (no direct route reads them)."""
    registry.writer_for(backend)  # ConversionUnsupported before any work
    naming, module, keys = normalize_names(list(tensors))
    target = torch.device(device)
    renamed = {keys[name]: tensor.to(target) for name, tensor in tensors.items()}
    if target.type == "cuda":
        torch.cuda.synchronize(target)
    began = time.perf_counter()
    quant = _quantization(source)
    options = ConversionOptions(ruleset=ruleset, integration=vllm_quantization)
    if naming == "stacked":
        layout = "moe_wna16" if vllm_quantization == "moe_wna16" else source.layout
        layer = registry.read_stacked_layer(layout, renamed, quant)
        _check_shape(layer, shape)
        converted = registry.convert(layer, backend, source=layout, options=options)
    else:
        converted = convert(
            source.layout,
            renamed,
            quant,
            backend,
            num_experts=shape.num_experts,
            gated=shape.gated,
            options=options,
            check=lambda layer: _check_shape(layer, shape),
        )
    if target.type == "cuda":
        torch.cuda.synchronize(target)
    seconds = time.perf_counter() - began
    prefix = f"{module}." if module else ""
    out = {
        f"{prefix}{name}": tensor if keep_device else tensor.to("cpu")
        for name, tensor in converted.tensors.items()
    }
    return InlineResult(out, descriptor_json(converted.descriptor), seconds)


def _check_shape(layer: Any, shape: LayerShape) -> None:
    found = {
        "num_experts": layer.w13.num_experts,
        "hidden_size": layer.hidden_size,
        "intermediate_size": layer.intermediate_size,
    }
    for name, value in found.items():
        declared = getattr(shape, name)
        if value != declared:
            raise ConvertInputError(
                f"layer.{name}", f"the tensors hold {name} {value}, the header declares {declared}"
            )
    rows = layer.w13.n
    expected = (2 if shape.gated else 1) * shape.intermediate_size
    if rows != expected:
        raise ConvertInputError(
            "layer.activation",
            f"w13 has {rows} rows; a {'gated' if shape.gated else 'non-gated'} layer with "
            f"intermediate size {shape.intermediate_size} has {expected}",
        )
