"""The upgrade diff: what changes for one deployment from one ruleset (vLLM release) to
another, and the rule or priority that moved it.

An answer under a ruleset is what `select` gives: a decision, or the failure vLLM would
raise. Four things of it are compared (`FIELDS`): the backend, the experts class, the error
(its stage, type and message) and each backend's verdict (selected, rejected with its
reason code, or not reached). Each difference carries its cause in a user's words, read
from the two rulesets' own data and the engine's trace of the backend concerned: the
structural rule or the experts-class check that rejects on one side only, a priority order
that puts another backend first, a stage of vLLM's start-up that refuses the deployment on
one side only. Nothing here knows a release: any two rulesets of the registry compare.

Over a chain of rulesets (`diff_rulesets`) each consecutive pair is compared, and the
first-to-last differences (`RulesetDiff.changes`, what an upgrade from the first to the
last changes) take their cause from the step that last moved the field, so a cause names
the release that brought it.

Each difference knows which gate fields it touches (service.oracle.gate): a diff's JSON
lists apart the differences of the fields a gate fails on (`fail_on`) and the others.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from service.oracle import gate
from service.oracle.decision import Candidate, Decision, Verdict
from service.oracle.engine import trace_backend
from service.oracle.errors import InvalidSpecError, SelectionError
from service.oracle.kernel_config import normalise_moe_backend
from service.oracle.platform import PlatformProfile
from service.oracle.rulesets import RULESETS, get_ruleset, resolve_ruleset
from service.oracle.selection import select
from service.oracle.spec import DeploymentSpec, parse_deployment

#: What is compared, in the order differences are listed; `verdict.` is followed by a
#: backend's name (one field per backend on either side's priority list).
FIELDS = ("backend", "experts_class", "error", "verdict.")
VERDICT_FIELD = "verdict."

#: The stages of vLLM's start-up a failure can arise in (`ErrorInfo.stage`), in words.
_STAGE_WORDS = {
    "kernel_config": "KernelConfig's check of the --moe-backend name",
    "environment": "the platform's check of the VLLM_* environment at start-up",
    "quantization": "the quantization config's resolution and parsing",
    "capability": "the quant method's minimum compute capability",
    "platform": "the platform's check of the engine configuration",
    "moe_method": "the MoE quant method's construction",
    "backend": "the WNA16 backend selection",
}


@dataclass(frozen=True, slots=True)
class RulesetAnswer:
    """One ruleset's answer for the deployment: its decision, or the failure vLLM would
    raise (exactly one of the two is set)."""

    ruleset: str
    decision: Decision | None = None
    failure: SelectionError | None = None

    def to_json(self) -> dict[str, Any]:
        """`moe-control select --json`'s answer: the decision, or the failure."""
        if self.decision is not None:
            return self.decision.to_json()
        assert self.failure is not None
        return self.failure.to_json()

    @property
    def backend(self) -> str | None:
        return None if self.decision is None else self.decision.backend

    @property
    def experts_class(self) -> str | None:
        return None if self.decision is None else self.decision.experts_class

    @property
    def candidates(self) -> tuple[Candidate, ...]:
        if self.decision is not None:
            return self.decision.candidates
        assert self.failure is not None
        return self.failure.candidates

    @property
    def platform(self) -> PlatformProfile | None:
        if self.decision is not None:
            return self.decision.platform
        assert self.failure is not None
        return self.failure.platform

    @property
    def failure_signature(self) -> str:
        """What the gate's `failure` compares: stage and exception class ("" without one)."""
        if self.failure is None:
            return gate.failure_signature(None, None)
        return gate.failure_signature(self.failure.error.stage, self.failure.error.type)

    def candidate(self, backend: str | None) -> Candidate | None:
        """The verdict of `backend`; None when it is not on this answer's list."""
        return next((c for c in self.candidates if c.backend == backend), None)

    def values(self) -> dict[str, str]:
        """Every compared field's value as text ("" where there is none: no backend, no
        error). Verdicts only where the answer has a priority list to judge."""
        error = "" if self.failure is None else _error_text(self.failure)
        values = {
            "backend": self.backend or "",
            "experts_class": self.experts_class or "",
            "error": error,
        }
        for c in self.candidates:
            values[VERDICT_FIELD + c.backend] = verdict_text(c)
        return values


def verdict_text(candidate: Candidate) -> str:
    """ "selected", "not_reached", or "rejected CODE"."""
    if candidate.verdict is Verdict.REJECTED:
        return f"{candidate.verdict.value} {candidate.reason_code}".rstrip()
    return candidate.verdict.value


def _error_text(failure: SelectionError) -> str:
    error = failure.error
    return f"{error.stage}: {error.type}: {error.message}"


@dataclass(frozen=True, slots=True)
class Difference:
    """One field that differs between the answers of two rulesets, with the rule or the
    priority that moved it (`cause`, naming the ruleset it comes from), and the gate fields
    it touches (`touches`, service.oracle.gate)."""

    field: str
    before: str
    after: str
    cause: str
    from_ruleset: str
    to_ruleset: str
    touches: frozenset[str] = frozenset()

    def fails(self, fail_on: Sequence[str]) -> bool:
        """Whether a gate on the fields `fail_on` fails for this difference."""
        return not self.touches.isdisjoint(fail_on)

    def to_json(self) -> dict[str, str]:
        return {
            "field": self.field,
            "before": self.before,
            "after": self.after,
            "cause": self.cause,
        }


@dataclass(frozen=True, slots=True)
class RulesetDiff:
    """One deployment under a chain of rulesets: each one's answer in the chain's order,
    the differences of each consecutive pair (`differences`), and the first-to-last ones
    (`changes`: what an upgrade from the first ruleset to the last changes)."""

    answers: tuple[RulesetAnswer, ...]
    differences: tuple[Difference, ...]
    changes: tuple[Difference, ...]

    @property
    def changed(self) -> bool:
        """Whether the last ruleset's answer differs from the first's."""
        return bool(self.changes)

    @property
    def first(self) -> RulesetAnswer:
        return self.answers[0]

    @property
    def last(self) -> RulesetAnswer:
        return self.answers[-1]

    def to_json(self, fail_on: Sequence[str] = gate.DEFAULT_FAIL_ON) -> dict[str, Any]:
        """The upgrade from the first ruleset to the last (`upgrade_json`), gated on the
        fields `fail_on` (service.oracle.gate)."""
        return upgrade_json(
            self.first.ruleset,
            self.last.ruleset,
            self.first.to_json(),
            self.last.to_json(),
            differences=[c.to_json() for c in self.changes if c.fails(fail_on)],
            other_differences=[c.to_json() for c in self.changes if not c.fails(fail_on)],
            fail_on=fail_on,
        )


def upgrade_json(
    start: str,
    end: str,
    before: dict[str, Any],
    after: dict[str, Any],
    *,
    differences: list[dict[str, str]],
    other_differences: list[dict[str, str]],
    fail_on: Sequence[str],
) -> dict[str, Any]:
    """What `moe-control diff --json` prints for a deployment and `POST /v1/diff` answers:
    both rulesets' names, whether the answer changes in a field of `fail_on` (`changed`,
    what a gate fails on), both answers (`select --json`'s: a decision, or vLLM's failure),
    the differences of those fields and, apart, every other difference, each with its
    cause."""
    return {
        "from": start,
        "to": end,
        "fail_on": list(fail_on),
        "changed": bool(differences),
        "before": before,
        "after": after,
        "differences": differences,
        "other_differences": other_differences,
    }


def answer_under(spec: DeploymentSpec, ruleset: str) -> RulesetAnswer:
    """The answer `select` gives under `ruleset` (a decision, or vLLM's failure);
    InvalidSpecError propagates (the deployment is wrong, whatever the release)."""
    name = resolve_ruleset(ruleset)
    try:
        return RulesetAnswer(name, decision=select(spec, ruleset=name))
    except SelectionError as exc:
        return RulesetAnswer(name, failure=exc)


def rulesets_between(start: str, end: str) -> tuple[str, ...]:
    """Every ruleset of the registry from `start` to `end`, both included, in release
    order (newest first when `end` is the older: a downgrade)."""
    names = list(RULESETS)
    first, last = names.index(resolve_ruleset(start)), names.index(resolve_ruleset(end))
    if first <= last:
        return tuple(names[first : last + 1])
    return tuple(reversed(names[last : first + 1]))


def diff_rulesets(spec: DeploymentSpec | Mapping[str, Any], rulesets: Sequence[str]) -> RulesetDiff:
    """The deployment's answer under each ruleset (any spelling the resolver takes; at
    least two) and what differs between them, each difference with its cause."""
    parsed = spec if isinstance(spec, DeploymentSpec) else parse_deployment(spec)
    names = [resolve_ruleset(name, field=f"rulesets[{i}]") for i, name in enumerate(rulesets)]
    if len(names) < 2:
        raise InvalidSpecError.single(
            "rulesets", f"name two rulesets or more; known: {list(RULESETS)}"
        )
    answers = tuple(answer_under(parsed, name) for name in names)
    steps = [compare(parsed, a, b) for a, b in itertools.pairwise(answers)]
    differences = tuple(d for step in steps for d in step)
    changes = _attributed(parsed, answers, steps)
    return RulesetDiff(answers, differences, changes)


def upgrade_chain(start: str, end: str) -> tuple[str, ...]:
    """The rulesets an upgrade from `start` to `end` is answered under: every one between
    them in release order (`rulesets_between`), so that the cause of each change names the
    release that brings it; from a ruleset to itself, that one twice (nothing changes)."""
    chain = rulesets_between(start, end)
    return chain if len(chain) > 1 else chain * 2


def upgrade(spec: DeploymentSpec | Mapping[str, Any], start: str, end: str) -> RulesetDiff:
    """The diff over `upgrade_chain(start, end)`; its `changes` compare the two ends."""
    return diff_rulesets(spec, upgrade_chain(start, end))


def _attributed(
    spec: DeploymentSpec,
    answers: tuple[RulesetAnswer, ...],
    steps: list[tuple[Difference, ...]],
) -> tuple[Difference, ...]:
    """First-to-last differences, each with the cause of the last step that moved its
    field to its final value (the release that brought it); without such a step (a field
    the steps between could not compare), the cause of comparing the two directly."""
    first, last = answers[0], answers[-1]
    if len(steps) == 1:  # two answers: the one step is the whole upgrade
        return steps[0]
    direct = compare(spec, first, last)
    changes = []
    for difference in direct:
        moved = next(
            (
                d
                for step in reversed(steps)
                for d in step
                if d.field == difference.field and d.after == difference.after
            ),
            None,
        )
        cause = difference.cause if moved is None else moved.cause
        changes.append(
            Difference(
                difference.field,
                difference.before,
                difference.after,
                cause,
                first.ruleset,
                last.ruleset,
                difference.touches,
            )
        )
    return tuple(changes)


def compare(spec: DeploymentSpec, a: RulesetAnswer, b: RulesetAnswer) -> tuple[Difference, ...]:
    """What differs from answer `a` to answer `b` (of the same deployment), field by field
    in `FIELDS` order, each with its cause."""
    before, after = a.values(), b.values()
    judged = bool(a.candidates) and bool(b.candidates)
    fields = ["backend", "experts_class", "error"]
    if judged:
        backends = [c.backend for c in b.candidates]
        backends += [c.backend for c in a.candidates if c.backend not in backends]
        fields += [VERDICT_FIELD + backend for backend in backends]
    causes = _Causes(spec, a, b)
    return tuple(
        Difference(
            field,
            before.get(field, ""),
            after.get(field, ""),
            causes.of(field),
            a.ruleset,
            b.ruleset,
            gate.touched(field, a.failure_signature, b.failure_signature),
        )
        for field in fields
        if before.get(field, "") != after.get(field, "")
    )


class _Causes:
    """The cause of each difference between two answers of one deployment."""

    def __init__(self, spec: DeploymentSpec, a: RulesetAnswer, b: RulesetAnswer) -> None:
        self.spec, self.a, self.b = spec, a, b
        self.r1, self.r2 = a.ruleset, b.ruleset

    def of(self, field: str) -> str:
        if field == "backend":
            return self.backend()
        if field == "experts_class":
            return self.experts_class()
        if field == "error":
            return self.error()
        return self.verdict(field.removeprefix(VERDICT_FIELD))

    # --- wording ---------------------------------------------------------------------

    def _rejection(self, ruleset: str, candidate: Candidate) -> str:
        """ "structural rule CODE (vLLM's reason)" or "experts-class check CODE (...)"."""
        code = candidate.reason_code
        rules = get_ruleset(ruleset).structural_rules
        structural = any(candidate.backend in r.backends and r.code == code for r in rules)
        kind = "structural rule" if structural else "experts-class check"
        return f"{kind} {code} ({candidate.reason})"

    def _order(self, ruleset: str) -> str:
        platform = self.a.platform or self.b.platform
        if platform is None:
            return "?"
        return " > ".join(get_ruleset(ruleset).priority(platform))

    def _passes(self, ruleset: str, backend: str) -> bool:
        """Whether `backend` passes every check of its own under `ruleset`."""
        trace = trace_backend(self.spec, ruleset, backend)
        return (
            trace is not None
            and trace.rule is None
            and any(rejection is None for _, rejection in trace.classes)
        )

    # --- the fields ------------------------------------------------------------------

    def backend(self) -> str:
        a, b, r1, r2 = self.a, self.b, self.r1, self.r2
        old, new = a.backend, b.backend
        if b.failure is not None:
            return self.error()
        if a.failure is not None:
            was = a.candidate(new)
            if was is not None and was.verdict is Verdict.REJECTED:
                return f"{r2} accepts {new}, which {r1} rejects by {self._rejection(r1, was)}"
            return self.error()
        assert a.decision is not None and b.decision is not None
        if new is None:
            return f"{r2} builds no WNA16 MoE method for the layer: {b.decision.explanation}"
        if old is None:
            why = a.decision.explanation
            return f"{r1} builds no WNA16 MoE method for the layer ({why}); {r2} does"
        forced = normalise_moe_backend(self.spec.moe_backend or "auto")
        if forced != "auto":
            return f"--moe-backend {forced} forces {old} under {r1}, {new} under {r2}"
        now = b.candidate(old)
        if now is None:
            return f"{old} is not on {r2}'s priority list for this platform"
        if now.verdict is Verdict.REJECTED:
            return f"{r2} rejects {old} by {self._rejection(r2, now)}"
        was = a.candidate(new)
        if was is None:
            return f"{new} is new on {r2}'s priority list for this platform, ahead of {old}"
        if was.verdict is Verdict.REJECTED:
            return f"{r2} accepts {new}, which {r1} rejects by {self._rejection(r1, was)}"
        return (
            f"{r2}'s priority order puts {new} ahead of {old} on this platform "
            f"({r1}: {self._order(r1)}; {r2}: {self._order(r2)})"
        )

    def experts_class(self) -> str:
        a, b, r1, r2 = self.a, self.b, self.r1, self.r2
        if a.backend != b.backend or a.backend is None:
            return self.backend()
        backend, old, new = a.backend, a.experts_class, b.experts_class
        assert old is not None and new is not None
        now = trace_backend(self.spec, r2, backend)
        if now is not None and old not in now.class_names:
            return f"{r2} does not try {old} for {backend} ({', '.join(now.class_names)})"
        if now is not None and (rejected := now.class_rejection(old)) is not None:
            code, reason = rejected
            return f"{r2} rejects {old} by experts-class check {code} ({reason})"
        was = trace_backend(self.spec, r1, backend)
        if was is not None and new not in was.class_names:
            return f"{r2} tries {new} for {backend} ahead of {old}; {r1} does not try it"
        if was is not None and (rejected := was.class_rejection(new)) is not None:
            code, reason = rejected
            return (
                f"{r2} accepts {new}, which {r1} rejects by experts-class check {code} ({reason})"
            )
        return f"{r2} tries {backend}'s experts classes in another order than {r1}"

    def error(self) -> str:
        a, b, r1, r2 = self.a, self.b, self.r1, self.r2
        if b.failure is not None and a.failure is None:
            return self._refusal(r2, b.failure)
        if a.failure is not None and b.failure is None:
            stage = a.failure.error.stage
            words = f"{r2} passes {_STAGE_WORDS.get(stage, stage)}, where {r1} fails"
            was = a.candidate(b.backend)
            if stage == "backend" and was is not None and was.verdict is Verdict.REJECTED:
                return f"{words}: {r2} accepts {b.backend}, which {r1} rejects by " + (
                    self._rejection(r1, was)
                )
            return words
        assert a.failure is not None and b.failure is not None
        old, new = a.failure.error.stage, b.failure.error.stage
        if old == new:
            words = _STAGE_WORDS.get(new, new)
            return f"both fail at stage {new} ({words}), {r2} with another message than {r1}"
        return f"{r1} fails at stage {old}, {r2} at stage {new}: {self._refusal(r2, b.failure)}"

    def _refusal(self, ruleset: str, failure: SelectionError) -> str:
        stage = failure.error.stage
        if stage != "backend":
            return f"{ruleset} refuses it at stage {stage} ({_STAGE_WORDS.get(stage, stage)})"
        rejected = [c for c in failure.candidates if c.verdict is Verdict.REJECTED]
        if not rejected:
            return f"{ruleset} maps the --moe-backend name to no WNA16 backend"
        untried = [c for c in failure.candidates if c.verdict is Verdict.NOT_REACHED]
        if len(rejected) == 1 and untried:  # a forced backend, the rest not tried
            forced = rejected[0]
            return f"{ruleset} rejects the forced {forced.backend} by " + (
                self._rejection(ruleset, forced)
            )
        # the backend the other side chose, and how this side rejects it
        now = self.b.candidate(self.a.backend) if ruleset == self.r2 else None
        if now is not None and now.verdict is Verdict.REJECTED:
            return (
                f"{ruleset} rejects every backend, {now.backend} by {self._rejection(ruleset, now)}"
            )
        return f"{ruleset} rejects every backend of its priority list"

    def verdict(self, backend: str) -> str:
        r1, r2 = self.r1, self.r2
        was, now = self.a.candidate(backend), self.b.candidate(backend)
        if was is None:
            return f"{backend} is on {r2}'s priority list for this platform, not on {r1}'s"
        if now is None:
            return f"{backend} is on {r1}'s priority list for this platform, not on {r2}'s"
        rejected_before = was.verdict is Verdict.REJECTED
        rejected_now = now.verdict is Verdict.REJECTED
        if rejected_before and rejected_now:
            return (
                f"{r2} rejects it by {self._rejection(r2, now)}; {r1} by {self._rejection(r1, was)}"
            )
        if rejected_now:
            if was.verdict is Verdict.SELECTED or self._passes(r1, backend):
                return f"{r2} rejects it by {self._rejection(r2, now)}"
            return f"{r1} never tries it; {r2} does and rejects it by {self._rejection(r2, now)}"
        if rejected_before:
            if now.verdict is Verdict.SELECTED or self._passes(r2, backend):
                return f"{r2} accepts it, which {r1} rejects by {self._rejection(r1, was)}"
            return f"{r2} never tries it; {r1} rejects it by {self._rejection(r1, was)}"
        return self.backend()  # selected <-> not reached: the winner moved
