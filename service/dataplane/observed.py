"""Fleet truth: the decisions vLLM processes report, kept, and each beside the oracle's own.

The moe-control vLLM plugin reports every distinct WNA16 MoE decision a vLLM process took
(ReportDecisions). For each, the server decides the same deployment itself, under the
ruleset of the reporting vLLM release (or the one `observed_ruleset` names, to compare a
fleet with another release), and keeps the first field where the two differ. A release no
ruleset models (newer than every one, between two, a pre-release or development build) is
news, not an error: it is compared with the nearest older ruleset, marked
`release_modelled=False` with a note saying how to add its ruleset, and counted in a
metric of its own (which the mismatch metric leaves to it: a difference there is what the
new release may have changed, not a ruleset modelled wrongly).

The store is bounded (`observed_max_deployments` distinct deployments, the least recently
reported dropped first) and, with a state dir, kept in a JSON file there, replaced
atomically (temporary file, fsync, rename) so a crash never leaves half of it. Only what
was reported is kept on disk; the server's answers are computed again on load, with the
rulesets of the server that loads them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.dataplane.files import replace_file
from service.metrics import Metrics
from service.oracle import (
    InvalidSpecError,
    SelectionError,
    UnknownRulesetError,
    parse_deployment,
    resolve_ruleset,
    select,
)
from service.oracle.decision import WeightKey
from service.oracle.json_text import parse_json
from service.oracle.observed import (
    CandidateOutcome,
    Difference,
    Outcome,
    agreement,
    first_difference,
    predicted_failure,
    predicted_outcome,
)
from service.oracle.releases import add_release_howto, match_release
from service.settings import SettingsError

log = logging.getLogger("moe_control.observed")

STORE_FILE = "observed_decisions.json"
STORE_VERSION = 1
#: Reporting processes remembered per deployment (the most recent).
PROCESSES_KEPT = 4


@dataclass(frozen=True, slots=True)
class ReportingProcess:
    """Who reported (data only: never a metric label)."""

    host: str = ""
    pod: str = ""
    namespace: str = ""
    pid: int = 0
    vllm_version: str = ""
    plugin_version: str = ""
    model: str = ""


@dataclass(frozen=True, slots=True)
class ObservedDecision:
    """One distinct decision of one vLLM process: the deployment it was for (as a spec's
    JSON text), the first layer that took it, how many did, and what vLLM did."""

    layer_name: str
    layer_count: int
    deployment_json: str
    outcome: Outcome


@dataclass
class ObservedEntry:
    """One distinct observed deployment and outcome, over every process that reported it."""

    key: str
    vllm_version: str
    observed: ObservedDecision
    #: The ruleset compared with ("" when none answers for the release) and why not, or
    #: why it is not the release's own.
    ruleset: str = ""
    note: str = ""
    #: Whether a ruleset models the reported release (recomputed on load, with the
    #: rulesets of the server that loads: a release modelled since is modelled then).
    release_modelled: bool = True
    predicted: Outcome | None = None
    difference: Difference | None = None
    count: int = 0
    processes: deque[ReportingProcess] = field(default_factory=lambda: deque(maxlen=PROCESSES_KEPT))
    first_seen: float = 0.0
    last_seen: float = 0.0


def observation_key(vllm_version: str, decision: ObservedDecision) -> str:
    """The identity of a deployment and its outcome: the same wherever it was reported and
    whichever of its layers came first (the layer name is left out)."""
    try:
        deployment: Any = json.loads(decision.deployment_json)
        if isinstance(deployment, dict) and isinstance(deployment.get("layer"), dict):
            deployment = {**deployment, "layer": {**deployment["layer"], "name": None}}
    except ValueError:
        deployment = decision.deployment_json
    text = json.dumps(
        [vllm_version, deployment, outcome_to_json(decision.outcome)], sort_keys=True, default=str
    )
    return hashlib.sha256(text.encode()).hexdigest()[:24]


# ---------------------------------------------------------------------------------------
# The server's answer beside the observed one


@dataclass(frozen=True, slots=True)
class Comparison:
    ruleset: str
    note: str
    predicted: Outcome | None
    difference: Difference | None
    modelled: bool = True


def _release_note(vllm_version: str, ruleset: str | None) -> str:
    """Why a release no ruleset models is compared with `ruleset`, and how to model it."""
    version = vllm_version or "(unknown)"
    if ruleset is None:
        return f"vLLM {version} is not modelled: no ruleset is as old"
    return (
        f"vLLM {version} is not modelled: compared with {ruleset}, the nearest older "
        f"ruleset; {add_release_howto(vllm_version)}"
    )


def compare(vllm_version: str, decision: ObservedDecision, ruleset: str | None) -> Comparison:
    """The oracle's answer for the observed deployment under `ruleset` (None: the one
    whose range holds `vllm_version`, else the nearest older one), whether a ruleset models
    the release, and the first field where the answer differs from what vLLM did."""
    match = match_release(vllm_version)
    note = "" if match.modelled else _release_note(vllm_version, match.ruleset)
    try:
        name = resolve_ruleset(ruleset, field="observed_ruleset") if ruleset else match.ruleset
    except UnknownRulesetError:
        name = None
    if name is None:
        return Comparison("", note, None, None, match.modelled)
    try:
        spec = parse_deployment(parse_json(decision.deployment_json, "deployment_json"))
    except (ValueError, InvalidSpecError) as exc:
        why = f"the server cannot decide this deployment: {exc}"
        return Comparison(name, f"{note}; {why}" if note else why, None, None, match.modelled)
    try:
        predicted = predicted_outcome(select(spec, ruleset=name))
    except SelectionError as failure:
        predicted = predicted_failure(failure)
    difference = first_difference(decision.outcome, predicted)
    return Comparison(name, note, predicted, difference, match.modelled)


# ---------------------------------------------------------------------------------------
# The store


class Observations:
    """ReportDecisions and ListObservedDecisions: the bounded store and its comparisons."""

    def __init__(
        self,
        metrics: Metrics,
        *,
        state_dir: Path | None = None,
        max_deployments: int = 4096,
        compare_ruleset: str | None = None,
    ) -> None:
        self.metrics = metrics
        self.max_deployments = max_deployments
        try:
            self.compare_ruleset = (
                resolve_ruleset(compare_ruleset, field="observed_ruleset")
                if compare_ruleset
                else None
            )
        except UnknownRulesetError as exc:
            raise SettingsError(f"observed_ruleset: {exc}") from None
        self.entries: OrderedDict[str, ObservedEntry] = OrderedDict()
        self.evicted = 0
        self.path = None if state_dir is None else Path(state_dir) / STORE_FILE
        if self.path is not None and self.path.exists():
            self._load(self.path)

    def report(
        self,
        process: ReportingProcess,
        decisions: Sequence[ObservedDecision],
        *,
        now: float | None = None,
    ) -> int:
        """Keep (or count again) each decision; returns how many were accepted."""
        now = time.time() if now is None else now
        for decision in decisions:
            entry = self._entry(process.vllm_version, decision, now)
            entry.count += 1
            entry.last_seen = now
            entry.processes.append(process)
            self.entries.move_to_end(entry.key)
            self.metrics.count_observation(
                decision.outcome.backend, decision.outcome.integration, entry.ruleset
            )
            if not entry.release_modelled:
                self.metrics.count_unmodelled(
                    entry.ruleset, agreement(entry.predicted, entry.difference)
                )
            elif entry.difference is not None:
                self.metrics.count_mismatch(entry.ruleset, entry.difference.field)
        self._evict()
        if self.path is not None and decisions:
            self._save(self.path)
        return len(decisions)

    def listing(self, *, mismatches_only: bool = False) -> list[ObservedEntry]:
        """Every kept deployment, most recently reported first."""
        entries = reversed(self.entries.values())
        return [e for e in entries if e.difference is not None or not mismatches_only]

    def _entry(self, vllm_version: str, decision: ObservedDecision, now: float) -> ObservedEntry:
        key = observation_key(vllm_version, decision)
        entry = self.entries.get(key)
        if entry is None:
            entry = ObservedEntry(key, vllm_version, decision, first_seen=now)
            self._compare(entry)
            self.entries[key] = entry
        return entry

    def _compare(self, entry: ObservedEntry) -> None:
        comparison = compare(entry.vllm_version, entry.observed, self.compare_ruleset)
        entry.ruleset = comparison.ruleset
        entry.note = comparison.note
        entry.release_modelled = comparison.modelled
        entry.predicted = comparison.predicted
        entry.difference = comparison.difference

    def _evict(self) -> None:
        while len(self.entries) > self.max_deployments:
            self.entries.popitem(last=False)
            self.evicted += 1

    # -- the file

    def _load(self, path: Path) -> None:
        try:
            loaded = json.loads(path.read_text())
            if loaded.get("version") != STORE_VERSION:
                return
            self.evicted = int(loaded.get("evicted", 0))
            for item in loaded.get("entries", []):
                entry = entry_from_json(item)
                self._compare(entry)
                self.entries[entry.key] = entry
        except (OSError, ValueError, AttributeError, KeyError, TypeError) as exc:
            # A damaged file costs the history, never a failed start.
            log.warning("ignoring unreadable observed decisions %s: %s", path, exc)
            self.entries.clear()
        self._evict()

    def _save(self, path: Path) -> None:
        payload = json.dumps(
            {
                "version": STORE_VERSION,
                "evicted": self.evicted,
                "entries": [entry_to_json(e) for e in self.entries.values()],
            }
        )
        replace_file(path, payload)


# ---------------------------------------------------------------------------------------
# JSON forms (the state file)


def outcome_to_json(outcome: Outcome) -> dict[str, Any]:
    key = outcome.weight_key
    return {
        "integration": outcome.integration,
        "moe_method": outcome.moe_method,
        "backend": outcome.backend,
        "experts_class": outcome.experts_class,
        "error": outcome.error,
        "weight_key": None if key is None else key.to_json(),
        "may_have_zp": outcome.may_have_zp,
        "may_have_bias": outcome.may_have_bias,
        "allow_tile_padding": outcome.allow_tile_padding,
        "candidates": [[c.backend, c.verdict, c.reason] for c in outcome.candidates],
    }


def outcome_from_json(obj: Mapping[str, Any]) -> Outcome:
    key = obj.get("weight_key")
    return Outcome(
        integration=obj.get("integration"),
        moe_method=obj.get("moe_method"),
        backend=obj.get("backend"),
        experts_class=obj.get("experts_class"),
        error=obj.get("error"),
        weight_key=None
        if key is None
        else WeightKey(
            str(key["dtype"]),
            str(key["scale_dtype"]),
            (int(key["group_shape"][0]), int(key["group_shape"][1])),
            bool(key["symmetric"]),
        ),
        may_have_zp=obj.get("may_have_zp"),
        may_have_bias=obj.get("may_have_bias"),
        allow_tile_padding=obj.get("allow_tile_padding"),
        candidates=tuple(CandidateOutcome(str(b), str(v), str(r)) for b, v, r in obj["candidates"]),
    )


def _process_json(process: ReportingProcess) -> dict[str, Any]:
    return {name: getattr(process, name) for name in ReportingProcess.__slots__}


def entry_to_json(entry: ObservedEntry) -> dict[str, Any]:
    decision = entry.observed
    return {
        "key": entry.key,
        "vllm_version": entry.vllm_version,
        "layer_name": decision.layer_name,
        "layer_count": decision.layer_count,
        "deployment_json": decision.deployment_json,
        "outcome": outcome_to_json(decision.outcome),
        "count": entry.count,
        "processes": [_process_json(p) for p in entry.processes],
        "first_seen": entry.first_seen,
        "last_seen": entry.last_seen,
    }


def entry_from_json(obj: Mapping[str, Any]) -> ObservedEntry:
    decision = ObservedDecision(
        layer_name=str(obj["layer_name"]),
        layer_count=int(obj["layer_count"]),
        deployment_json=str(obj["deployment_json"]),
        outcome=outcome_from_json(obj["outcome"]),
    )
    entry = ObservedEntry(
        key=str(obj["key"]),
        vllm_version=str(obj["vllm_version"]),
        observed=decision,
        count=int(obj["count"]),
        first_seen=float(obj["first_seen"]),
        last_seen=float(obj["last_seen"]),
    )
    entry.processes.extend(ReportingProcess(**p) for p in obj.get("processes", []))
    return entry
