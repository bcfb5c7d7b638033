"""The decision engine on the cases the issue names, and its error shapes."""

from __future__ import annotations

from typing import Any

import pytest

from service.oracle import InvalidSpecError, SelectionError, Verdict, select

QWEN_GPTQ: dict[str, Any] = {
    "hf_quantization_config": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": False,
        "sym": True,
    },
    "layer": {"num_experts": 60, "top_k": 4, "hidden_size": 2048, "intermediate_size": 1408},
}


def _spec(**overrides: Any) -> dict[str, Any]:
    return {**QWEN_GPTQ, **overrides}


def test_a100_gets_marlin_with_every_other_backend_explained() -> None:
    decision = select(_spec(platform="a100"))
    assert (decision.backend, decision.experts_class) == ("MARLIN", "MarlinExperts")
    assert decision.quantization == "auto_gptq"
    assert decision.moe_method == "AutoGPTQMoEMethod"
    verdicts = {c.backend: c for c in decision.candidates}
    assert verdicts["FLASHINFER_TRTLLM"].verdict is Verdict.REJECTED
    assert verdicts["FLASHINFER_TRTLLM"].reason == "zero points and bias are not supported"
    assert verdicts["FLASHINFER_TRTLLM"].reason_code == "ZERO_POINTS_OR_BIAS"
    assert verdicts["TRITON"].verdict is Verdict.NOT_REACHED


def test_not_reached_backends_carry_no_reason_as_vllm_gives_none() -> None:
    """vLLM stops at the first backend that fits (or at the forced one) and never judges
    the rest: a not_reached row has no reason and no code, only why it was not tried."""
    decision = select(_spec(platform="a100"))
    unreached = [c for c in decision.candidates if c.verdict is Verdict.NOT_REACHED]
    assert [c.backend for c in unreached] == ["BATCHED_MARLIN", "TRITON", "HUMMING", "EMULATION"]
    assert all((c.reason, c.reason_code) == ("", "") for c in unreached)
    assert {c.explanation for c in unreached} == {
        "not tried: MARLIN comes earlier in vLLM's priority order and was selected"
    }
    with pytest.raises(SelectionError) as forced:
        select(_spec(platform="a100", moe_backend="triton"))
    rest = forced.value.candidates[1:]
    assert rest and all(c.reason == "" for c in rest)
    assert rest[0].explanation == "not tried: --moe-backend triton forces TRITON"


def test_h200_prefers_humming_and_falls_back_to_marlin_without_it() -> None:
    assert select(_spec(platform="h200")).backend == "HUMMING"
    no_packages = {"preset": "h200", "packages": []}
    assert select(_spec(platform=no_packages)).backend == "MARLIN"


def test_marlin_shape_failure_falls_back_to_moe_wna16_and_triton() -> None:
    layer = {**QWEN_GPTQ["layer"], "intermediate_size": 1000}
    decision = select(_spec(platform="a100", layer=layer))
    assert decision.moe_method == "MoeWNA16Method"
    assert decision.backend == "TRITON"


def test_forced_incompatible_backend_is_vllms_value_error_with_reasons() -> None:
    with pytest.raises(SelectionError) as caught:
        select(_spec(platform="a100", moe_backend="triton"))
    error = caught.value
    assert error.error.type == "ValueError"
    assert error.error.message == (
        "WNA16 MoE backend 'TRITON' does not support the deployment configuration since "
        "expert bias is not supported."
    )
    assert error.candidates[0].backend == "TRITON"
    assert error.candidates[0].verdict is Verdict.REJECTED


def test_unknown_forced_backend_lists_the_accepted_names() -> None:
    with pytest.raises(SelectionError) as caught:
        select(_spec(platform="a100", moe_backend="cutlass"))
    assert "Expected one of ['triton', 'marlin'" in caught.value.error.message


def test_no_eligible_backend_is_not_implemented_error() -> None:
    with pytest.raises(SelectionError) as caught:
        select(_spec(platform="cpu-noamx"))
    assert caught.value.error.type == "NotImplementedError"
    assert all(c.verdict is Verdict.REJECTED for c in caught.value.candidates)


def test_hazard_for_gptq_on_emulation() -> None:
    decision = select(_spec(platform="v100"))
    assert decision.backend == "EMULATION"
    assert [h.code for h in decision.hazards] == ["GPTQ_EMULATION_ZERO_POINT"]


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"layer": QWEN_GPTQ["layer"], "platform": "a100"}, "hf_quantization_config"),
        (_spec(platform="a100", layer={"num_experts": 8}), "layer.top_k"),
        (_spec(platform="tpu"), "platform"),
        (_spec(platform="a100", quantization="fp8"), "quantization"),
        (
            _spec(platform="a100", hf_quantization_config={"quant_method": "bitsandbytes"}),
            "hf_quantization_config.quant_method",
        ),
        (
            _spec(platform="a100", parallel={"enable_eplb": True}),
            "parallel.enable_eplb",
        ),
    ],
)
def test_bad_input_names_the_field(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        select(spec)
    assert field in [v.field for v in caught.value.violations]


def test_unsupported_bits_is_vllms_own_error() -> None:
    quant = {**QWEN_GPTQ["hf_quantization_config"], "bits": 3}
    with pytest.raises(SelectionError) as caught:
        select(_spec(platform="a100", hf_quantization_config=quant))
    assert caught.value.error.message == "Unsupported quantization config: bits=3, sym=True"
    assert caught.value.error.stage == "quantization"
