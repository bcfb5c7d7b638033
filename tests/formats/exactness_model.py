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
from service.formats.writers import ConversionOptions, marlin_layout
from service.formats.writers.marlin import marlin_tensors
from service.oracle import DEFAULT_RULESET
from tests.formats.exactness_cases import Case, E, expectation

_QUANTIZED_NAMES = {
    "w13": "w13_qweight",
    "w2": "w2_qweight",
    "w13_scale": "w13_scales",
    "w2_scale": "w2_scales",
    "w13_qzeros": "w13_qzeros",
    "w2_qzeros": "w2_qzeros",
    "w13_bias": "w13_bias",
    "w2_bias": "w2_bias",
}
#: Our writer's tensor names by vLLM's conversion output names, per backend.
VLLM_NAMES = {
    "TRITON": _QUANTIZED_NAMES,
    "XPU": _QUANTIZED_NAMES,
    "MARLIN": {
        **_QUANTIZED_NAMES,
        "w13_input_global_scale": "w13_input_global_scale",
        "w2_input_global_scale": "w2_input_global_scale",
        **{name: name for name in ("w13_g_idx", "w2_g_idx")},
        **{name: name for name in ("w13_g_idx_sort_indices", "w2_g_idx_sort_indices")},
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


def case_options(case: Case, ruleset: str = DEFAULT_RULESET) -> ConversionOptions:
    """What ConvertWeights is told for the case: the release, and MoeWNA16 when it loads."""
    integration = "moe_wna16" if case.stacked == "moe_wna16" else None
    return ConversionOptions(ruleset=ruleset, integration=integration)


def _marlin_departures(
    case: Case,
    layer: QuantizedMoELayer,
    model: dict[str, torch.Tensor | None],
    departures: tuple[str, ...],
) -> None:
    """vLLM's Marlin outputs from ours: the v1 zero points it converts for symmetric GPTQ
    (midpoint - 1, which the kernel ignores), w13's scales in the order vLLM picks."""
    if "sym-zeros-unused" in departures:
        stored = QuantizedMoELayer(
            *(
                replace(
                    e,
                    zeros=torch.full_like(e.scales, (1 << (case.bits - 1)) - 1, dtype=torch.uint8),
                )
                for e in (layer.w13, layer.w2)
            )
        )
        zeros = marlin_tensors(stored, act_order=True)
        model["w13_qzeros"], model["w2_qzeros"] = zeros["w13_qzeros"], zeros["w2_qzeros"]
    if "marlin-scale-order" in departures:
        scales = model["w13_scales"]
        assert scales is not None
        plain = marlin_layout.unpermute_scales(scales, True)
        model["w13_scales"] = marlin_layout.permute_scales(plain, False)


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
    case: Case,
    layer: QuantizedMoELayer,
    departures: tuple[str, ...] | None = None,
    ruleset: str = DEFAULT_RULESET,
) -> dict[str, torch.Tensor | None]:
    """What vLLM outputs for this case, by our writers (for `ruleset`) plus each known
    departure (vLLM 0.33's for the case unless `departures` names a release's)."""
    if departures is None:
        departures = expectation(case).departures  # type: ignore[union-attr]
    if case.backend in ("XPU", "MARLIN"):
        written = convert(
            layer, case.backend, source=case.source, options=case_options(case, ruleset)
        )
        model: dict[str, torch.Tensor | None] = dict(written.tensors)
        if case.backend == "MARLIN":
            _marlin_departures(case, layer, model, departures)
    elif case.backend == "EMULATION":
        minus_one = "gptq-v1-zero" in departures
        model = {
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
