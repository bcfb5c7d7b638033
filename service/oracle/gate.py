"""What an upgrade diff gates on: the fields a CI gate fails for, and which of them each
difference touches.

A diff compares every backend's verdict, and a release that lists a backend more (a new
kernel on the platform's priority list, rejected or never reached) changes a verdict of
nearly every deployment while none of them runs anything else. A gate that failed on that
would cry wolf, so a diff gates by default on what changes what runs (`DEFAULT_FAIL_ON`):
the backend, the experts class, and whether vLLM fails the deployment at start-up, at which
stage and with which exception. Every other difference (a verdict, the wording of an error
that stays the same failure) is still answered, apart, and `fail_on` may name it too.

`GATE_FIELDS` is the one list of the names `fail_on` takes, with their meaning (the CLI's
help, the API's validation and the docs read it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

from service.oracle.invalid import FieldViolation, InvalidSpecError

#: The name of each compared field a gate may fail on, and what differs when it does.
GATE_FIELDS: Mapping[str, str] = MappingProxyType(
    {
        "backend": "the WNA16 backend vLLM selects",
        "experts_class": "the experts class that runs",
        "failure": "whether vLLM fails the deployment, at which stage and with which exception",
        "error": "the failure's whole text, its message's wording included",
        "verdict": "any backend's verdict (selected, not reached, rejected and its reason code)",
    }
)
#: What a diff gates on when not told: what changes what runs.
DEFAULT_FAIL_ON: tuple[str, ...] = ("backend", "experts_class", "failure")

#: The prefix of a verdict's field in a diff ("verdict.MARLIN").
VERDICT_PREFIX = "verdict."


def parse_fail_on(names: Iterable[str], *, field: str = "fail_on") -> tuple[str, ...]:
    """The gate fields `names` choose, in `GATE_FIELDS` order (nothing given: the default).

    Each name may also be a comma-separated list ("backend,verdict"). An unknown name is
    an InvalidSpecError on `field` that lists the accepted ones."""
    chosen = {part.strip() for name in names for part in name.split(",") if part.strip()}
    if not chosen:
        return DEFAULT_FAIL_ON
    unknown = sorted(chosen - set(GATE_FIELDS))
    if unknown:
        raise InvalidSpecError(
            [
                FieldViolation(
                    field,
                    f"unknown field {', '.join(map(repr, unknown))}; accepted: "
                    f"{', '.join(GATE_FIELDS)} (default: {','.join(DEFAULT_FAIL_ON)})",
                )
            ]
        )
    return tuple(name for name in GATE_FIELDS if name in chosen)


def touched(field: str, failure_before: str, failure_after: str) -> frozenset[str]:
    """The gate fields a difference of the diff's `field` touches.

    `failure_before` and `failure_after` are the two answers' failures as
    `failure_signature` writes them: an error's difference is a `failure` one only where
    they differ (it always touches `error`)."""
    if field.startswith(VERDICT_PREFIX):
        return frozenset({"verdict"})
    if field == "error":
        changed = failure_before != failure_after
        return frozenset({"error", "failure"}) if changed else frozenset({"error"})
    return frozenset({field})


def failure_signature(stage: str | None, error_type: str | None) -> str:
    """What `failure` compares of an answer: its stage and exception class ("" when vLLM
    does not fail the deployment)."""
    return "" if stage is None else f"{stage}: {error_type}"
