"""`select`: the library's one entry point, a spec in, vLLM's decision out.

The engine decides; with `what_would_change` the answer also carries, for every backend that
did not win, the smallest changes of the fixed set that make it win (`changes`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from service.oracle.changes import hints_for
from service.oracle.decision import Decision
from service.oracle.engine import decide
from service.oracle.errors import SelectionError
from service.oracle.rulesets import DEFAULT_RULESET, resolve_ruleset
from service.oracle.spec import DeploymentSpec, parse_deployment


def select(
    spec: DeploymentSpec | Mapping[str, Any],
    *,
    ruleset: str | None = None,
    what_would_change: bool = False,
) -> Decision:
    """What vLLM would pick for this deployment's MoE layer, and why, exactly.

    Raises `InvalidSpecError` for a malformed spec and `SelectionError` where vLLM itself
    would fail (with vLLM's exception type and message, and the per-backend verdicts).
    `what_would_change`: also search the fixed set of changes for the smallest ones that
    make each other backend win; off (the default), nothing of that search runs.
    `ruleset` (any form `resolve_ruleset` accepts) wins over the spec's own `ruleset`;
    with neither, the newest release decides.
    """
    parsed = spec if isinstance(spec, DeploymentSpec) else parse_deployment(spec)
    ruleset = resolve_ruleset(ruleset or parsed.ruleset or DEFAULT_RULESET)
    if not what_would_change:
        return decide(parsed, ruleset)
    try:
        decision = decide(parsed, ruleset)
    except SelectionError as exc:
        exc.what_would_change = hints_for(parsed, ruleset, None)
        raise
    return dataclasses.replace(
        decision, what_would_change=hints_for(parsed, ruleset, decision.backend)
    )
