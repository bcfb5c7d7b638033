"""Explanations beside vLLM's reasons: vLLM's text stays, ours says it in a user's terms."""

from __future__ import annotations

from typing import Any

import pytest

from service.oracle import DEFAULT_RULESET, InvalidSpecError, SelectionError, Verdict, select

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
LAYER = {"num_experts": 60, "top_k": 4, "hidden_size": 2048, "intermediate_size": 1408}


def _spec(platform: Any, **extra: Any) -> dict[str, Any]:
    return {"hf_quantization_config": GPTQ, "layer": LAYER, "platform": platform, **extra}


def _candidate(decision: Any, backend: str) -> Any:
    return next(c for c in decision.candidates if c.backend == backend)


def test_a_missing_humming_package_keeps_vllms_device_text_and_says_install_it() -> None:
    humming = _candidate(select(_spec({"preset": "h200", "packages": []})), "HUMMING")
    assert humming.verdict is Verdict.REJECTED
    assert humming.reason == "kernel does not support current device cuda"
    assert "humming package is not installed" in humming.explanation
    assert "pip install humming-kernels" in humming.explanation


def test_an_old_gpu_is_a_device_problem_not_a_package_one() -> None:
    with pytest.raises(SelectionError) as caught:
        select(_spec("v100", moe_backend="humming"))
    humming = caught.value.candidates[0]
    assert "compute capability 7.5 or newer, not cuda 7.0" in humming.explanation


def test_expert_bias_is_the_integrations_declaration_not_the_checkpoints() -> None:
    with pytest.raises(SelectionError) as caught:
        select(_spec("a100", moe_backend="triton"))
    triton = caught.value.candidates[0]
    assert (triton.reason_code, triton.reason) == ("EXPERT_BIAS", "expert bias is not supported")
    assert "AutoGPTQ integration declares may_have_bias=True" in triton.explanation
    assert "not of the model" in triton.explanation


def test_flashinfer_says_which_of_its_three_needs_are_missing() -> None:
    quant = {**GPTQ, "group_size": 32}
    spec = _spec({"preset": "b200", "packages": []}, hf_quantization_config=quant)
    spec["quantization"] = "moe_wna16"
    flashinfer = _candidate(select(spec), "FLASHINFER_TRTLLM")
    assert flashinfer.reason == "kernel does not support current device cuda"
    assert "VLLM_USE_FLASHINFER_MOE_INT4=1" in flashinfer.explanation
    assert "flashinfer package" in flashinfer.explanation
    assert "Blackwell" not in flashinfer.explanation  # b200 is one


def test_a_layer_left_unquantized_says_so() -> None:
    quant = {**GPTQ, "dynamic": {"-:.*experts": {}}}
    decision = select(_spec("a100", hf_quantization_config=quant))
    assert (decision.moe_method, decision.backend) == ("UnquantizedFusedMoEMethod", None)
    assert "is not quantized" in decision.explanation
    assert "no WNA16 backend" in decision.explanation


def test_every_answer_names_its_platform_and_ruleset_failed_ones_too() -> None:
    decision = select(_spec({"preset": "h200", "packages": []}))
    assert decision.to_json()["platform"]["preset"] == "h200"
    assert decision.to_json()["platform"]["packages"] == []
    assert decision.to_json()["ruleset"] == DEFAULT_RULESET
    with pytest.raises(SelectionError) as caught:
        select(_spec("cpu-noamx"))
    failed = caught.value.to_json()
    assert failed["ruleset"] == DEFAULT_RULESET
    assert failed["platform"] is not None
    assert failed["platform"]["preset"] == "cpu-noamx"
    assert failed["platform"]["amx"] is False


def test_an_env_flag_vllm_does_not_read_is_refused_naming_the_ones_it_reads() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        select(_spec({"preset": "h100", "env": {"FOO": "1"}}))
    (violation,) = caught.value.violations
    assert violation.field == "platform.env.FOO"
    assert "VLLM_BATCH_INVARIANT" in violation.description
    with pytest.raises(InvalidSpecError) as caught:
        select(_spec({"preset": "h100", "env": {"VLLM_BATCH_INVARIANT": "yes"}}))
    assert caught.value.violations[0].field == "platform.env.VLLM_BATCH_INVARIANT"
    assert select(_spec({"preset": "h100", "env": {"VLLM_BATCH_INVARIANT": "1"}})).backend


def test_a_moe_wna16_fallback_is_not_blamed_on_the_checkpoint() -> None:
    """GPTQ on ROCm: Marlin cannot take the layer, so AutoGPTQ hands it to MoeWNA16Method,
    whose layout MARLIN turns down; vLLM's text names a layout the checkpoint never had."""
    decision = select(_spec("mi300x"))
    marlin = _candidate(decision, "MARLIN")
    assert marlin.reason == "the MoeWNA16 checkpoint layout is not supported"
    assert "the checkpoint is not MoeWNA16" in marlin.explanation
    assert "Marlin kernels do not run on ROCm" in marlin.explanation
    forced = _candidate(select(_spec("a100", quantization="moe_wna16")), "MARLIN")
    assert "--quantization moe_wna16" in forced.explanation
