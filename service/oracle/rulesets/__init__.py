"""Rulesets by name: one per vLLM release the oracle reproduces (`releases.RELEASES` names
them, with the releases each answers for), and their listing.

Names enter through `resolve_ruleset` (service.oracle.releases), re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from service.oracle.releases import DEFAULT_RULESET, RELEASES, Release, resolve_ruleset
from service.oracle.rulesets.base import Ruleset
from service.oracle.rulesets.vllm_0_27 import RULESET as VLLM_0_27
from service.oracle.rulesets.vllm_0_28 import RULESET as VLLM_0_28
from service.oracle.rulesets.vllm_0_29 import RULESET as VLLM_0_29
from service.oracle.rulesets.vllm_0_30 import RULESET as VLLM_0_30
from service.oracle.rulesets.vllm_0_31 import RULESET as VLLM_0_31
from service.oracle.rulesets.vllm_0_32 import RULESET as VLLM_0_32
from service.oracle.rulesets.vllm_0_33 import RULESET as VLLM_0_33
from service.oracle.rulesets.vllm_0_34 import RULESET as VLLM_0_34

__all__ = [
    "DEFAULT_RULESET",
    "RULESETS",
    "Release",
    "Ruleset",
    "get_ruleset",
    "listing",
    "resolve_ruleset",
]

#: Every ruleset, by its name, in the order of the release table (oldest first); every
#: row of that table has its ruleset here (tests/oracle/test_rulesets.py).
RULESETS: Mapping[str, Ruleset] = MappingProxyType(
    {
        r.name: r
        for r in sorted(
            (
                VLLM_0_27,
                VLLM_0_28,
                VLLM_0_29,
                VLLM_0_30,
                VLLM_0_31,
                VLLM_0_32,
                VLLM_0_33,
                VLLM_0_34,
            ),
            key=lambda r: list(RELEASES).index(r.name),
        )
    }
)


def get_ruleset(name: str, *, field: str = "ruleset") -> Ruleset:
    """The ruleset `name` resolves to (`resolve_ruleset`: any spelling of its release)."""
    return RULESETS[resolve_ruleset(name, field=field)]


def listing() -> list[dict[str, Any]]:
    """Every ruleset as plain JSON, oldest release first: its name, whether it is the
    default, the vLLM releases it answers for, that release's torch and humming-kernels
    pins, its backends and the `--moe-backend` values it accepts. `moe-control rulesets`
    prints this; ListRulesets carries the same, field for field."""
    return [
        {
            "name": r.name,
            "default": r.name == DEFAULT_RULESET,
            "vllm": r.release.range_text,
            "first_version": r.release.first,
            "below_version": r.release.below,
            "torch": r.release.torch,
            "humming_kernels": r.release.humming_kernels,
            "backends": list(r.backends),
            "moe_backends": sorted(r.user_backends),
        }
        for r in RULESETS.values()
    ]
