"""What vLLM outputs for an exactness case, modelled by our writers plus each known departure.

Shared by the live exactness test (vLLM 0.33.0 tensors) and the per-release record test
(digests of each release's tensors): a case vLLM converts right is our writer's output; one
with departures is our output changed by exactly those documented departures.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from service.formats.canonical import QuantizedExperts, QuantizedMoELayer
from service.formats.readers import LAYOUTS, SourceQuantization, write_stacked
from service.formats.registry import convert
from tests.formats.exactness_cases import Case, E, expectation

#: Our writer's tensor names by vLLM's conversion output names, per backend.
VLLM_NAMES = {
    "TRITON": {
        "w13": "w13_qweight",
        "w2": "w2_qweight",
        "w13_scale": "w13_scales",
        "w2_scale": "w2_scales",
        "w13_qzeros": "w13_qzeros",
        "w2_qzeros": "w2_qzeros",
        "w13_bias": "w13_bias",
        "w2_bias": "w2_bias",
    },
    "EMULATION": {
        "w13": "w13_weight",
        "w2": "w2_weight",
        "w13_bias": "w13_bias",
        "w2_bias": "w2_bias",
    },
}


def case_quant(case: Case) -> SourceQuantization:
    return SourceQuantization(case.bits, case.group_size, case.sym, desc_act=case.act)


def strip_g_idx(layer: QuantizedMoELayer) -> QuantizedMoELayer:
    return QuantizedMoELayer(w13=replace(layer.w13, g_idx=None), w2=replace(layer.w2, g_idx=None))


def vllm_emulation(experts: QuantizedExperts, zero_minus_one: bool) -> torch.Tensor:
    """vLLM 0.33's emulation arithmetic: (q - z) in int16 -> bf16, times the bf16 scale."""
    index = experts.group_index().unsqueeze(1).expand(-1, experts.n, -1)
    zeros = experts.zero_points().to(torch.int16) - (1 if zero_minus_one else 0)
    q = experts.codes.to(torch.int16) - torch.gather(zeros, 2, index)
    scale = torch.gather(experts.scales, 2, index).to(torch.bfloat16)
    return q.to(torch.bfloat16) * scale


def model_of_vllm(
    case: Case, layer: QuantizedMoELayer, departures: tuple[str, ...] | None = None
) -> dict[str, torch.Tensor | None]:
    """What vLLM outputs for this case, by our writers plus each known departure (vLLM
    0.33's for the case unless `departures` names a release's)."""
    if departures is None:
        departures = expectation(case).departures  # type: ignore[union-attr]
    if case.backend == "EMULATION":
        minus_one = "gptq-v1-zero" in departures
        model: dict[str, torch.Tensor | None] = {
            "w13_weight": vllm_emulation(layer.w13, minus_one),
            "w2_weight": vllm_emulation(layer.w2, minus_one),
        }
    else:
        model = dict(convert(layer, "TRITON", source=case.source).tensors)
        if "sym-zeros-unused" in departures:
            stored = (1 << (case.bits - 1)) - 1  # GPTQ v1's symmetric midpoint, per code
            per_byte = stored * 0x11 if case.bits == 4 else stored
            for name, experts in (("w13", layer.w13), ("w2", layer.w2)):
                shape = (E, experts.n * case.bits // 8, experts.num_groups)
                model[f"{name}_qzeros"] = torch.full(shape, per_byte, dtype=torch.uint8)
        if "sym-zeros-k-first" in departures:  # passed through as the integration loaded them
            stacked = write_stacked(LAYOUTS["gptq"], layer, case_quant(case))
            model["w13_qzeros"] = stacked["w13_qzeros"]
            model["w2_qzeros"] = stacked["w2_qzeros"]
    if {"bias-dropped", "awq-bias-not-loaded", "ct-bias-not-loaded"} & set(departures):
        model["w13_bias"] = model["w2_bias"] = None
    return model
