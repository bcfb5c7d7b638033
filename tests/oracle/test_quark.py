"""AMD Quark: what vLLM's `QuarkConfig` accepts, the MoE method it builds, the oracle call.

The parity grid's Quark scenarios prove every field against vLLM's own code (0.33.0 live and
each release's record); these name the integration's rules so that a failure reads plainly:
which configs reach `QuarkW4A16Int4MoEMethod` and with what key, which releases have it,
the refusals while parsing and looking the layer up, and the hazards after selection.
"""

from __future__ import annotations

from typing import Any

import pytest

from service.oracle import InvalidSpecError, SelectionError, select
from service.oracle.quant_key import (
    K_INT4_STATIC,
    K_INT4_STATIC_32,
    K_INT4_STATIC_32_ASYM,
    K_INT4_STATIC_ASYM,
)
from service.oracle.quark import W4A16_METHOD
from service.oracle.rulesets import RULESETS
from tests.oracle.specs import MIXTRAL, QWEN15_MOE, answer, reasons, spec

WITH_W4A16 = [name for name, r in RULESETS.items() if r.integrations.quark_w4a16_moe]
WITHOUT_W4A16 = [name for name, r in RULESETS.items() if not r.integrations.quark_w4a16_moe]


def quark(
    dtype: str = "int4", group: Any = 128, symmetric: Any = True, **top: Any
) -> dict[str, Any]:
    """A Quark export's config: int4 weight-only experts by default, `top` replacing keys."""
    weight = {"dtype": dtype, "qscheme": "per_group", "group_size": group, "symmetric": symmetric}
    config = {
        "quant_method": "quark",
        "export": {"kv_cache_group": [], "pack_method": "reorder"},
        "global_quant_config": {"weight": weight, "input_tensors": None, "output_tensors": None},
        "layer_quant_config": {},
        "layer_type_quant_config": {},
        "exclude": ["lm_head"],
    }
    return {**config, **top}


def _without(key: str) -> dict[str, Any]:
    return {k: v for k, v in quark().items() if k != key}


def _failure(deployment: dict[str, Any], ruleset: str = "vllm-0.33") -> tuple[str, str, str]:
    with pytest.raises(SelectionError) as raised:
        select(deployment, ruleset=ruleset)
    error = raised.value.error
    return error.stage, error.type, error.message


def test_the_releases_with_the_int4_weight_only_method() -> None:
    assert WITHOUT_W4A16 == ["vllm-0.27", "vllm-0.28", "vllm-0.29", "vllm-0.30"]
    assert {"vllm-0.31", "vllm-0.32", "vllm-0.33"} <= set(WITH_W4A16)


@pytest.mark.parametrize(
    ("dtype", "group", "symmetric", "key"),
    [
        ("int4", 128, True, K_INT4_STATIC),
        ("int4", 32, True, K_INT4_STATIC_32),
        ("uint4", 64, True, K_INT4_STATIC),
        ("uint4", 128, False, K_INT4_STATIC_ASYM),
        ("uint4", 32, False, K_INT4_STATIC_32_ASYM),
    ],
)
@pytest.mark.parametrize("ruleset", WITH_W4A16)
def test_int4_weight_only_reaches_the_wna16_oracle(
    dtype: str, group: int, symmetric: bool, key: Any, ruleset: str
) -> None:
    decision = select(spec(quark(dtype, group, symmetric)), ruleset=ruleset)
    assert (decision.quantization, decision.moe_method) == ("quark", W4A16_METHOD)
    assert decision.weight_key == key.to_weight_key()
    assert decision.may_have_zp is not symmetric
    assert (decision.may_have_bias, decision.allow_tile_padding) == (False, False)
    assert decision.backend == "TRITON"  # an A100: Marlin turns every Quark layer down


@pytest.mark.parametrize("ruleset", WITHOUT_W4A16)
def test_releases_without_the_method_refuse_the_layer(ruleset: str) -> None:
    assert _failure(spec(quark()), ruleset) == (
        "moe_method",
        "RuntimeError",
        "Unsupported FusedMoe scheme",
    )


def test_marlin_and_rdna3_turn_quark_down_and_zen_cpu_sees_no_group_size() -> None:
    result = answer(spec(quark()), "vllm-0.33")
    assert reasons(result)["MARLIN"] == "Marlin not supported for this layer"
    assert (
        "Quark" in next(c for c in result["candidates"] if c["backend"] == "MARLIN")["explanation"]
    )
    assert reasons(answer(spec(quark(), "mi300x"), "vllm-0.33"))["RDNA3"] == (
        "only compressed-tensors checkpoints are supported"
    )
    cpu = answer(spec(quark(), {"preset": "cpu", "packages": ["zentorch"]}), "vllm-0.33")
    assert reasons(cpu)["ZEN_CPU"] == "DA8W4 requires group-quantized weights"
    assert cpu["backend"] == "CPU"


def test_humming_first_on_sm90_from_0_32_then_fails_to_load() -> None:
    for ruleset, backend in (("vllm-0.31", "TRITON"), ("vllm-0.32", "HUMMING")):
        decision = select(spec(quark(), "h100"), ruleset=ruleset)
        assert decision.backend == backend
        codes = {h.code for h in decision.hazards}
        assert ("QUARK_HUMMING_SCHEMA_TYPE_ERROR" in codes) is (backend == "HUMMING")


@pytest.mark.parametrize(
    ("deployment", "code"),
    [
        (spec(quark(), "cpu"), "QUARK_CPU_TYPE_ERROR"),
        (spec(quark(), moe_backend="emulation"), "QUARK_EMULATION_MISREAD"),
        (
            spec(quark(group=32), {"preset": "b200", "env": {"VLLM_USE_FLASHINFER_MOE_INT4": "1"}}),
            "QUARK_FLASHINFER_LAYOUT",
        ),
        (spec(quark(), layer={"activation": "silu_no_mul"}), "QUARK_NON_GATED_W13_DOUBLED"),
        (spec(quark(), layer={"has_bias": True}), "QUARK_EXPERT_BIAS_NOT_LOADED"),
        # 128 -> 64 -> 32 -> 16: no group size >= 32 divides an intermediate size of 80.
        (spec(quark(), layer={"intermediate_size": 80}), "QUARK_GROUP_SIZE_ASSERT"),
    ],
)
def test_hazards_after_selection(deployment: dict[str, Any], code: str) -> None:
    decision = select(deployment, ruleset="vllm-0.33")
    assert code in {h.code for h in decision.hazards}


def test_a_group_size_that_divides_is_kept_even_below_32() -> None:
    decision = select(spec(quark(group=16)), ruleset="vllm-0.33")
    assert not decision.hazards


def test_eplb_is_refused_after_the_oracle_chose() -> None:
    parallel = {"data_parallel_size": 2, "enable_expert_parallel": True, "enable_eplb": True}
    with pytest.raises(SelectionError) as raised:
        select(spec(quark(), parallel=parallel), ruleset="vllm-0.33")
    assert raised.value.error.message == f"EPLB is not supported {W4A16_METHOD}."
    assert raised.value.candidates  # the oracle ran first


@pytest.mark.parametrize(
    ("config", "stage", "type_", "message"),
    [
        (
            _without("export"),
            "quantization",
            "ValueError",
            "The export key should be included in the configurations of Quark quantized model",
        ),
        (
            quark(export={"pack_method": "reorder"}),
            "quantization",
            "TypeError",
            "object of type 'NoneType' has no len()",
        ),
        (
            quark(export={"kv_cache_group": ["*k_proj"], "pack_method": "reorder"}),
            "quantization",
            "ValueError",
            "The Quark quantized model has the kv_cache_group parameter setting, but no "
            "kv_cache quantization settings were found in the quantization configuration.",
        ),
        (_without("exclude"), "moe_method", "TypeError", "'NoneType' object is not iterable"),
        (
            _without("layer_type_quant_config"),
            "moe_method",
            "AttributeError",
            "'NoneType' object has no attribute 'get'",
        ),
        (
            quark(group=None),
            "moe_method",
            "ValueError",
            "Quark W4A16 weight.group_size must be a positive int, got None",
        ),
        (
            quark(symmetric="yes"),
            "moe_method",
            "ValueError",
            "Quark W4A16 weight.symmetric must be a bool, got 'yes'",
        ),
        (
            quark(export={"kv_cache_group": []}),
            "moe_method",
            "RuntimeError",
            "Unsupported FusedMoe scheme",
        ),
        (
            quark(global_quant_config={"weight": None}),
            "moe_method",
            "RuntimeError",
            "Unsupported FusedMoe scheme",
        ),
    ],
)
def test_what_vllm_refuses_with_its_own_error(
    config: dict[str, Any], stage: str, type_: str, message: str
) -> None:
    assert _failure(spec(config)) == (stage, type_, message)


def test_a_kv_cache_group_clears_the_output_quantization_it_names() -> None:
    fp8 = {"dtype": "fp8_e4m3", "qscheme": "per_tensor"}
    config = quark(
        export={"kv_cache_group": ["*experts*"], "pack_method": "reorder"},
        layer_quant_config={
            "*experts*": {
                "weight": {"dtype": "int4", "group_size": 32, "symmetric": True},
                "output_tensors": fp8,
            }
        },
    )
    # vLLM takes the pattern's output quantization for the kv cache and clears it, so the
    # experts' own config no longer quantizes outputs.
    assert select(spec(config), ruleset="vllm-0.33").moe_method == W4A16_METHOD
    del config["export"]["kv_cache_group"][0]
    assert _failure(spec(config))[1] == "NotImplementedError"


def test_the_layer_config_lookup_quirks() -> None:
    g32 = {"weight": {"dtype": "int4", "group_size": 32, "symmetric": True}}
    # A pattern without '*' matches when the layer's name is part of it.
    child = quark(layer_quant_config={"model.layers.0.mlp.experts.0.down_proj": g32})
    assert select(spec(child)).weight_key == K_INT4_STATIC_32.to_weight_key()
    # layer_type_quant_config is keyed by layer classes: a JSON key never matches.
    typed = quark(layer_type_quant_config={"RoutedExperts": g32})
    assert select(spec(typed)).weight_key == K_INT4_STATIC.to_weight_key()


def test_releases_up_to_0_28_walk_layer_quant_config_unguarded() -> None:
    missing = spec(_without("layer_quant_config"))
    assert _failure(missing, "vllm-0.28")[1:] == (
        "AttributeError",
        "'NoneType' object has no attribute 'items'",
    )
    assert _failure(missing, "vllm-0.29")[2] == "Unsupported FusedMoe scheme"
    assert select(missing, ruleset="vllm-0.31").moe_method == W4A16_METHOD


@pytest.mark.parametrize(
    "exclude", [["re:.*experts.*"], ["model.layers.0.mlp.experts.3.gate_proj"]]
)
def test_an_excluded_layer_or_child_leaves_the_layer_unquantized(exclude: list[str]) -> None:
    decision = select(spec(quark(exclude=exclude)), ruleset="vllm-0.33")
    assert (decision.moe_method, decision.backend) == ("UnquantizedFusedMoEMethod", None)


@pytest.mark.parametrize(
    ("scheme", "method"),
    [
        (
            {
                "weight": {"dtype": "fp8_e4m3", "qscheme": "per_channel"},
                "input_tensors": {"dtype": "fp8_e4m3", "qscheme": "per_channel"},
            },
            "QuarkW8A8Fp8MoEMethod",
        ),
        ({"weight": {"dtype": "fp4", "group_size": 32}}, "QuarkOCP_MX_MoEMethod"),
        ({"weight": [{"dtype": "fp8_e4m3"}, {"dtype": "int4"}]}, "QuarkW4A8Fp8MoEMethod"),
    ],
)
def test_other_quark_schemes_are_not_a_wna16_question(scheme: Any, method: str) -> None:
    with pytest.raises(InvalidSpecError) as raised:
        select(spec(quark(global_quant_config=scheme)))
    (violation,) = raised.value.violations
    assert violation.field == "hf_quantization_config.global_quant_config"
    assert method in violation.description and "WNA16" in violation.description


def test_wrong_json_types_are_field_errors() -> None:
    for config, field in (
        (quark(exclude="lm_head"), "hf_quantization_config.exclude"),
        (quark(export=["reorder"]), "hf_quantization_config.export"),
        (quark(layer_quant_config=[]), "hf_quantization_config.layer_quant_config"),
    ):
        with pytest.raises(InvalidSpecError) as raised:
            select(spec(config))
        assert raised.value.violations[0].field == field


def test_platform_and_flag_gates() -> None:
    assert _failure(spec(quark(), "xpu")) == (
        "quantization",
        "ValueError",
        "quark quantization is currently not supported in xpu.",
    )
    assert select(spec(quark(), quantization="quark")).moe_method == W4A16_METHOD
    assert _failure(spec(quark(), quantization="gptq"))[2].startswith(
        "Quantization method specified in the model config (quark) does not match"
    )
    # Quark's floor is compute capability 7.0: a V100 passes, a Pascal GPU does not.
    assert select(spec(quark(), "v100", model=QWEN15_MOE)).backend == "TRITON"
    pascal = {"device": "cuda", "capability": "6.1"}
    assert _failure(spec(quark(), pascal, model=MIXTRAL)) == (
        "capability",
        "ValueError",
        "The quantization method quark is not supported for the current GPU. Minimum "
        "capability: 70. Current capability: 61.",
    )
