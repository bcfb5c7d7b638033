"""Rulesets by name: one per vLLM release the oracle reproduces."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from service.oracle.errors import FieldViolation, UnknownRulesetError
from service.oracle.rulesets.base import Ruleset
from service.oracle.rulesets.vllm_0_33 import RULESET as VLLM_0_33

DEFAULT_RULESET = VLLM_0_33.name
RULESETS: Mapping[str, Ruleset] = MappingProxyType({VLLM_0_33.name: VLLM_0_33})


def get_ruleset(name: str) -> Ruleset:
    try:
        return RULESETS[name]
    except KeyError:
        raise UnknownRulesetError(
            [FieldViolation("ruleset", f"unknown ruleset {name!r}; known: {sorted(RULESETS)}")]
        ) from None
