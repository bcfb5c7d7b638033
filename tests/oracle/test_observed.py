"""Comparing what vLLM did with the oracle's answer: the first differing field, in order."""

from __future__ import annotations

import dataclasses

import pytest

from service.oracle import SelectionError, select
from service.oracle.observed import (
    COMPARED_FIELDS,
    CandidateOutcome,
    first_difference,
    predicted_failure,
    predicted_outcome,
)

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
LAYER = {"num_experts": 8, "top_k": 2, "hidden_size": 1024, "intermediate_size": 512}


def test_the_same_answer_agrees() -> None:
    answer = predicted_outcome(
        select({"hf_quantization_config": GPTQ, "layer": LAYER, "platform": "h100"})
    )
    assert first_difference(answer, answer) is None


def test_the_first_field_in_order_names_the_mismatch() -> None:
    predicted = predicted_outcome(
        select({"hf_quantization_config": GPTQ, "layer": LAYER, "platform": "h100"})
    )
    observed = dataclasses.replace(predicted, backend="MARLIN", experts_class="MarlinExperts")
    difference = first_difference(observed, predicted)
    assert difference is not None
    assert (difference.field, difference.observed, difference.predicted) == (
        "backend",
        "MARLIN",
        predicted.backend,
    )
    assert COMPARED_FIELDS.index("backend") < COMPARED_FIELDS.index("experts_class")


def test_candidates_differ_at_the_first_backend_that_does() -> None:
    predicted = predicted_outcome(
        select({"hf_quantization_config": GPTQ, "layer": LAYER, "platform": "h100"})
    )
    changed = list(predicted.candidates)
    changed[1] = CandidateOutcome(changed[1].backend, "rejected", "a reason vLLM gave")
    observed = dataclasses.replace(predicted, candidates=tuple(changed))
    difference = first_difference(observed, predicted)
    assert difference is not None and difference.field == "candidates"
    assert "a reason vLLM gave" in difference.observed
    shorter = dataclasses.replace(predicted, candidates=predicted.candidates[:-1])
    assert first_difference(shorter, predicted) is not None


def test_a_failure_compares_its_error_and_skips_what_it_does_not_answer() -> None:
    spec = {
        "hf_quantization_config": GPTQ,
        "layer": LAYER,
        "platform": "h100",
        "moe_backend": "flashinfer_trtllm",
    }
    with pytest.raises(SelectionError) as raised:
        select(spec)
    predicted = predicted_failure(raised.value)
    assert predicted.weight_key is None and predicted.error is not None
    observed = dataclasses.replace(predicted, may_have_zp=True)  # vLLM knows it; the failure not
    assert first_difference(observed, predicted) is None
    other_error = dataclasses.replace(predicted, error="NotImplementedError: no backend")
    difference = first_difference(other_error, predicted)
    assert difference is not None and difference.field == "error"
