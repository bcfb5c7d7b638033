"""EMULATION on the EMULATION layout: the dense weights our EMULATION writer produces.

A layer converted to EMULATION holds ``w13_weight`` [E, N13, H] and ``w2_weight`` [E, H, I]
already dequantized (16-bit, rounded once), plus optional biases. The quantized EMULATION
backend (emulation.py) reads codes and scales, so the worker needs this one to run such a
layer: the same float32 loop over routed experts, on the dense weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from service.formats.canonical import QuantizedMoELayer
from service.kernels.activation import ResolvedActivation, apply
from service.kernels.errors import KernelInputError
from service.kernels.interface import ExpertsBackend, LayerSpec, LayerTensors, into


class DenseEmulationExperts(ExpertsBackend):
    """Float32 forward over dense 16-bit expert weights (layout "EMULATION")."""

    name: ClassVar[str] = "EMULATION"

    def __init__(self) -> None:
        super().__init__()
        self._tensors: dict[str, torch.Tensor] = {}

    def _prepare(self, tensors: LayerTensors, spec: LayerSpec) -> None:
        if isinstance(tensors, QuantizedMoELayer) or not isinstance(tensors, Mapping):
            raise KernelInputError("layout", "EMULATION layout: w13_weight/w2_weight tensors")
        shapes = {
            "w13_weight": (spec.num_experts, spec.w13_rows, spec.hidden_size),
            "w2_weight": (spec.num_experts, spec.hidden_size, spec.intermediate_size),
        }
        for name, shape in shapes.items():
            tensor = tensors.get(name)
            if tensor is None or tuple(tensor.shape) != shape:
                found = None if tensor is None else list(tensor.shape)
                raise KernelInputError(name, f"must be {list(shape)}, got {found}")
        self._tensors = {k: v for k, v in tensors.items() if v is not None}

    def _forward_into(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        activation: ResolvedActivation,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        result = self.forward_fp32_checked(hidden_states, topk_ids, topk_weights, activation)
        return into(result.to(hidden_states.dtype), out)

    def forward_fp32_checked(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        activation: ResolvedActivation,
    ) -> torch.Tensor:
        """float32 [M, H] on inputs `forward` has checked."""
        device = hidden_states.device
        x = hidden_states.to(torch.float32)
        m, top_k = topk_ids.shape
        out = torch.zeros(m, self.spec.hidden_size, dtype=torch.float32, device=device)
        flat_ids = topk_ids.reshape(-1).to(torch.int64)
        flat_weights = topk_weights.reshape(-1).to(torch.float32)
        w13_all, w2_all = self._tensors["w13_weight"], self._tensors["w2_weight"]
        b13, b2 = self._tensors.get("w13_bias"), self._tensors.get("w2_bias")
        for expert in torch.unique(flat_ids).tolist():
            routes = torch.nonzero(flat_ids == expert).reshape(-1)
            tokens = routes // top_k
            h = x[tokens] @ w13_all[expert].to(device, torch.float32).T
            if b13 is not None:
                h = h + b13[expert].to(device, torch.float32)
            y = apply(h, activation) @ w2_all[expert].to(device, torch.float32).T
            if b2 is not None:
                y = y + b2[expert].to(device, torch.float32)
            out.index_add_(0, tokens, y * flat_weights[routes, None])
        return out
