"""JSON text from outside (a request body, `spec_json`, a config.json) as Python values.

Every door reads a spec through here, so a number no deployment could hold fails the same
way on each: an integer outside 64 bits (Python refuses to convert one of a few thousand
digits, deep inside the decoder), a float that overflows a double, and `NaN` / `Infinity`
(which Python's decoder accepts although JSON has no such numbers). The decoder hooks only
mark such a number; the error then names where it sits (`body.layer.num_experts`), which a
hook, seeing the digits alone, cannot.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from service.oracle.invalid import FieldViolation, InvalidSpecError

#: The integers a request may hold: 64-bit, as protobuf and every consumer of the spec read.
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
_MAX_DIGITS = len(str(INT_MAX))


class NotJSONError(InvalidSpecError):
    """The text is not JSON at all (as opposed to JSON holding a number out of range)."""


@dataclass(frozen=True, slots=True)
class _Refused:
    """Stands in for a number the decoder must not return; says why."""

    why: str


class _Hooks:
    """The decoder's number hooks for one parse; `refused` says whether one fired."""

    def __init__(self) -> None:
        self.refused = False

    def _refuse(self, why: str) -> _Refused:
        self.refused = True
        return _Refused(why)

    def integer(self, text: str) -> int | _Refused:
        digits = len(text.lstrip("-"))
        if digits > _MAX_DIGITS:
            return self._refuse(f"an integer of {digits} digits; at most 64-bit integers")
        value = int(text)
        if not INT_MIN <= value <= INT_MAX:
            return self._refuse(f"{text} is beyond a 64-bit integer")
        return value

    def real(self, text: str) -> float | _Refused:
        value = float(text)
        if not math.isfinite(value):
            shown = text if len(text) <= 32 else f"{text[:29]}..."
            return self._refuse(f"{shown} overflows a double-precision number")
        return value

    def constant(self, text: str) -> _Refused:
        return self._refuse(f"{text} is not a JSON number; give a finite number")


def _path(prefix: str, step: str) -> str:
    if step.startswith("["):
        return f"{prefix}{step}"
    return f"{prefix}.{step}" if prefix else step


def _violations(value: Any, at: str, found: list[FieldViolation]) -> None:
    """Every refused number inside `value`, each named by its path from `at`."""
    if isinstance(value, _Refused):
        found.append(FieldViolation(at, value.why))
    elif isinstance(value, dict):
        for key, item in value.items():
            _violations(item, _path(at, str(key)), found)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _violations(item, _path(at, f"[{index}]"), found)


def parse_json(text: str, field: str, *, numbers_at: str | None = None) -> Any:
    """Parse JSON text; bad JSON and hostile nesting raise `NotJSONError` naming `field`
    (the request field or file the text came from), an out-of-range number
    `InvalidSpecError` naming its path below `numbers_at` (default: `field`; a file's
    reader passes the name its fields go by, "config" for a config.json)."""
    hooks = _Hooks()
    try:
        value = json.loads(
            text, parse_int=hooks.integer, parse_float=hooks.real, parse_constant=hooks.constant
        )
    except json.JSONDecodeError as exc:
        raise NotJSONError.single(field, f"not JSON: {exc}") from None
    except RecursionError:
        # Hostile nesting ("[[[[..." a few thousand deep) overflows the decoder's recursion.
        raise NotJSONError.single(field, "nested too deeply") from None
    if hooks.refused:
        found: list[FieldViolation] = []
        _violations(value, field if numbers_at is None else numbers_at, found)
        raise InvalidSpecError(found)
    return value


def parse_json_object(text: str, field: str) -> dict[str, Any]:
    """`parse_json` for text that must hold a JSON object."""
    value = parse_json(text, field)
    if not isinstance(value, dict):
        raise InvalidSpecError.single(field, "must be a JSON object")
    return value
