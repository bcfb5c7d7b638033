"""vLLM 0.29's ruleset is 0.30's plus the rows 0.29.0's source differs in; each row here.

The checked-in record (tests/parity/records/vllm-0.29.jsonl.gz) proves the whole ruleset
against 0.29.0's own code; these name the delta rows so that a failure reads plainly, each
beside the newest release's answer to the same deployment.
"""

from __future__ import annotations

from typing import Any

import pytest

from service.oracle import PLATFORM_PRESETS
from service.oracle.rulesets import RULESETS
from service.oracle.rulesets import vllm_0_29 as v029
from service.oracle.rulesets import vllm_0_30 as v030
from service.oracle.rulesets.kernel_names import MOE_BACKENDS_0_29
from tests.oracle.specs import QWEN15_MOE, answer, ct, gptq
from tests.oracle.specs import spec as deployment_spec

OLD, NEW = "vllm-0.29", "vllm-0.33"


def spec(quant: dict[str, Any], platform: str = "a100", **fields: Any) -> dict[str, Any]:
    """A deployment of Qwen1.5-MoE's layer (its intermediate size is what tile padding
    reads)."""
    return deployment_spec(quant, platform, model=QWEN15_MOE, **fields)


def test_no_rdna3_in_the_oracle_or_kernel_config() -> None:
    ruleset = RULESETS[OLD]
    assert "RDNA3" not in ruleset.backends and "RDNA3" not in ruleset.experts_classes
    assert "rdna3" not in ruleset.user_backends and "rdna3" not in MOE_BACKENDS_0_29
    assert all("RDNA3" not in rule.backends for rule in ruleset.structural_rules)
    forced = answer(spec(ct(), "gfx1100", moe_backend="rdna3"), OLD)
    assert forced["error"]["stage"] == "kernel_config"
    assert "invalid choice: 'rdna3'" in forced["error"]["message"]
    assert answer(spec(ct(), "gfx1100", moe_backend="rdna3"), NEW)["backend"] == "RDNA3"


def test_gfx1100_compressed_tensors_builds_the_rdna3_method_around_the_oracle() -> None:
    old = answer(spec(ct(), "gfx1100"), OLD)
    assert old["moe_method"] == "CompressedTensorsWNA16RDNA3MoEMethod"
    assert (old["backend"], old["experts_class"]) == ("TRITON", "TritonWNA16Experts")
    assert "CT_RDNA3_METHOD_LOAD_FAILS" in {h["code"] for h in old["hazards"]}
    assert answer(spec(ct(), "gfx1100"), NEW)["backend"] == "RDNA3"
    # 8-bit schemes and other ROCm GPUs build the ordinary WNA16 method.
    eight_bit = answer(spec(ct(num_bits=8), "gfx1100"), OLD)
    assert eight_bit["moe_method"] == "CompressedTensorsWNA16MoEMethod"
    assert answer(spec(ct(), "mi300x"), OLD)["moe_method"] == "CompressedTensorsWNA16MoEMethod"


def test_gptq_act_order_is_accepted_with_marlin_s_strict_tile_shape() -> None:
    refused = answer(spec(gptq(desc_act=True)), NEW)
    assert refused["error"]["stage"] == "quantization"
    old = answer(spec(gptq(desc_act=True)), OLD)
    assert (old["backend"], old["allow_tile_padding"]) == ("MARLIN", False)
    assert answer(spec(gptq()), OLD)["allow_tile_padding"] is True


def test_act_order_keeps_marlin_off_a_shape_only_tile_padding_fits() -> None:
    # intermediate 1056 is a multiple of 32, not of 64: group 32 fits Marlin padded only.
    padded = answer(spec(gptq(group_size=32), layer={"intermediate_size": 1056}), OLD)
    assert padded["backend"] == "MARLIN"
    strict = answer(
        spec(gptq(group_size=32, desc_act=True), layer={"intermediate_size": 1056}), OLD
    )
    assert strict["moe_method"] == "MoeWNA16Method"
    assert "MOE_WNA16_DROPS_ACT_ORDER" in {h["code"] for h in strict["hazards"]}


def test_a_dynamic_rule_may_switch_act_order_on_for_a_channelwise_layer() -> None:
    quant = gptq(group_size=-1, dynamic={"+:.*experts.*": {"desc_act": True}})
    assert answer(spec(quant), NEW)["allow_tile_padding"] is True
    assert answer(spec(quant), OLD)["allow_tile_padding"] is False


def test_moe_wna16_compatibility_reads_the_raw_desc_act() -> None:
    quant = gptq(group_size=-1, desc_act=True)
    assert answer(spec(quant, quantization="moe_wna16"), NEW)["quantization"] == "moe_wna16"
    old = answer(spec(quant, quantization="moe_wna16"), OLD)
    assert old["error"]["stage"] == "quantization"
    assert "does not match" in old["error"]["message"]


def test_compressed_tensors_act_order_passes_through_and_group_is_asserted_off_triton() -> None:
    group = ct(group=32, actorder="group")
    assert answer(spec(group), NEW)["error"]["stage"] == "quantization"
    old = answer(spec(group), OLD)
    assert (old["backend"], old["allow_tile_padding"]) == ("MARLIN", False)
    triton = answer(spec(group, moe_backend="triton"), OLD)
    assert triton["error"]["message"].endswith("group activation ordering is not supported.")
    # On ROCm the oracle passes over TRITON to EMULATION, which the method then asserts off.
    on_rocm = answer(spec(group, "mi300x"), OLD)
    reasons = {c["backend"]: c["reason"] for c in on_rocm["candidates"]}
    assert reasons["TRITON"] == "group activation ordering is not supported"
    assert (on_rocm["error"]["stage"], on_rocm["error"]["type"]) == ("moe_method", "AssertionError")
    dynamic = answer(spec(ct(group=32, actorder="dynamic"), "mi300x"), OLD)
    assert dynamic["backend"] == "TRITON"
    assert "CT_DYNAMIC_ACT_ORDER_DROPPED" in {h["code"] for h in dynamic["hazards"]}


def test_a_channelwise_compressed_tensors_scheme_crashes_the_marlin_rule() -> None:
    channel = ct(group=None, strategy="channel")
    assert answer(spec(channel), NEW)["backend"] == "MARLIN"
    old = answer(spec(channel), OLD)
    assert old["error"] == {
        "stage": "backend",
        "type": "TypeError",
        "message": "'<=' not supported between instances of 'NoneType' and 'int'",
    }
    assert old["candidates"] == []
    # ROCm's Marlin check returns before it compares the group size.
    rocm = answer(spec(channel, "mi300x"), OLD)
    marlin = next(c for c in rocm["candidates"] if c["backend"] == "MARLIN")
    assert marlin["reason"] == "Marlin not supported for this layer"


@pytest.mark.parametrize(
    ("env", "ep", "in_0_29", "in_0_33"),
    [
        (None, False, "HummingIndexedExperts", "HummingIndexedExperts"),
        (None, True, "HummingIndexedExperts", "HummingGroupedExperts"),
        ("auto", True, "HummingIndexedExperts", "HummingGroupedExperts"),
        ("GROUPED", False, "HummingGroupedExperts", "HummingGroupedExperts"),
        ("indexed", True, "HummingIndexedExperts", "HummingIndexedExperts"),
    ],
)
def test_humming_gemm_type_follows_the_flag_alone(
    env: str | None, ep: bool, in_0_29: str, in_0_33: str
) -> None:
    platform = PLATFORM_PRESETS["h200"].to_json()
    if env is not None:
        platform["env"] = {"VLLM_HUMMING_MOE_GEMM_TYPE": env}
    parallel = {"tensor_parallel_size": 2, "enable_expert_parallel": True} if ep else {}
    deployment = {
        **spec(gptq(), moe_backend="humming", parallel=parallel),
        "platform": platform,
    }
    assert answer(deployment, OLD)["experts_class"] == in_0_29
    assert answer(deployment, NEW)["experts_class"] == in_0_33


def test_xpu_does_not_list_moe_wna16() -> None:
    deployment = spec(gptq(), "xpu", quantization="moe_wna16")
    assert answer(deployment, NEW)["quantization"] == "moe_wna16"
    refused = answer(deployment, OLD)
    assert (
        refused["error"]["message"] == "moe_wna16 quantization is currently not supported in xpu."
    )
    assert "moe_wna16" not in v029.INTEGRATIONS.platform_quantizations["xpu"]


def test_everything_else_is_0_30_s() -> None:
    old, new = v029.RULESET, v030.RULESET
    assert old.backends == tuple(b for b in new.backends if b != "RDNA3")
    kept = [rule for rule in new.structural_rules if rule.backends != {"RDNA3"}]
    assert [rule.code for rule in old.structural_rules] == [rule.code for rule in kept]
    replaced = {
        rule.code for rule, base in zip(old.structural_rules, kept, strict=True) if rule is not base
    }
    assert replaced == {v029.MARLIN_RULE_CODE}
    changed = {b for b in old.experts_classes if old.experts_classes[b] != new.experts_classes[b]}
    assert changed == {"HUMMING"}
    assert set(new.experts_classes) - set(old.experts_classes) == {"RDNA3"}
