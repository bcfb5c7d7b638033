"""The upgrade diff over the real rulesets: what changes for a deployment from one release
to another, and the rule or priority each cause names.

vLLM 0.33 taught `CPUExpertsInt4` GELU_TANH (0.32 accepts SILU only), so a GELU_TANH layer
on a CPU fails under 0.32 and runs on CPU under 0.33: a real difference in every field the
diff compares. The grid test holds the diff to `select` itself over every pair of
consecutive rulesets the registry has, so rulesets that land later are held to it too.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from service.oracle import (
    PLATFORM_PRESETS,
    RULESETS,
    InvalidSpecError,
    SelectionError,
    UnknownRulesetError,
    parse_deployment,
    select,
)
from service.oracle.engine import trace_backend
from service.oracle.upgrade import (
    diff_rulesets,
    rulesets_between,
    upgrade,
    upgrade_chain,
)
from tests.parity.grid import generate

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


def spec(activation: str = "silu", platform: str = "cpu", **extra: Any) -> dict[str, Any]:
    layer = {
        "num_experts": 8,
        "top_k": 2,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "activation": activation,
    }
    return {"hf_quantization_config": GPTQ, "layer": layer, "platform": platform, **extra}


def by_field(diff: Any) -> dict[str, Any]:
    return {d.field: d for d in diff.changes}


def test_gelu_tanh_on_a_cpu_moves_from_failing_to_cpu_experts() -> None:
    diff = upgrade(spec("gelu_tanh"), "vllm-0.32", "vllm-0.33")
    assert diff.changed and diff.first.failure is not None and diff.last.backend == "CPU"
    changes = by_field(diff)
    assert set(changes) >= {"backend", "experts_class", "error", "verdict.CPU"}
    backend = changes["backend"]
    assert (backend.before, backend.after) == ("", "CPU")
    # the cause names the release, the kind of rule, its code and vLLM's own reason
    reason = diff.first.candidate("CPU")
    assert reason is not None and reason.reason_code == "ACTIVATION"
    assert backend.cause.startswith("vllm-0.33 accepts CPU")
    assert f"experts-class check ACTIVATION ({reason.reason})" in backend.cause
    verdict = changes["verdict.CPU"]
    assert (verdict.before, verdict.after) == ("rejected ACTIVATION", "selected")
    assert changes["error"].before.startswith("backend: NotImplementedError: ")
    assert changes["error"].after == ""
    assert changes["experts_class"].after == diff.last.experts_class


def test_the_downgrade_names_the_older_release_s_rejection() -> None:
    diff = upgrade(spec("gelu_tanh"), "vllm-0.33", "vllm-0.32")
    changes = by_field(diff)
    assert (changes["backend"].before, changes["backend"].after) == ("CPU", "")
    assert changes["backend"].cause.startswith("vllm-0.32 rejects every backend, CPU by ")
    assert "experts-class check ACTIVATION" in changes["backend"].cause
    assert changes["verdict.CPU"].cause.startswith("vllm-0.32 rejects it by experts-class check")


def test_silu_on_a_cpu_changes_nothing() -> None:
    diff = upgrade(spec("silu"), "vllm-0.32", "vllm-0.33")
    assert not diff.changed and diff.changes == () and diff.differences == ()
    assert diff.first.backend == diff.last.backend == "CPU"


@pytest.mark.parametrize("name", list(RULESETS))
def test_a_ruleset_against_itself_changes_nothing(name: str) -> None:
    diff = upgrade(spec("gelu_tanh"), name, name)
    assert [a.ruleset for a in diff.answers] == [name, name]
    assert not diff.changed


def test_a_forced_backend_that_one_release_refuses() -> None:
    # The CPU backend forced through a --moe-backend name neither release maps differs only
    # in KernelConfig's list of names (0.33 added one): the error text moves, nothing else.
    diff = upgrade(spec("silu", moe_backend="cpu"), "0.32", "0.33")
    (change,) = diff.changes
    assert change.field == "error" and change.before.startswith("kernel_config: ArgumentError")
    assert "both fail at stage kernel_config" in change.cause
    # the same failure in other words: a gate on the failure passes, one on its text fails
    assert change.touches == {"error"}
    assert not diff.to_json()["changed"] and diff.to_json(("error",))["changed"]


def test_json_is_the_http_contract() -> None:
    diff = upgrade(spec("gelu_tanh"), "v0.32.0", "0.33.1")
    answer = diff.to_json()
    assert list(answer) == [
        "from",
        "to",
        "fail_on",
        "changed",
        "before",
        "after",
        "differences",
        "other_differences",
    ]
    assert (answer["from"], answer["to"], answer["changed"]) == ("vllm-0.32", "vllm-0.33", True)
    assert answer["fail_on"] == ["backend", "experts_class", "failure"]
    assert answer["before"] == diff.first.failure.to_json()  # type: ignore[union-attr]
    assert answer["after"] == select(spec("gelu_tanh"), ruleset="vllm-0.33").to_json()
    for difference in answer["differences"] + answer["other_differences"]:
        assert list(difference) == ["field", "before", "after", "cause"]
    gated = {d["field"] for d in answer["differences"]}
    assert gated == {"backend", "experts_class", "error"}  # error: the failure goes away
    assert {d["field"] for d in answer["other_differences"]} == {"verdict.CPU"}


def test_trace_backend_evaluates_every_check() -> None:
    parsed = parse_deployment(spec("gelu_tanh"))
    old = trace_backend(parsed, "vllm-0.32", "CPU")
    new = trace_backend(parsed, "vllm-0.33", "CPU")
    assert old is not None and new is not None and old.rule is None
    (name,) = old.class_names
    rejection = old.class_rejection(name)
    assert rejection is not None and rejection[0] == "ACTIVATION"
    assert new.class_rejection(name) is None
    assert trace_backend(parsed, "vllm-0.33", "NO_SUCH_BACKEND") is None
    # vLLM fails before the oracle: nothing to trace
    refused = parse_deployment(spec("silu", moe_backend="cpu"))
    assert trace_backend(refused, "vllm-0.33", "CPU") is None


def test_rulesets_between_follow_the_release_order() -> None:
    names = list(RULESETS)
    assert rulesets_between(names[0], names[-1]) == tuple(names)
    assert rulesets_between(names[-1], names[0]) == tuple(reversed(names))
    assert upgrade_chain("0.33", "vllm-0.33") == ("vllm-0.33", "vllm-0.33")
    assert [a.ruleset for a in upgrade(spec(), names[0], names[-1]).answers] == names


def test_unknown_and_too_few_rulesets_are_domain_errors() -> None:
    with pytest.raises(UnknownRulesetError) as caught:
        diff_rulesets(spec(), ["vllm-0.33", "0.99"])
    assert caught.value.violations[0].field == "rulesets[1]"
    assert "vllm-0.33" in caught.value.violations[0].description
    with pytest.raises(InvalidSpecError) as few:
        diff_rulesets(spec(), ["vllm-0.33"])
    assert few.value.violations[0].field == "rulesets"
    with pytest.raises(InvalidSpecError):
        upgrade({"layer": {}}, "vllm-0.32", "vllm-0.33")


def _compared(answer: Any) -> tuple[Any, ...]:
    """What the diff compares of `select`'s answer, read straight from it: each backend's
    verdict, whatever order the release lists its backends in."""
    if isinstance(answer, SelectionError):
        error = (answer.error.stage, answer.error.type, answer.error.message)
        return (
            None,
            None,
            error,
            tuple(sorted((c.backend, c.verdict, c.reason_code) for c in answer.candidates)),
        )
    verdicts = tuple(sorted((c.backend, c.verdict, c.reason_code) for c in answer.candidates))
    return answer.backend, answer.experts_class, None, verdicts


def _select(raw: dict[str, Any], ruleset: str) -> Any:
    try:
        return select(raw, ruleset=ruleset)
    except SelectionError as exc:
        return exc


#: Every consecutive pair of the registry's rulesets (more as releases land).
PAIRS = list(itertools.pairwise(RULESETS))


@pytest.mark.parametrize(("old", "new"), PAIRS)
def test_over_the_parity_grid_a_diff_changes_exactly_where_select_does(old: str, new: str) -> None:
    changed = 0
    for raw in generate()[::7]:
        try:
            diff = diff_rulesets(raw, [old, new])
        except InvalidSpecError:
            continue
        before, after = _compared(_select(raw, old)), _compared(_select(raw, new))
        if not (before[3] and after[3]):  # verdicts compared only where both sides judged
            before, after = before[:3], after[:3]
        differs = before != after
        assert diff.changed == differs, raw["id"]
        changed += differs
        for change in diff.changes:
            assert change.before != change.after
            assert change.cause and (old in change.cause or new in change.cause), change
    assert changed, f"no grid deployment changes from {old} to {new}"


def test_a_priority_change_is_named_as_one() -> None:
    """Wherever two consecutive rulesets order a preset's backends differently and the
    winner moves with no check moving it, the cause is the priority order."""
    seen = 0
    for (old, new), (name, platform) in itertools.product(PAIRS, PLATFORM_PRESETS.items()):
        if RULESETS[old].priority(platform) == RULESETS[new].priority(platform):
            continue
        diff = diff_rulesets(spec("silu", name), [old, new])
        moved = by_field(diff).get("backend")
        if moved is None or diff.first.failure or diff.last.failure:
            continue
        before = diff.last.candidate(diff.first.backend)
        after = diff.first.candidate(diff.last.backend)
        if (
            before is not None
            and after is not None
            and "rejected"
            not in (
                before.verdict.value,
                after.verdict.value,
            )
        ):
            assert moved.cause.startswith(f"{new}'s priority order puts {diff.last.backend}")
            seen += 1
    if not seen:
        pytest.skip("no two consecutive rulesets of the registry order a preset differently")


def test_over_a_chain_each_change_takes_the_cause_of_the_step_that_brought_it() -> None:
    diff = diff_rulesets(spec("gelu_tanh"), ["vllm-0.32", "vllm-0.32", "vllm-0.33"])
    step = [
        d for d in diff.differences if d.from_ruleset == "vllm-0.32" and d.to_ruleset == "vllm-0.33"
    ]
    assert step and len(step) == len(diff.differences)  # the first step changes nothing
    assert [(c.field, c.before, c.after, c.cause) for c in diff.changes] == [
        (d.field, d.before, d.after, d.cause) for d in step
    ]
    assert {(c.from_ruleset, c.to_ruleset) for c in diff.changes} == {("vllm-0.32", "vllm-0.33")}
    # there and back: each step differs, the upgrade as a whole does not
    round_trip = diff_rulesets(spec("gelu_tanh"), ["vllm-0.32", "vllm-0.33", "vllm-0.32"])
    assert round_trip.differences and not round_trip.changed
