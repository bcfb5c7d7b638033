"""Spec parsing, presets and model config.json reading."""

from __future__ import annotations

import pytest

from service.oracle import (
    PLATFORM_PRESETS,
    InvalidSpecError,
    deployment_from_model_config,
    parse_deployment,
    preset,
)
from service.oracle.platform import parse_capability


def test_defaults_are_applied_and_round_trip() -> None:
    spec = parse_deployment(
        {
            "hf_quantization_config": {"quant_method": "awq", "bits": 4},
            "layer": {
                "num_experts": 8,
                "top_k": 2,
                "hidden_size": 4096,
                "intermediate_size": 14336,
            },
            "platform": "h100",
        }
    )
    assert spec.moe_backend == "auto"
    assert spec.layer.activation == "silu"
    assert spec.platform.capability == (9, 0)
    assert spec.platform.packages == frozenset({"humming", "flashinfer"})
    again = parse_deployment(spec.to_json())
    assert again == spec


def test_every_issue_preset_exists() -> None:
    for name in (
        "v100",
        "t4",
        "a10",
        "a100",
        "l40s",
        "h100",
        "h200",
        "b200",
        "gb200",
        "rtx5090",
        "mi300x",
        "gfx1100",
        "cpu",
    ):
        assert preset(name) is PLATFORM_PRESETS[name]


def test_unknown_preset_lists_known_ones() -> None:
    with pytest.raises(InvalidSpecError, match="known"):
        preset("tpu-v5")


@pytest.mark.parametrize(("text", "expected"), [("9.0", (9, 0)), ("90", (9, 0)), ([8, 6], (8, 6))])
def test_capability_forms(text: object, expected: tuple[int, int]) -> None:
    assert parse_capability(text) == expected


@pytest.mark.parametrize("value", ["11910373160.0", [9, 10], [-1, 0], "100.0"])
def test_capabilities_beyond_any_device_name_the_field(value: object) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        parse_capability(value, field_name="platform.capability")
    assert caught.value.violations[0].field == "platform.capability"


def test_all_violations_are_reported_at_once() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        parse_deployment({"layer": {"num_experts": 0, "activation": "tanh"}, "bogus": 1})
    fields = {v.field for v in caught.value.violations}
    assert {"bogus", "hf_quantization_config", "layer.num_experts", "layer.activation"} <= fields


def test_deepseek_v3_config_json() -> None:
    config = {
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "moe_intermediate_size": 2048,
        "intermediate_size": 18432,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "n_group": 8,
        "topk_group": 4,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "quantization_config": {
            "quant_method": "awq",
            "bits": 4,
            "group_size": 128,
            "zero_point": True,
        },
    }
    spec = deployment_from_model_config(config)
    layer = spec["layer"]
    assert layer["name"] == "model.layers.3.mlp.experts"
    assert (layer["num_experts"], layer["intermediate_size"], layer["top_k"]) == (256, 2048, 8)
    assert layer["routing"]["e_score_correction_bias"] is True
    assert layer["routing"]["num_expert_group"] == 8


def test_config_without_moe_fields_is_refused() -> None:
    with pytest.raises(InvalidSpecError, match="not a MoE config"):
        deployment_from_model_config({"hidden_size": 4096, "quantization_config": {}})
