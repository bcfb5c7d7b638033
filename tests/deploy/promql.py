"""Just enough PromQL reading to list the metric names an expression selects.

The dashboard and alert tests need the metric names behind each expression (to check them
against the collectors of `service/metrics.py`), not a full parser: label matchers, range
and offset durations, string literals, aggregation clauses (`by (...)`, `without (...)`,
`on (...)`, `ignoring (...)`, `group_left (...)`) and function calls are removed, and what
identifiers remain are metric names. Grafana's variables are substituted first.
"""

from __future__ import annotations

import re

#: Grafana variables and what the tests put in their place: a real job, every instance,
#: and windows longer than any test runs.
GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "$__interval": "15s",
    "$__range": "5m",
    "${datasource}": "prometheus",
    "$job": "moe-control",
    "$instance": ".*",
}

KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
    | {"and", "or", "unless", "atan2", "inf", "nan"}
)
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_CLAUSES = re.compile(
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.IGNORECASE
)
_FUNCTIONS = re.compile(r"\b[a-zA-Z_][a-zA-Z0-9_]*\s*\(")
_IDENTIFIERS = re.compile(r"(?<![\w.])[a-zA-Z_:][a-zA-Z0-9_:]*")
_DURATION = re.compile(r"^\d+(?:ms|[smhdwy])$")


def substitute(expr: str, variables: dict[str, str] | None = None) -> str:
    """`expr` with Grafana's variables replaced (longest names first: `$__range` before `$_`)."""
    table = GRAFANA_VARIABLES if variables is None else variables
    for name in sorted(table, key=len, reverse=True):
        expr = expr.replace(name, table[name])
    return expr


def metric_names(expr: str) -> set[str]:
    """The metric names `expr` selects, bare (`foo`) or by `__name__` matcher."""
    expr = substitute(expr)
    by_name = set(re.findall(r'__name__\s*=\s*"([^"]+)"', expr))
    text = _MATCHERS.sub(" ", expr.replace("\n", " "))
    text = _STRINGS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _CLAUSES.sub(" ", text)
    text = _FUNCTIONS.sub(" ", text)
    names = {
        token
        for token in _IDENTIFIERS.findall(text)
        if token.lower() not in KEYWORDS and not _DURATION.match(token)
    }
    return names | by_name
