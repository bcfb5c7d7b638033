"""Every release's own conversions, from its checked-in record, against what we expect of it.

A record (`conversion_records`) holds, per exactness case, what one vLLM release's loaders and
`process_weights_after_loading` produced — digests of its conversion outputs — or what it
raised. For each release and case, `exactness_cases.expectation(case, ruleset)` (0.33's rules
with that release's own in front) says what the release does, and this test holds the record
to it the way the live 0.33 test holds vLLM's tensors:

- Refused: the release raised that exception;
- Exact: its outputs are our model of it (our writer's tensors with the documented departures);
  with no departures, that is our writer's output for the release's ruleset, digest for digest;
- Wrong: it converted, and not into the checkpoint's weights.

The records are made by `make parity-record VLLM=X.Y.Z`; a record made from other cases
(the grid or the synthetic checkpoints changed) fails with the command that remakes it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from service.formats.errors import ConversionUnsupported
from service.formats.readers import LAYOUTS, write_checkpoint
from service.formats.registry import convert, read_layer
from service.oracle.rulesets import RULESETS
from tests.formats import conversion_records as records
from tests.formats.exactness_cases import (
    RELEASE_RULES,
    Case,
    E,
    Exact,
    Refused,
    Wrong,
    expectation,
    reads_uninitialised_memory,
)
from tests.formats.exactness_model import VLLM_NAMES, case_options, model_of_vllm, strip_g_idx
from tests.formats.exactness_run import CASES, case_checkpoint, case_layer, case_quant

RECORDED = records.recorded_rulesets()


@pytest.fixture(scope="module")
def current_cases_hash() -> str:
    return records.cases_hash(CASES, {case.id: case_checkpoint(case) for case in CASES})


def _record(ruleset: str) -> records.ConversionRecord:
    return records.load(records.record_path(ruleset))


def test_every_record_is_a_known_ruleset() -> None:
    assert RECORDED, "no conversion records checked in"
    assert set(RECORDED) <= set(RULESETS)
    assert set(RELEASE_RULES) <= set(RULESETS)


@pytest.mark.parametrize("ruleset", RECORDED)
def test_record_is_of_the_current_cases(ruleset: str, current_cases_hash: str) -> None:
    record = _record(ruleset)
    assert record.stale_for(current_cases_hash) is None, record.stale_for(current_cases_hash)
    assert [line["id"] for line in record.outcomes] == [case.id for case in CASES]


def _vllm_outputs(line: dict[str, object], backend: str) -> dict[str, str | None]:
    """The record's conversion outputs under our writer's names (None where absent)."""
    tensors = line["tensors"]
    assert isinstance(tensors, dict)
    return {ours: tensors.get(f"out.{theirs}") for theirs, ours in VLLM_NAMES[backend].items()}


def _digests(tensors: dict[str, torch.Tensor | None], backend: str) -> dict[str, str | None]:
    """Digests of the outputs vLLM names for `backend` (None where absent)."""
    named = {name: tensors.get(name) for name in VLLM_NAMES[backend].values()}
    return {n: None if t is None else records.tensor_digest(t) for n, t in named.items()}


def _ours(case: Case, ruleset: str) -> dict[str, torch.Tensor | None]:
    """Our writer's output for the release: its bytes where releases lay the same
    checkpoint out differently (XPU, Marlin act-order); elsewhere the same for every
    release, and its rules name where the release departs."""
    quant = case_quant(case)
    checkpoint = write_checkpoint(LAYOUTS[case.source], case_layer(case), quant)
    canonical = read_layer(case.source, checkpoint, quant, num_experts=E)
    options = case_options(case, ruleset)
    return dict(convert(canonical, case.backend, source=case.source, options=options).tensors)


def _check(case: Case, ruleset: str, line: dict[str, object]) -> None:
    expected = expectation(case, ruleset)
    if isinstance(expected, Refused):
        assert not line["ok"], f"{ruleset} now converts {case.id}: {expected.why}"
        assert line["error_type"] == expected.error_type, line
        assert expected.message in str(line["error"]), line
        return
    assert line["ok"], f"{ruleset} refuses {case.id}: {line['error_type']}: {line['error']}"
    if reads_uninitialised_memory(case):
        return  # only shapes are recorded; the live 0.33 test covers what can be said
    theirs = _vllm_outputs(line, case.backend)
    if isinstance(expected, Wrong) and expected.drops_g_idx:
        # converted as the same checkpoint without its act order, and otherwise right
        plain = replace(case, act=False)
        inner = expectation(plain, ruleset)
        assert isinstance(inner, Exact), inner
        model = model_of_vllm(plain, strip_g_idx(case_layer(case)), inner.departures, ruleset)
        assert theirs == _digests(model, case.backend), f"{ruleset} {case.id}: {expected.why}"
        return
    if isinstance(expected, Wrong):
        try:
            ours = _digests(_ours(case, ruleset), case.backend)
        except ConversionUnsupported:
            return  # we refuse what the release gets wrong
        main = "w13_weight" if case.backend == "EMULATION" else "w13_qweight"
        assert theirs[main] != ours[main], expected.why
        return
    assert isinstance(expected, Exact)
    model = model_of_vllm(case, case_layer(case), expected.departures, ruleset)
    model = _digests(model, case.backend)
    assert theirs == model, f"{ruleset} {case.id}: outputs differ from the model of vLLM"
    if not expected.departures:
        ours = _digests(_ours(case, ruleset), case.backend)
        assert theirs == ours, f"{ruleset} {case.id}: our writer's outputs differ"


@pytest.mark.parametrize("ruleset", RECORDED)
def test_release_converts_as_expected(ruleset: str) -> None:
    """Each release's record, case by case, against its expectations (one failure lists all)."""
    lines = _record(ruleset).by_id()
    failures = []
    for case in CASES:
        try:
            _check(case, ruleset, lines[case.id])
        except AssertionError as error:
            failures.append(f"{case.id}: {str(error).splitlines()[0]}")
    assert not failures, f"{len(failures)} cases:\n" + "\n".join(failures[:40])


@pytest.mark.parametrize("ruleset", sorted(RELEASE_RULES))
def test_every_release_rule_is_needed(ruleset: str) -> None:
    """Each rule a release adds decides some case differently from 0.33's rules."""
    for predicate, outcome in RELEASE_RULES[ruleset]:
        decided = [case for case in CASES if predicate(case)]
        assert decided, f"{ruleset}: a rule matches no case ({outcome})"
        assert any(expectation(case, ruleset) != expectation(case) for case in decided), outcome
