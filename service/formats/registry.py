"""What can be converted from where to what: the one table the RPC layer consults.

Sources (`SOURCE_LAYOUTS`): checkpoint layouts by name, read with `read_layer` from
per-expert tensors named relative to the experts module::

    layer = read_layer(
        "gptq",
        {"0.gate_proj.qweight": ..., "0.gate_proj.qzeros": ..., "0.gate_proj.scales": ...,
         "0.up_proj.qweight": ..., ..., "1.down_proj.g_idx": ...},
        SourceQuantization(bits=4, group_size=128, symmetric=True),
        num_experts=2,
    )

Projection names are Qwen/DeepSeek's ``gate_proj``/``up_proj``/``down_proj`` or Mixtral's
``w1``/``w3``/``w2`` (non-gated experts: ``up_proj``/``down_proj`` or ``w1``/``w2``); tensor
names are the layout's own (``qweight``, ``qzeros``, ``scales``, ``g_idx``, ``bias``;
compressed-tensors ``weight_packed``, ``weight_scale``, ``weight_zero_point``,
``weight_g_idx``, ``weight_shape``). `read_stacked` reads vLLM's stacked layer parameters
(``w13_qweight``...) instead. Every malformed input raises `FormatError` naming the tensor.

Targets (`TARGET_BACKENDS`): vLLM's WNA16 backend names -> writer functions. Backends
without a writer here are in `UNSUPPORTED_BACKENDS` with the reason; `writer_for` raises
`ConversionUnsupported` for them (and for names vLLM does not have). One line per backend:
a new writer is one import and one entry.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from service.formats.canonical import QuantizedMoELayer
from service.formats.errors import ConversionUnsupported, FormatError
from service.formats.readers import (
    LAYOUTS,
    SourceLayout,
    SourceQuantization,
    read_checkpoint,
    read_stacked,
)
from service.formats.writers import DEFAULT_OPTIONS, ConversionOptions, ConvertedLayer, Writer
from service.formats.writers import marlin as marlin_writers
from service.formats.writers.emulation import write_emulation
from service.formats.writers.humming import write_humming
from service.formats.writers.marlin import write_batched_marlin, write_marlin
from service.formats.writers.triton import write_triton
from service.formats.writers.xpu import write_xpu
from service.oracle import DEFAULT_RULESET
from service.oracle.rulesets import get_ruleset

__all__ = [
    "ALL_BACKENDS",
    "MARLIN_LAYOUTS",
    "SOURCE_LAYOUTS",
    "TARGET_BACKENDS",
    "UNSUPPORTED_BACKENDS",
    "ConversionOptions",
    "ConvertedLayer",
    "SourceQuantization",
    "convert",
    "read_layer",
    "read_stacked_layer",
    "writer_for",
]

SOURCE_LAYOUTS: Mapping[str, SourceLayout] = LAYOUTS
"""Layout name -> its description: "gptq", "awq", "compressed-tensors", "moe_wna16"."""

TARGET_BACKENDS: dict[str, Writer] = {
    "TRITON": write_triton,
    "EMULATION": write_emulation,
    "HUMMING": write_humming,  # CUDA workers only: raises ConversionUnsupported elsewhere
    "MARLIN": write_marlin,
    "BATCHED_MARLIN": write_batched_marlin,
    "XPU": write_xpu,
}

UNSUPPORTED_BACKENDS: dict[str, str] = {
    "FLASHINFER_TRTLLM": (
        "its layout helpers (flashinfer's block_scale_interleave, convert_to_block_layout) "
        "need FlashInfer on an SM100 GPU"
    ),
    "CPU": "vLLM's CPU layout is opaque blocked data from a compiled op "
    "(convert_weight_packed_scale_zp)",
    "ZEN_CPU": "vLLM's ZenDNN layout comes from a compiled zentorch op",
    "RDNA3": "vLLM's RDNA3 conversion shuffles the weights with the compiled ROCm/CUDA op "
    "gptq_shuffle, which runs on those GPUs only, so no release's bytes can be reproduced "
    "or checked here",
}

ALL_BACKENDS: tuple[str, ...] = get_ruleset(DEFAULT_RULESET).backends
"""vLLM's `WNA16MoEBackend` values, in its enum order, as the default ruleset declares them."""

MARLIN_LAYOUTS: tuple[str, ...] = tuple(
    name
    for name, writer in TARGET_BACKENDS.items()
    if getattr(writer, "__module__", "") == marlin_writers.__name__
)
"""The layouts whose writer writes Marlin's tensors (MARLIN, BATCHED_MARLIN): what the
reference Marlin reader (`inverse.marlin`) reads back."""


def _layout(name: str) -> SourceLayout:
    layout = SOURCE_LAYOUTS.get(name)
    if layout is None:
        known = sorted(SOURCE_LAYOUTS)
        raise FormatError("layout", f"unknown source layout {name!r}; one of {known}")
    return layout


def read_layer(
    layout: str,
    tensors: Mapping[str, torch.Tensor],
    quant: SourceQuantization,
    *,
    num_experts: int,
    gated: bool = True,
) -> QuantizedMoELayer:
    """Per-expert checkpoint tensors of one MoE layer -> canonical layer (see module doc)."""
    return read_checkpoint(_layout(layout), tensors, quant, num_experts=num_experts, gated=gated)


def read_stacked_layer(
    layout: str, params: Mapping[str, torch.Tensor], quant: SourceQuantization
) -> QuantizedMoELayer:
    """vLLM's stacked layer parameters (``w13_qweight``, ``w2_scales``...) -> canonical layer."""
    return read_stacked(_layout(layout), params, quant)


def writer_for(backend: str) -> Writer:
    """The writer for a vLLM backend name, or `ConversionUnsupported` with the reason."""
    writer = TARGET_BACKENDS.get(backend)
    if writer is not None:
        return writer
    reason = UNSUPPORTED_BACKENDS.get(backend)
    if reason is None:
        reason = f"not a vLLM WNA16 MoE backend; one of {list(ALL_BACKENDS)}"
    raise ConversionUnsupported(backend, reason)


def convert(
    layer: QuantizedMoELayer,
    backend: str,
    *,
    source: str,
    options: ConversionOptions = DEFAULT_OPTIONS,
) -> ConvertedLayer:
    """Write `layer` in `backend`'s kernel layout."""
    _layout(source)
    _check_uniform(layer)
    return writer_for(backend)(layer, source=source, options=options)


def _check_uniform(layer: QuantizedMoELayer) -> None:
    """vLLM's kernels take one group size and one symmetry for both projections."""
    w13, w2 = layer.w13, layer.w2
    if w13.group_size != w2.group_size:
        raise FormatError("w2", f"group size {w2.group_size} differs from w13's {w13.group_size}")
    if w13.symmetric != w2.symmetric:
        raise FormatError("w2.zeros", "w13 and w2 must both have zero points or neither")
