"""What an upgrade diff gates on: by default the backend, the experts class and the failure
(its stage and exception); a verdict of a backend a release newly lists, or an error's
wording, is answered apart. Over the parity grid the gate is held to `select` itself for
every pair of consecutive rulesets the registry has, so rulesets that land later are too."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from service.oracle import RULESETS, InvalidSpecError, SelectionError, select
from service.oracle.gate import DEFAULT_FAIL_ON, GATE_FIELDS, parse_fail_on, touched
from service.oracle.upgrade import diff_rulesets, upgrade
from tests.oracle.test_upgrade import spec
from tests.parity.grid import generate


def test_the_default_is_what_changes_what_runs() -> None:
    assert DEFAULT_FAIL_ON == ("backend", "experts_class", "failure")
    assert parse_fail_on([]) == parse_fail_on(["", " "]) == DEFAULT_FAIL_ON


def test_fields_are_taken_comma_separated_or_repeated_in_the_table_s_order() -> None:
    assert parse_fail_on(["verdict,backend"]) == ("backend", "verdict")
    assert parse_fail_on(["error", "backend, failure"]) == ("backend", "failure", "error")
    assert parse_fail_on(list(GATE_FIELDS)) == tuple(GATE_FIELDS)


def test_an_unknown_field_names_the_flag_and_lists_the_accepted() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        parse_fail_on(["backend,verdicts", "stage"], field="--fail-on")
    (violation,) = caught.value.violations
    assert violation.field == "--fail-on"
    assert violation.description.startswith("unknown field 'stage', 'verdicts'; accepted: ")
    for name in GATE_FIELDS:
        assert name in violation.description


def test_what_each_difference_touches() -> None:
    assert touched("verdict.MARLIN", "", "") == {"verdict"}
    assert touched("backend", "", "backend: ValueError") == {"backend"}
    assert touched("error", "backend: ValueError", "backend: ValueError") == {"error"}
    assert touched("error", "", "backend: ValueError") == {"error", "failure"}
    assert touched("error", "quantization: ValueError", "backend: ValueError") == {
        "error",
        "failure",
    }


def _newly_listed() -> tuple[str, str, str, str]:
    """A consecutive pair of rulesets, a preset and a backend on the newer one's priority
    list only, where the winner stays: the diff differs in that backend's verdict alone."""
    for old, new in itertools.pairwise(RULESETS):
        for platform in ("a100", "h100", "mi300x", "cpu", "gfx1100", "l4"):
            diff = diff_rulesets(spec("silu", platform), [old, new])
            fields = {c.field for c in diff.changes}
            if fields and all(f.startswith("verdict.") for f in fields):
                return old, new, platform, sorted(fields)[0]
    pytest.skip("no two consecutive rulesets differ in a verdict alone")


def test_a_verdict_alone_is_answered_apart_and_does_not_fail_the_gate() -> None:
    old, new, platform, field = _newly_listed()
    diff = upgrade(spec("silu", platform), old, new)
    answer = diff.to_json()
    assert diff.changed and not answer["changed"] and answer["differences"] == []
    assert field in {d["field"] for d in answer["other_differences"]}
    gated = diff.to_json(("verdict",))
    assert gated["changed"] and gated["other_differences"] == []
    assert gated["fail_on"] == ["verdict"]


def _gate_values(answer: Any) -> tuple[Any, ...]:
    """The default gate's fields, read from `select`'s own answer."""
    if isinstance(answer, SelectionError):
        return None, None, (answer.error.stage, answer.error.type)
    return answer.backend, answer.experts_class, None


def _select(raw: dict[str, Any], ruleset: str) -> Any:
    try:
        return select(raw, ruleset=ruleset)
    except SelectionError as exc:
        return exc


@pytest.mark.parametrize(("old", "new"), list(itertools.pairwise(RULESETS)))
def test_over_the_parity_grid_the_gate_fails_exactly_where_what_runs_changes(
    old: str, new: str
) -> None:
    for raw in generate()[::7]:
        try:
            answer = diff_rulesets(raw, [old, new]).to_json()
        except InvalidSpecError:
            continue
        moved = _gate_values(_select(raw, old)) != _gate_values(_select(raw, new))
        assert answer["changed"] == moved, raw["id"]
        assert bool(answer["differences"]) == moved
