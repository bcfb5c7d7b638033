"""What a decision counts: its selection under the platform's label (a preset's name,
`explicit`, `worker`) and ruleset, and a failed one's stage and vLLM exception type."""

from __future__ import annotations

import pytest

from service.dataplane.selection import PlatformChoice, Selector, SelectQuery
from service.metrics import Metrics
from service.oracle import DEFAULT_RULESET, PLATFORM_PRESETS, SelectionError
from tests.dataplane.test_selection import GPTQ, LAYER, Platforms


def counted(metrics: Metrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The series of one family counted above zero."""
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in metrics.registry.collect()
        for sample in family.samples
        if sample.name == name and sample.value
    }


def decide(selector: Selector, spec: dict[str, object], **kwargs: object) -> None:
    body = {"hf_quantization_config": GPTQ, "layer": LAYER, **spec}
    selector.decide(SelectQuery(spec=body, **kwargs))  # type: ignore[arg-type]


def test_selections_carry_the_platform_and_the_ruleset() -> None:
    metrics = Metrics()
    selector = Selector(Platforms(PLATFORM_PRESETS["a100"]), metrics)
    decide(selector, {})  # the serving worker's own platform
    decide(selector, {"platform": "H100"})  # a preset, by any spelling
    decide(selector, {}, platform=PlatformChoice(preset="h100"))
    decide(selector, {}, platform=PlatformChoice(profile=PLATFORM_PRESETS["l4"].to_json()))
    decide(selector, {}, platform=PlatformChoice(worker_index=0))
    by_platform: dict[str, float] = {}
    for labels, value in counted(metrics, "moe_control_backend_selections_total").items():
        label = dict(labels)
        assert label["ruleset"] == DEFAULT_RULESET
        by_platform[label["platform"]] = by_platform.get(label["platform"], 0) + value
    assert by_platform == {"worker": 2, "h100": 2, "explicit": 1}


def test_a_failed_decision_counts_its_stage_and_exception_type() -> None:
    metrics = Metrics()
    selector = Selector(Platforms(PLATFORM_PRESETS["a100"]), metrics)
    refused = {"hf_quantization_config": {**GPTQ, "desc_act": True}, "layer": LAYER}
    with pytest.raises(SelectionError) as caught:
        selector.decide(SelectQuery(spec=refused))
    assert (caught.value.error.stage, caught.value.error.type) == ("quantization", "ValueError")
    with pytest.raises(SelectionError):
        decide(selector, {"platform": "h100", "moe_backend": "flashinfer_trtllm"})
    selector.count_failure(caught.value)  # a kept failure served again
    assert counted(metrics, "moe_control_decision_failures_total") == {
        (("error", "ValueError"), ("stage", "quantization")): 2,
        (("error", "ValueError"), ("stage", "backend")): 1,
    }
    assert counted(metrics, "moe_control_backend_rejections_total")  # the forced backend's
