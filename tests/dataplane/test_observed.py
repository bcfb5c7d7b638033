"""The observed-decision store: each report beside the oracle's answer under the ruleset of
the reporting release (or the one the server is told), bounded, and kept on disk atomically."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from service.dataplane.observed import (
    STORE_FILE,
    Observations,
    ObservedDecision,
    ReportingProcess,
)
from service.metrics import Metrics
from service.oracle import DEFAULT_RULESET, select
from service.oracle.observed import predicted_outcome
from service.oracle.releases import RELEASES, add_release_howto
from service.settings import SettingsError

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


def spec(experts: int = 8, platform: str = "h100", activation: str = "silu") -> dict[str, object]:
    return {
        "hf_quantization_config": GPTQ,
        "layer": {
            "num_experts": experts,
            "top_k": 2,
            "hidden_size": 1024,
            "intermediate_size": 512,
            "activation": activation,
        },
        "platform": platform,
    }


def observed(deployment: dict[str, object], ruleset: str = "vllm-0.33") -> ObservedDecision:
    """A decision as vLLM 0.33 takes it (the oracle's answer, which parity proves is vLLM's)."""
    return ObservedDecision(
        layer_name="model.layers.0.mlp.experts",
        layer_count=1,
        deployment_json=json.dumps(deployment),
        outcome=predicted_outcome(select(deployment, ruleset=ruleset)),
    )


def process(host: str = "node-1", version: str = "0.33.0") -> ReportingProcess:
    return ReportingProcess(host=host, pid=7, vllm_version=version)


def counter(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_a_decision_reported_by_two_processes_is_one_deployment_counted_twice() -> None:
    metrics = Metrics()
    store = Observations(metrics)
    decision = observed(spec())
    other_layer = dataclasses.replace(decision, layer_name="model.layers.7.mlp.experts")
    assert store.report(process("node-1"), [decision]) == 1
    assert store.report(process("node-2"), [other_layer]) == 1
    (entry,) = store.listing()
    assert entry.count == 2 and [p.host for p in entry.processes] == ["node-1", "node-2"]
    assert entry.ruleset == "vllm-0.33" and entry.difference is None and not entry.note
    backend = decision.outcome.backend
    assert backend is not None and decision.outcome.integration is not None
    assert (
        counter(
            metrics,
            "moe_control_observed_decisions_total",
            backend=backend,
            integration=decision.outcome.integration,
            ruleset="vllm-0.33",
        )
        == 2
    )


def test_compared_with_another_release_a_difference_is_counted() -> None:
    """vLLM 0.32 decides a gelu_tanh layer on a CPU differently from 0.33."""
    metrics = Metrics()
    store = Observations(metrics, compare_ruleset="0.32")
    decision = observed(spec(platform="cpu", activation="gelu_tanh"))
    store.report(process(), [decision])
    (entry,) = store.listing(mismatches_only=True)
    assert entry.ruleset == "vllm-0.32" and entry.difference is not None
    field = entry.difference.field
    assert (
        counter(
            metrics, "moe_control_prediction_mismatches_total", ruleset="vllm-0.32", field=field
        )
        == 1
    )


def _newer_than_every_ruleset(minor: int = 2) -> str:
    """A release `minor` minor versions past the newest ruleset's range, as a pod reports it."""
    major, base = (int(p) for p in RELEASES[DEFAULT_RULESET].below.split(".")[:2])
    return f"{major}.{base + minor - 1}.0+cu130"


def test_a_newer_release_is_compared_with_the_newest_ruleset_and_marked() -> None:
    metrics = Metrics()
    store = Observations(metrics)
    version = _newer_than_every_ruleset()
    store.report(process(version=version), [observed(spec(), DEFAULT_RULESET)])
    (entry,) = store.listing()
    assert entry.ruleset == DEFAULT_RULESET and not entry.release_modelled
    assert entry.predicted is not None and entry.difference is None  # it decides alike
    assert entry.note.startswith(f"vLLM {version} is not modelled: compared with ")
    assert entry.note.endswith(add_release_howto(version))
    labels = {"ruleset": DEFAULT_RULESET}
    unmodelled = "moe_control_observed_unmodelled_releases_total"
    assert counter(metrics, unmodelled, **labels, outcome="agrees") == 1
    assert counter(metrics, unmodelled, **labels, outcome="differs") == 0


def test_a_newer_release_that_decides_otherwise_is_counted_apart_from_mismatches() -> None:
    """What the new release changed is no ruleset modelled wrongly: the mismatch metric
    (and its alert) stay for releases a ruleset models; the listing shows the difference."""
    metrics = Metrics()
    store = Observations(metrics)
    decision = observed(spec(platform="cpu", activation="gelu_tanh"), DEFAULT_RULESET)
    wrong = dataclasses.replace(
        decision, outcome=dataclasses.replace(decision.outcome, backend="NEW_KERNEL")
    )
    store.report(process(version=_newer_than_every_ruleset(1)), [wrong])
    (entry,) = store.listing(mismatches_only=True)
    assert not entry.release_modelled and entry.difference is not None
    unmodelled = "moe_control_observed_unmodelled_releases_total"
    assert counter(metrics, unmodelled, ruleset=DEFAULT_RULESET, outcome="differs") == 1
    mismatches = "moe_control_prediction_mismatches_total"
    field = entry.difference.field
    assert counter(metrics, mismatches, ruleset=DEFAULT_RULESET, field=field) == 0


def test_a_release_of_a_modelled_range_is_not_marked() -> None:
    metrics = Metrics()
    store = Observations(metrics)
    release = RELEASES[DEFAULT_RULESET]
    store.report(process(version=f"{release.series}.9+cu129"), [observed(spec(), DEFAULT_RULESET)])
    (entry,) = store.listing()
    assert entry.release_modelled and entry.ruleset == DEFAULT_RULESET and not entry.note
    unmodelled = "moe_control_observed_unmodelled_releases_total"
    assert counter(metrics, unmodelled, ruleset=DEFAULT_RULESET, outcome="agrees") == 0


@pytest.mark.parametrize("version", ["0.1.0", "", "nightly"])
def test_a_release_no_ruleset_is_as_old_as_is_kept_uncompared_and_counted(version: str) -> None:
    metrics = Metrics()
    store = Observations(metrics)
    store.report(process(version=version), [observed(spec())])
    (entry,) = store.listing()
    assert entry.ruleset == "" and not entry.release_modelled
    assert entry.note == f"vLLM {version or '(unknown)'} is not modelled: no ruleset is as old"
    assert entry.predicted is None and entry.difference is None
    assert store.listing(mismatches_only=True) == []
    unmodelled = "moe_control_observed_unmodelled_releases_total"
    assert counter(metrics, unmodelled, ruleset="none", outcome="not_compared") == 1


def test_compared_with_a_ruleset_chosen_a_newer_release_stays_marked() -> None:
    store = Observations(Metrics(), compare_ruleset=next(iter(RELEASES)))
    store.report(process(version=_newer_than_every_ruleset()), [observed(spec())])
    (entry,) = store.listing()
    assert entry.ruleset == next(iter(RELEASES)) and not entry.release_modelled


def test_the_mark_is_recomputed_on_load(tmp_path: Path) -> None:
    """Only what was reported is kept: the server that loads decides what it models."""
    store = Observations(Metrics(), state_dir=tmp_path)
    store.report(process(version=_newer_than_every_ruleset()), [observed(spec())])
    saved = json.loads((tmp_path / STORE_FILE).read_text())
    assert "release_modelled" not in saved["entries"][0]
    (entry,) = Observations(Metrics(), state_dir=tmp_path).listing()
    assert not entry.release_modelled and entry.ruleset == DEFAULT_RULESET


def test_a_deployment_the_server_cannot_decide_is_noted() -> None:
    store = Observations(Metrics())
    decision = dataclasses.replace(observed(spec()), deployment_json='{"layer": {}}')
    store.report(process(), [decision])
    (entry,) = store.listing()
    assert entry.note.startswith("the server cannot decide this deployment")


def test_the_store_is_bounded_dropping_the_least_recently_reported() -> None:
    store = Observations(Metrics(), max_deployments=2)
    first, second, third = (observed(spec(experts=n)) for n in (8, 16, 32))
    store.report(process(), [first, second])
    store.report(process(), [first])  # first is now the most recent
    store.report(process(), [third])
    kept = [json.loads(e.observed.deployment_json)["layer"]["num_experts"] for e in store.listing()]
    assert kept == [32, 8] and store.evicted == 1


def test_the_state_dir_keeps_reports_across_restarts(tmp_path: Path) -> None:
    store = Observations(Metrics(), state_dir=tmp_path)
    store.report(process(), [observed(spec())])
    store.report(process("node-2"), [observed(spec())])
    assert sorted(p.name for p in tmp_path.iterdir()) == [STORE_FILE]  # no temporary left
    again = Observations(Metrics(), state_dir=tmp_path, compare_ruleset="vllm-0.32")
    (entry,) = again.listing()
    assert entry.count == 2 and entry.ruleset == "vllm-0.32"  # compared again on load
    assert [p.host for p in entry.processes] == ["node-1", "node-2"]


def test_a_damaged_state_file_costs_the_history_not_the_start(tmp_path: Path) -> None:
    (tmp_path / STORE_FILE).write_text('{"version": 1, "entries": [{"key": 3}]}')
    assert Observations(Metrics(), state_dir=tmp_path).listing() == []


def test_an_unknown_compare_ruleset_is_a_settings_error() -> None:
    with pytest.raises(SettingsError, match="observed_ruleset"):
        Observations(Metrics(), compare_ruleset="vllm-9.9")
