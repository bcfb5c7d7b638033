"""Rulesets by name: one per vLLM release the oracle reproduces, and the one resolver that
turns what a user writes ("vllm-0.33", "0.33", "0.33.0", "v0.33.0") into a ruleset.

Every place a ruleset name enters (the deployment spec's `ruleset`, the request field, the
CLI's `--ruleset`) goes through `resolve_ruleset`, so they all accept the same forms and
refuse an unknown one with the same error, which lists the known ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from service.oracle.errors import UnknownRulesetError
from service.oracle.rulesets.base import Release, Ruleset, version_tuple
from service.oracle.rulesets.vllm_0_33 import RULESET as VLLM_0_33

__all__ = [
    "DEFAULT_RULESET",
    "RULESETS",
    "Release",
    "Ruleset",
    "get_ruleset",
    "resolve_ruleset",
]

#: Every ruleset, by its name, oldest release first.
RULESETS: Mapping[str, Ruleset] = MappingProxyType(
    {r.name: r for r in sorted((VLLM_0_33,), key=lambda r: version_tuple(r.release.first) or ())}
)
#: The newest release's ruleset: what a request that names none is decided by.
DEFAULT_RULESET: str = next(reversed(RULESETS))

#: Prefixes a release may be written with ("vllm-0.33", "vllm==0.33.0", "v0.33.0").
_PREFIXES = ("vllm==", "vllm-", "vllm", "v")


def _release_number(text: str) -> tuple[int, ...] | None:
    """The release number a name spells, without prefix or local label ("+cu129")."""
    for prefix in _PREFIXES:
        if text.startswith(prefix):
            text = text[len(prefix) :].lstrip("v")
            break
    return version_tuple(text.split("+", 1)[0])


def _lookup(text: str) -> Ruleset | None:
    key = text.strip().lower()
    if key in RULESETS:
        return RULESETS[key]
    number = _release_number(key)
    if number is None:
        return None
    for ruleset in RULESETS.values():
        release = ruleset.release
        if len(number) == 2 and ".".join(map(str, number)) == release.series:
            return ruleset
        if len(number) == 3 and release.contains(number):
            return ruleset
    return None


def resolve_ruleset(name: str, *, field: str = "ruleset") -> str:
    """The canonical name of the ruleset `name` means; "" means the default.

    Accepted: a ruleset's name ("vllm-0.33"), its minor series ("0.33"), or any release
    number inside its range, bare or with a `v` or `vllm-` prefix ("0.33.0", "v0.33.1",
    "vllm-0.33.0", a local label such as "+cu129" ignored), in any case. Anything else is
    `UnknownRulesetError` on `field`, listing the known rulesets and their ranges.
    """
    if not name.strip():
        return DEFAULT_RULESET
    ruleset = _lookup(name)
    if ruleset is None:
        newest = RULESETS[DEFAULT_RULESET]
        raise UnknownRulesetError.naming(
            field,
            name,
            [f"{r.name} (vLLM {r.release.range_text})" for r in RULESETS.values()],
            [newest.name, newest.release.series, newest.release.first, f"v{newest.release.first}"],
        )
    return ruleset.name


def get_ruleset(name: str, *, field: str = "ruleset") -> Ruleset:
    """The ruleset `name` resolves to (`resolve_ruleset`)."""
    return RULESETS[resolve_ruleset(name, field=field)]
