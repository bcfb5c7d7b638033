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
from service.oracle import select
from service.oracle.observed import predicted_outcome
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


def test_a_release_without_a_ruleset_is_kept_with_that_noted() -> None:
    metrics = Metrics()
    store = Observations(metrics)
    store.report(process(version="0.99.1+cu130"), [observed(spec())])
    (entry,) = store.listing()
    assert entry.ruleset == "" and "0.99.1+cu130 has no ruleset yet" in entry.note
    assert entry.predicted is None and entry.difference is None
    assert store.listing(mismatches_only=True) == []


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
