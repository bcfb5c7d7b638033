"""EMULATION: the reference fused MoE forward, dequantize and compute in float32.

Every other backend is tested against this one, so it is written for obviousness, not
speed: per expert that any token routes to, dequantize its w13 and w2 in float32 (the
canonical form's definition, zero points, groups and act-order `g_idx` included), run
x·w13ᵀ (+ bias), the activation, ·w2ᵀ (+ bias), multiply by the router weight and add into
the token's float32 output row. Nothing is rounded to 16 bits until the final cast, so the
result is the "fp32 dequantized reference" the correctness tables compare with. It runs
wherever torch runs (CPU or GPU, the layer's device or the input's).

vLLM's own EMULATION backend differs on purpose: it dequantizes once to bfloat16 and runs
its Triton bf16 experts (CUDA only), and it drops the bias. This one keeps float32 and the
bias, because it is the yardstick.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from service.formats.canonical import QuantizedExperts, QuantizedMoELayer
from service.formats.errors import FormatError
from service.formats.inverse.marlin import read_marlin
from service.kernels.activation import ActivationSpec, ResolvedActivation, apply, resolve
from service.kernels.errors import KernelInputError
from service.kernels.interface import (
    ExpertsBackend,
    LayerSpec,
    LayerTensors,
    check_inputs,
    into,
)
from service.kernels.layouts import triton_to_canonical


def expert_weights(projection: QuantizedExperts, expert: int) -> torch.Tensor:
    """float32 [N, K]: one expert's dequantized weights (the canonical definition)."""
    one = dataclasses.replace(
        projection,
        codes=projection.codes[expert : expert + 1],
        scales=projection.scales[expert : expert + 1],
        zeros=None if projection.zeros is None else projection.zeros[expert : expert + 1],
        g_idx=None if projection.g_idx is None else projection.g_idx[expert : expert + 1],
        bias=None,
    )
    return one.dequantize(torch.float32)[0]


def reference_forward(
    layer: QuantizedMoELayer,
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    activation: ResolvedActivation,
) -> torch.Tensor:
    """float32 [M, H]: the MoE forward with float32 weights and float32 accumulation."""
    device = hidden_states.device
    x = hidden_states.to(torch.float32)
    m, top_k = topk_ids.shape
    out = torch.zeros(m, layer.hidden_size, dtype=torch.float32, device=device)
    flat_ids = topk_ids.reshape(-1).to(torch.int64)
    flat_weights = topk_weights.reshape(-1).to(torch.float32)
    for expert in torch.unique(flat_ids).tolist():
        routes = torch.nonzero(flat_ids == expert).reshape(-1)
        tokens = routes // top_k
        w13 = expert_weights(layer.w13, expert).to(device)
        w2 = expert_weights(layer.w2, expert).to(device)
        h = x[tokens] @ w13.T
        if layer.w13.bias is not None:
            h = h + layer.w13.bias[expert].to(device, torch.float32)
        y = apply(h, activation) @ w2.T
        if layer.w2.bias is not None:
            y = y + layer.w2.bias[expert].to(device, torch.float32)
        out.index_add_(0, tokens, y * flat_weights[routes, None])
    return out


class EmulationExperts(ExpertsBackend):
    """The float32 reference as a backend; reads the canonical form, the TRITON layout, and
    the MARLIN / BATCHED_MARLIN layout (through the reference reader, formats/inverse/marlin.py),
    so a Marlin layer can be checked against the reference on the worker that holds it."""

    name: ClassVar[str] = "EMULATION"
    reads_canonical: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self._layer: QuantizedMoELayer | None = None

    @property
    def layer(self) -> QuantizedMoELayer:
        if self._layer is None:
            raise KernelInputError("layer", "EMULATION: no layer prepared")
        return self._layer

    def _prepare(self, tensors: LayerTensors, spec: LayerSpec) -> None:
        if isinstance(tensors, QuantizedMoELayer):
            layer = tensors
        elif spec.layout in ("MARLIN", "BATCHED_MARLIN"):
            try:
                layer = read_marlin(
                    tensors,
                    bits=spec.bits,
                    group_size=spec.group_size,
                    intermediate_size=spec.intermediate_size,
                )
            except FormatError as exc:
                raise KernelInputError("layout", f"MARLIN tensors: {exc}") from None
        else:
            layer = triton_to_canonical(tensors, bits=spec.bits, group_size=spec.group_size)
        found = LayerSpec.from_canonical(layer, layout=spec.layout)
        for field in ("num_experts", "hidden_size", "intermediate_size", "bits", "gated"):
            if getattr(found, field) != getattr(spec, field):
                raise KernelInputError(
                    field,
                    f"the tensors hold {getattr(found, field)}, the descriptor says "
                    f"{getattr(spec, field)}",
                )
        self._layer = layer

    def _forward_into(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        activation: ResolvedActivation,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        result = reference_forward(self.layer, hidden_states, topk_ids, topk_weights, activation)
        return into(result.to(hidden_states.dtype), out)

    def forward_fp32(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        activation: str | ActivationSpec = "silu",
    ) -> torch.Tensor:
        """The same forward without the final cast: the yardstick for relative errors."""
        act = resolve(activation)
        check_inputs(self.spec, act, hidden_states, topk_ids, topk_weights, validate=False)
        return reference_forward(self.layer, hidden_states, topk_ids, topk_weights, act)
