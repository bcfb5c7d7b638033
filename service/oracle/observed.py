"""What a vLLM process did beside what the oracle says it does, field by field.

The moe-control vLLM plugin reports each distinct WNA16 MoE decision a vLLM process took
(its call's inputs, its outcome, every backend's verdict and reason from vLLM's own
functions). The server decides the same deployment with the ruleset of the reporting release
and compares the two `Outcome`s in the order of `COMPARED_FIELDS`: the first field that
differs names the mismatch (and is the `field` label of its metric, so the list is bounded
and declared here once). A release no ruleset models is compared with the nearest older
ruleset, and how the two agree is the `outcome` label of its own metric (`AGREEMENTS`).
"""

from __future__ import annotations

from dataclasses import dataclass

from service.oracle.decision import Candidate, Decision, WeightKey
from service.oracle.errors import SelectionError

#: The fields compared, in order: the first that differs is the mismatch's field.
COMPARED_FIELDS = (
    "integration",
    "moe_method",
    "backend",
    "experts_class",
    "error",
    "weight_key",
    "may_have_zp",
    "may_have_bias",
    "allow_tile_padding",
    "candidates",
)


#: How an observation of a release no ruleset models compares with the ruleset it is
#: compared with: the same answer, another one, or none to compare with.
AGREEMENTS = ("agrees", "differs", "not_compared")


@dataclass(frozen=True, slots=True)
class CandidateOutcome:
    """One backend's verdict ("selected", "rejected", "not_reached") and vLLM's reason."""

    backend: str
    verdict: str
    reason: str = ""

    def __str__(self) -> str:
        return f"{self.backend}={self.verdict}" + (f" ({self.reason})" if self.reason else "")


@dataclass(frozen=True, slots=True)
class Outcome:
    """One side of a comparison: what select_wna16_moe_backend was called with and did.

    On the predicted side, a field the oracle does not answer for that outcome (the QuantKey
    inputs of a decision that failed before them) is None and is not compared."""

    integration: str | None
    moe_method: str | None
    backend: str | None
    experts_class: str | None
    error: str | None
    weight_key: WeightKey | None
    may_have_zp: bool | None
    may_have_bias: bool | None
    allow_tile_padding: bool | None
    candidates: tuple[CandidateOutcome, ...]


@dataclass(frozen=True, slots=True)
class Difference:
    """The first field where the two sides differ, and its value on each, as text."""

    field: str
    observed: str
    predicted: str


def _candidates(candidates: tuple[Candidate, ...]) -> tuple[CandidateOutcome, ...]:
    return tuple(CandidateOutcome(c.backend, str(c.verdict), c.reason) for c in candidates)


def predicted_outcome(decision: Decision) -> Outcome:
    """The oracle's answer, as an `Outcome`."""
    return Outcome(
        integration=decision.quantization,
        moe_method=decision.moe_method,
        backend=decision.backend,
        experts_class=decision.experts_class,
        error=None,
        weight_key=decision.weight_key,
        may_have_zp=decision.may_have_zp,
        may_have_bias=decision.may_have_bias,
        allow_tile_padding=decision.allow_tile_padding,
        candidates=_candidates(decision.candidates),
    )


def error_text(error_type: str, message: str) -> str:
    """An exception as both sides spell it: its class and its message."""
    return f"{error_type}: {message}"


def predicted_failure(failure: SelectionError) -> Outcome:
    """The oracle's answer where vLLM fails the deployment, as an `Outcome`."""
    return Outcome(
        integration=failure.quantization,
        moe_method=failure.moe_method,
        backend=None,
        experts_class=None,
        error=error_text(failure.error.type, failure.error.message),
        weight_key=None,
        may_have_zp=None,
        may_have_bias=None,
        allow_tile_padding=None,
        candidates=_candidates(failure.candidates),
    )


def _text(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return ", ".join(str(item) for item in value) or "none"
    return str(value)


def first_difference(observed: Outcome, predicted: Outcome) -> Difference | None:
    """The first of `COMPARED_FIELDS` where the sides differ (None: they agree).

    A field the predicted side leaves None is skipped unless it is the outcome itself
    (backend, experts class, error), which always counts. Candidates differ at the first
    backend whose verdict or reason differs (or where the lists' lengths do)."""
    always = {"backend", "experts_class", "error"}
    for name in COMPARED_FIELDS:
        mine, theirs = getattr(observed, name), getattr(predicted, name)
        if theirs is None and name not in always:
            continue
        if name == "candidates":
            difference = _candidate_difference(mine, theirs)
            if difference is not None:
                return difference
            continue
        if mine != theirs:
            return Difference(name, _text(mine), _text(theirs))
    return None


def _candidate_difference(
    observed: tuple[CandidateOutcome, ...], predicted: tuple[CandidateOutcome, ...]
) -> Difference | None:
    for mine, theirs in zip(observed, predicted, strict=False):
        if mine != theirs:
            return Difference("candidates", str(mine), str(theirs))
    if len(observed) != len(predicted):
        return Difference("candidates", _text(observed), _text(predicted))
    return None


def agreement(predicted: Outcome | None, difference: Difference | None) -> str:
    """Which of `AGREEMENTS` a comparison is (`predicted` None: the server has no answer)."""
    if predicted is None:
        return "not_compared"
    return "agrees" if difference is None else "differs"
