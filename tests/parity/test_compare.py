"""The field-by-field comparison of an oracle answer with vLLM's: a config-validation refusal
of vLLM's agrees with a spec refusal of the oracle's, and with nothing else."""

from __future__ import annotations

from typing import Any

from tests.parity.compare import CONFIG_REFUSAL, differences

ANSWER: dict[str, Any] = {"backend": "MARLIN", "experts_class": "MarlinExperts", "candidates": []}
REFUSAL: dict[str, Any] = {
    "error": {"stage": "moe_method", "type": CONFIG_REFUSAL, "message": "1 validation error"},
    "candidates": [],
}
SPEC_REFUSED = {"invalid": "parallel.enable_eplb: not on this device"}


def test_a_config_refusal_agrees_with_a_spec_refusal() -> None:
    assert differences(REFUSAL, SPEC_REFUSED) == []


def test_a_config_refusal_disagrees_with_an_answer() -> None:
    (line,) = differences(REFUSAL, ANSWER)
    assert "vLLM refused the configuration" in line


def test_a_spec_refusal_disagrees_with_any_other_answer_of_vllm() -> None:
    (line,) = differences(ANSWER, SPEC_REFUSED)
    assert line.startswith("oracle rejected the spec")
    other_error = {"error": {**REFUSAL["error"], "type": "ValueError"}, "candidates": []}
    assert differences(other_error, SPEC_REFUSED)


def test_the_same_answer_has_no_differences() -> None:
    assert differences(ANSWER, dict(ANSWER)) == []
