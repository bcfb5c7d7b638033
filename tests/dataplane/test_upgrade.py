"""The diff as a use case, with no transport: the platform resolved as a selection
resolves it (the query's, else the spec's, else worker 0's), the rulesets of an upgrade in
release order, and no decision counted as a selection."""

from __future__ import annotations

import pytest

from service.dataplane.selection import PlatformChoice, Selector, SelectQuery
from service.dataplane.upgrade import DiffQuery, diff
from service.metrics import Metrics
from service.oracle import (
    PLATFORM_PRESETS,
    RULESETS,
    PlatformProfile,
    SelectionError,
    UnknownRulesetError,
)
from service.oracle.upgrade import upgrade
from service.pool.errors import WorkerUnavailableError

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
LAYER = {
    "num_experts": 8,
    "top_k": 2,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "activation": "gelu_tanh",
}
SPEC = {"hf_quantization_config": GPTQ, "layer": LAYER}
#: The decision metrics a selection counts (service/metrics.py).
DECISION_METRICS = (
    "moe_control_backend_selections",
    "moe_control_backend_rejections",
    "moe_control_decision_failures",
)


class Platforms:
    """Worker 0 as the pool reports it (None: no worker is ready)."""

    generation = 0

    def __init__(self, profile: PlatformProfile | None) -> None:
        self.profile_0 = profile

    def profile(self, index: int) -> PlatformProfile:
        assert index == 0 and self.profile_0 is not None
        return self.profile_0

    def default_profile(self) -> PlatformProfile | None:
        return self.profile_0


def test_without_a_platform_the_diff_is_for_worker_0s() -> None:
    selector = Selector(Platforms(PLATFORM_PRESETS["cpu"]), Metrics())
    answered = diff(selector, DiffQuery.upgrade(dict(SPEC), "vllm-0.32", "vllm-0.33"))
    expected = upgrade({**SPEC, "platform": "cpu"}, "vllm-0.32", "vllm-0.33")
    assert answered.to_json() == expected.to_json()
    assert answered.changed and answered.last.backend == "CPU"


def test_a_named_platform_wins_and_needs_no_worker() -> None:
    selector = Selector(Platforms(None), Metrics())
    query = DiffQuery.upgrade(dict(SPEC), "0.32", "0.33")
    with pytest.raises(WorkerUnavailableError):
        diff(selector, query)
    named = DiffQuery.upgrade(dict(SPEC), "0.32", "0.33", PlatformChoice(preset="h200"))
    answered = diff(selector, named)
    assert answered.last.platform is not None and answered.last.platform.name == "h200"
    assert "platform" not in named.spec  # the request's own spec stays as given


def test_an_upgrade_asks_every_ruleset_between_in_release_order() -> None:
    names = list(RULESETS)
    assert DiffQuery.upgrade({}, names[-1], names[0]).rulesets == tuple(reversed(names))
    with pytest.raises(UnknownRulesetError):
        DiffQuery.upgrade({}, "vllm-0.1", names[-1])


def _counted(metrics: Metrics) -> list[object]:
    return [
        sample
        for family in metrics.registry.collect()
        if family.name.startswith(DECISION_METRICS)
        for sample in family.samples
        if sample.name.endswith("_total") and sample.value
    ]


def test_a_diff_counts_no_selection() -> None:
    metrics = Metrics()
    selector = Selector(Platforms(PLATFORM_PRESETS["cpu"]), metrics)
    diff(selector, DiffQuery.upgrade(dict(SPEC), "vllm-0.32", "vllm-0.33"))
    assert _counted(metrics) == []
    # the check sees what a selection counts (a failed one under 0.32: its rejections)
    with pytest.raises(SelectionError):
        selector.decide(SelectQuery(spec=dict(SPEC), ruleset="vllm-0.32"))
    assert _counted(metrics)
