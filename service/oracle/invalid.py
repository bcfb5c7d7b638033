"""The oracle's error root and its bad-input error, apart from the rest of `errors`.

The platform profiles validate their own input and so raise `InvalidSpecError`; they live
below the selection errors (which name a platform), so these two live in a module of
their own that imports nothing of the oracle. `service.oracle.errors` re-exports them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from service.errors import MoeControlError


class OracleError(MoeControlError):
    """Base class of every error the oracle raises on purpose."""


@dataclass(frozen=True, slots=True)
class FieldViolation:
    """One bad field of a request: its dotted path and what is wrong with it."""

    field: str
    description: str


class InvalidSpecError(OracleError):
    """The deployment spec is malformed; each violation names a field and the allowed values."""

    def __init__(self, violations: Iterable[FieldViolation]) -> None:
        self.violations = tuple(violations)
        super().__init__("; ".join(f"{v.field}: {v.description}" for v in self.violations))

    @classmethod
    def single(cls, field: str, description: str) -> InvalidSpecError:
        return cls([FieldViolation(field, description)])


class UnknownRulesetError(InvalidSpecError):
    """The requested ruleset (vLLM release) is not one the oracle carries."""

    @classmethod
    def naming(
        cls, field: str, name: str, known: Iterable[str], forms: Iterable[str], note: str = ""
    ) -> UnknownRulesetError:
        """The error for `name` on `field`: the `known` rulesets, the `forms` one of them
        may be written in (every accepted spelling of one release), and a `note` after them
        (what to do about it) when there is one."""
        spellings = " or ".join(repr(form) for form in forms)
        description = (
            f"unknown ruleset {name!r}; known: {', '.join(known)} (written as {spellings})"
        )
        return cls([FieldViolation(field, f"{description}. {note}" if note else description)])
