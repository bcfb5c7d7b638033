"""The deployments the per-release oracle tests ask about, and how they read the answers.

Quantization configs as a checkpoint's config.json carries them (GPTQ, compressed-tensors),
the MoE layers of the models they stand for, one deployment-spec builder, the answer (or
the refusal) of a ruleset as JSON, and which of a release's recorded answers a newer ruleset
gets wrong (the scenarios that prove the release's delta rows).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.oracle import SelectionError, select
from tests.parity.compare import differences, ours
from tests.parity.grid import generate
from tests.parity.records import load, record_path

#: Mixtral-8x7B's MoE layer.
MIXTRAL = {"num_experts": 8, "top_k": 2, "hidden_size": 4096, "intermediate_size": 14336}
#: Qwen1.5-MoE-A2.7B's MoE layer.
QWEN15_MOE = {"num_experts": 60, "top_k": 4, "hidden_size": 2048, "intermediate_size": 1408}
#: Qwen3-30B-A3B's MoE layer.
QWEN3 = {"num_experts": 128, "top_k": 8, "hidden_size": 2048, "intermediate_size": 768}


def gptq(**fields: Any) -> dict[str, Any]:
    """A 4-bit, group-128, symmetric GPTQ config without act order, `fields` replacing its."""
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": False,
        "sym": True,
        **fields,
    }


#: The plain GPTQ config.
GPTQ = gptq()


def ct(group: int | None = 128, strategy: str = "group", **weights: Any) -> dict[str, Any]:
    """A pack-quantized compressed-tensors config of 4-bit integer weights in groups of
    `group`, `weights` adding to or replacing the weight arguments (num_bits, symmetric,
    actorder...)."""
    args = {"num_bits": 4, "type": "int", "strategy": strategy, "group_size": group, **weights}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": args}},
    }


def spec(
    quant: Mapping[str, Any] = GPTQ,
    platform: str | Mapping[str, Any] = "a100",
    *,
    model: Mapping[str, Any] = MIXTRAL,
    layer: Mapping[str, Any] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """A deployment spec: `quant` as config.json's quantization_config, on `platform` (a
    preset name or a platform object), `model`'s MoE layer with `layer`'s fields replacing
    its, and any other spec fields (moe_backend, quantization, parallel...)."""
    return {
        "hf_quantization_config": dict(quant),
        "layer": {**model, **(layer or {})},
        "platform": platform,
        **fields,
    }


def answer(deployment: Mapping[str, Any], ruleset: str) -> dict[str, Any]:
    """The ruleset's decision as JSON, or its refusal's JSON (the error and every reason)."""
    try:
        return select(deployment, ruleset=ruleset).to_json()
    except SelectionError as exc:
        return exc.to_json()


def reasons(result: Mapping[str, Any]) -> dict[str, str]:
    """Each backend's reason in a decision's or a refusal's JSON."""
    return {c["backend"]: c["reason"] for c in result["candidates"]}


def misanswered(release: str, ruleset: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The scenarios of `release`'s parity record that `ruleset` answers otherwise than the
    record does, each with the recorded answer."""
    record = load(record_path(release))
    return [
        (scenario, expected)
        for scenario, expected in zip(generate(), record.answers, strict=True)
        if differences(expected, ours(scenario, ruleset))
    ]
