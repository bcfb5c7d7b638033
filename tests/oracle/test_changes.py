"""What would change the decision: the smallest changes of the fixed set, found by deciding."""

from __future__ import annotations

from typing import Any

import pytest

from service.oracle import SelectionError, select
from service.oracle.changes import CHANGES

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
LAYER = {"num_experts": 60, "top_k": 4, "hidden_size": 2048, "intermediate_size": 1408}


def _spec(platform: Any, **extra: Any) -> dict[str, Any]:
    return {"hf_quantization_config": GPTQ, "layer": LAYER, "platform": platform, **extra}


def _hints(hints: Any) -> dict[str, list[tuple[str, tuple[str, ...]]]]:
    out: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
    for hint in hints:
        out.setdefault(hint.backend, []).append((hint.outcome, tuple(c.text for c in hint.changes)))
    return out


def test_off_by_default() -> None:
    assert select(_spec("h200")).what_would_change is None
    assert select(_spec("h200")).to_json()["what_would_change"] is None


def test_installing_humming_on_h200_gets_humming() -> None:
    decision = select(_spec({"preset": "h200", "packages": []}), what_would_change=True)
    assert decision.backend == "MARLIN"
    hints = _hints(decision.what_would_change)
    assert hints["HUMMING"] == [("selected", ("install humming-kernels",))]
    assert ("selected", ("--quantization moe_wna16",)) in hints["TRITON"]
    assert "MARLIN" not in hints


def test_every_hint_really_makes_its_backend_win() -> None:
    """Each hint is checked by applying its changes to the spec and deciding again."""
    spec = _spec({"preset": "a100", "packages": []})
    decision = select(spec, what_would_change=True)
    assert decision.what_would_change
    rules = {rule.change: rule for rule in CHANGES}
    from service.oracle import parse_deployment

    for hint in decision.what_would_change:
        variant = parse_deployment(spec)
        for change in sorted(hint.changes, key=lambda c: c.kind != "platform"):
            changed = rules[change].apply(variant)
            assert changed is not None
            variant = changed
        if hint.outcome == "selected":
            assert select(variant).backend == hint.backend, hint


def test_a_pair_when_no_single_change_does_it() -> None:
    decision = select(_spec({"preset": "a100", "packages": []}), what_would_change=True)
    humming = _hints(decision.what_would_change)["HUMMING"]
    assert all(len(changes) == 2 for _, changes in humming)
    assert ("selected", ("install humming-kernels", "--moe-backend humming")) in humming


def test_a_failed_decision_says_what_would_make_a_backend_work() -> None:
    with pytest.raises(SelectionError) as caught:
        select(_spec("cpu-noamx"), what_would_change=True)
    hints = _hints(caught.value.what_would_change)
    assert ("selected", ("install zentorch",)) in hints["ZEN_CPU"]
    assert caught.value.to_json()["what_would_change"]


def test_changes_are_one_table_of_distinct_rows() -> None:
    assert len({rule.change for rule in CHANGES}) == len(CHANGES)
    kinds = {rule.change.kind for rule in CHANGES}
    assert {"package", "env", "moe_backend", "checkpoint", "parallel", "platform"} <= kinds
