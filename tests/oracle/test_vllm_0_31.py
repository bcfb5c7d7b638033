"""vLLM 0.31's ruleset is 0.32's plus the rows 0.31.0's source differs in; each row here.

The checked-in record (tests/parity/records/vllm-0.31.jsonl.gz) proves the whole ruleset
against 0.31.0's own code; these name the delta rows so that a failure reads plainly.
"""

from __future__ import annotations

from typing import Any

import pytest

from service.oracle import PLATFORM_PRESETS, SelectionError, select
from service.oracle.hazards import RELEASE_HAZARDS
from service.oracle.rulesets import RULESETS, get_ruleset
from service.oracle.rulesets import vllm_0_31 as v031
from service.oracle.rulesets import vllm_0_32 as v032
from service.oracle.rulesets.kernel_names import MOE_BACKENDS_0_31, MOE_BACKENDS_0_32

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
#: Qwen3-30B-A3B's MoE layer.
QWEN3 = {"num_experts": 128, "top_k": 8, "hidden_size": 2048, "intermediate_size": 768}
CT_W4A16_G32 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "strategy": "group",
                "group_size": 32,
                "symmetric": True,
            },
        }
    },
}


def spec(platform: str = "h200", **extra: Any) -> dict[str, Any]:
    return {"hf_quantization_config": GPTQ, "layer": QWEN3, "platform": platform, **extra}


def test_the_series_resolves_here() -> None:
    assert get_ruleset("0.31.2") is RULESETS["vllm-0.31"] is v031.RULESET


def test_sm90_keeps_marlin_ahead_of_humming_without_prioritize_humming() -> None:
    assert select(spec(), ruleset="vllm-0.31").backend == "MARLIN"
    assert select(spec(), ruleset="vllm-0.32").backend == "HUMMING"
    order = v031.PRIORITY(PLATFORM_PRESETS["h200"])
    assert order.index("MARLIN") < order.index("HUMMING")


@pytest.mark.parametrize("platform", ["a100", "b200", "rtx5090", "mi300x", "gfx1100", "cpu", "xpu"])
def test_the_order_elsewhere_is_0_32_s(platform: str) -> None:
    profile = PLATFORM_PRESETS[platform]
    assert v031.PRIORITY(profile) == v032.RULESET.priority(profile)


def test_kernel_config_names_differ_from_0_32_s_in_three_entries() -> None:
    assert set(MOE_BACKENDS_0_31) ^ set(MOE_BACKENDS_0_32) == {
        "flashinfer_moe_ep_mega_cutedsl",
        "flashinfer_moe_ep_cutedsl",
        "aiter_mega_moe",
    }
    assert "flashinfer_moe_ep_mega_cutedsl" in MOE_BACKENDS_0_31
    for name, release, stage in (
        ("flashinfer_moe_ep_mega_cutedsl", "vllm-0.31", "backend"),
        ("flashinfer_moe_ep_mega_cutedsl", "vllm-0.32", "kernel_config"),
        ("aiter_mega_moe", "vllm-0.31", "kernel_config"),
        ("aiter_mega_moe", "vllm-0.32", "backend"),
    ):
        with pytest.raises(SelectionError) as caught:
            select(spec(moe_backend=name), ruleset=release)
        assert caught.value.to_json()["error"]["stage"] == stage, (name, release)


def test_rdna3_carries_the_0_31_conversion_hazard_only_there() -> None:
    ct_on_gfx1100 = {"hf_quantization_config": CT_W4A16_G32, "layer": QWEN3, "platform": "gfx1100"}
    codes = {}
    for release in ("vllm-0.31", "vllm-0.32", "vllm-0.33"):
        decision = select(ct_on_gfx1100, ruleset=release)
        assert decision.backend == "RDNA3"
        codes[release] = {h.code for h in decision.hazards}
    assert "RDNA3_CONVERSION_LAYOUT" in codes["vllm-0.31"]
    assert "RDNA3_CONVERSION_LAYOUT" not in codes["vllm-0.32"] | codes["vllm-0.33"]


def test_every_release_hazard_names_known_rulesets() -> None:
    for row in RELEASE_HAZARDS:
        assert row.rulesets and row.rulesets <= set(RULESETS), row.code


def test_everything_else_is_0_32_s() -> None:
    old, new = v031.RULESET, v032.RULESET
    assert old.backends == new.backends and old.structural_rules is new.structural_rules
    assert old.experts_classes == new.experts_classes and old.user_backends == new.user_backends
    assert old.env_flags == new.env_flags and old.integrations == new.integrations
    assert old.priority.gpu == new.priority.gpu and old.priority.cpu == new.priority.cpu
