"""Selection as a use case, with no transport: the platform a query names, worker 0's by
default, and the decision's metrics."""

from __future__ import annotations

import pytest

from service.dataplane.selection import PlatformChoice, Selector, SelectQuery
from service.metrics import Metrics
from service.oracle import PLATFORM_PRESETS, PlatformProfile, SelectionError
from service.pool.errors import WorkerUnavailableError

LAYER = {"num_experts": 64, "top_k": 6, "hidden_size": 2048, "intermediate_size": 1408}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


class Platforms:
    def __init__(self, profile: PlatformProfile | None) -> None:
        self.profile_0 = profile
        self.generation = 0

    def profile(self, index: int) -> PlatformProfile:
        assert index == 0 and self.profile_0 is not None
        return self.profile_0

    def default_profile(self) -> PlatformProfile | None:
        return self.profile_0


def query(**kwargs: object) -> SelectQuery:
    return SelectQuery(spec={"hf_quantization_config": GPTQ, "layer": LAYER}, **kwargs)  # type: ignore[arg-type]


def test_the_default_platform_is_worker_0s() -> None:
    answer, counters = Selector(Platforms(PLATFORM_PRESETS["a100"]), Metrics()).decide(query())
    assert answer.decision is not None and answer.decision.backend
    assert answer.platform is PLATFORM_PRESETS["a100"]
    assert answer.server_platform is PLATFORM_PRESETS["a100"]
    assert counters  # the selection counter at least, incremented once


def test_a_named_platform_needs_no_worker_and_leaves_the_query_as_it_was() -> None:
    selector = Selector(Platforms(None), Metrics())
    with pytest.raises(WorkerUnavailableError):
        selector.decide(query())
    asked = query(platform=PlatformChoice(preset="h100"))
    answer, _ = selector.decide(asked)
    assert answer.platform is not None and answer.platform.name == "h100"
    assert answer.server_platform is None
    assert "platform" not in asked.spec


def test_a_worker_index_resolves_to_that_workers_profile() -> None:
    selector = Selector(Platforms(PLATFORM_PRESETS["h200"]), Metrics())
    answer, _ = selector.decide(query(platform=PlatformChoice(worker_index=0)))
    assert answer.platform is not None and answer.platform.name == "h200"


def test_a_failed_decision_raises_with_its_candidates() -> None:
    selector = Selector(Platforms(PLATFORM_PRESETS["a100"]), Metrics())
    forced = SelectQuery(
        spec={"hf_quantization_config": GPTQ, "layer": LAYER, "moe_backend": "flashinfer_trtllm"}
    )
    with pytest.raises(SelectionError) as caught:
        selector.decide(forced)
    assert caught.value.candidates
