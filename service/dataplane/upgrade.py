"""DiffRulesets' and `POST /v1/diff`'s use case: one deployment under several rulesets,
each one's answer and what differs between them (service.oracle.upgrade compares).

The platform is resolved as for a selection (`Selector.deployment`: the request's, else
the spec's, else worker 0's), so a diff answers for exactly the platform a SelectBackend of
the same request would. Its decisions are not counted in the selection metrics: a diff asks
what several releases would do, it is no deployment's decision (the call itself is counted
by the gRPC and HTTP request metrics, as every call is).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.dataplane.selection import PlatformChoice, Selector
from service.oracle.gate import DEFAULT_FAIL_ON
from service.oracle.upgrade import RulesetDiff, diff_rulesets, upgrade_chain


@dataclass(frozen=True, slots=True)
class DiffQuery:
    """One diff request: the deployment spec (the JSON object the oracle parses), the
    platform it names (None: the spec's, else worker 0's), the rulesets to answer under,
    in order (at least two; any spelling the resolver takes) and the fields a gate fails on
    (validated: service.oracle.gate.parse_fail_on)."""

    spec: dict[str, Any]
    rulesets: tuple[str, ...]
    platform: PlatformChoice | None = None
    fail_on: tuple[str, ...] = DEFAULT_FAIL_ON

    @classmethod
    def upgrade(
        cls,
        spec: dict[str, Any],
        start: str,
        end: str,
        platform: PlatformChoice | None = None,
        fail_on: tuple[str, ...] = DEFAULT_FAIL_ON,
    ) -> DiffQuery:
        """The query of an upgrade from `start` to `end` (`upgrade_chain`: every ruleset
        between them, so that each change is attributed to the release that brings it)."""
        return cls(spec, upgrade_chain(start, end), platform, fail_on)


def diff(selector: Selector, query: DiffQuery) -> RulesetDiff:
    """Every ruleset's answer for the deployment, and their differences with causes;
    InvalidSpecError (a bad spec or ruleset) and WorkerUnavailableError (no platform to
    default to) propagate."""
    _, deployment, _ = selector.deployment(query.spec, query.platform)
    return diff_rulesets(deployment, query.rulesets)
