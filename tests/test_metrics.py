"""The collectors of service/metrics.py: every series whose label values are known at start
is exported at zero, with HELP and TYPE, in a single process and in multiprocess mode, each
label list taken from its one source."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from service.kernels.registry import RUNNABLE
from service.metrics import (
    EXPLICIT_PLATFORM,
    NO_BACKEND,
    WORKER_PLATFORM,
    Metrics,
    platform_label,
)
from service.oracle import DEFAULT_RULESET, PLATFORM_PRESETS, RULESETS
from service.oracle.errors import STAGES, VLLM_EXCEPTIONS
from service.oracle.observed import COMPARED_FIELDS
from service.oracle.quantization import INTEGRATIONS

ROOT = Path(__file__).resolve().parents[1]


def samples(exposition: str) -> dict[str, dict[frozenset[tuple[str, str]], float]]:
    """Sample name -> {label set: value}, parsed from the text format."""
    found: dict[str, dict[frozenset[tuple[str, str]], float]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            found.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
    return found


def expected_at_start() -> dict[str, set[frozenset[tuple[str, str]]]]:
    """The zero series a fresh `Metrics` exports, from the oracle's declarations."""
    selections = {
        frozenset(
            {
                ("backend", backend),
                ("integration", integration),
                ("platform", WORKER_PLATFORM),
                ("ruleset", ruleset.name),
            }
        )
        for ruleset in RULESETS.values()
        for backend in (*ruleset.backends, NO_BACKEND)
        for integration in INTEGRATIONS
    }
    rejections = {
        frozenset({("backend", backend), ("reason", reason)})
        for ruleset in RULESETS.values()
        for backend in ruleset.backends
        for reason in ruleset.reason_codes
    }
    failures = {
        frozenset({("stage", stage), ("error", error)})
        for stage in STAGES
        for error in VLLM_EXCEPTIONS
    }
    observed = {
        frozenset({("backend", backend), ("integration", integration), ("ruleset", ruleset.name)})
        for ruleset in RULESETS.values()
        for backend in (*ruleset.backends, NO_BACKEND)
        for integration in INTEGRATIONS
    }
    mismatches = {
        frozenset({("ruleset", ruleset.name), ("field", name)})
        for ruleset in RULESETS.values()
        for name in COMPARED_FIELDS
    }
    return {
        "moe_control_backend_selections_total": selections,
        "moe_control_backend_rejections_total": rejections,
        "moe_control_decision_failures_total": failures,
        "moe_control_observed_decisions_total": observed,
        "moe_control_prediction_mismatches_total": mismatches,
    }


def assert_at_zero(exposition: str) -> None:
    found = samples(exposition)
    for name, label_sets in expected_at_start().items():
        family = name.removesuffix("_total")
        assert f"# HELP {name} " in exposition and f"# TYPE {name} counter" in exposition, name
        assert set(found.get(name, {})) == label_sets, family
        assert not any(found[name].values()), f"{name} not at zero"


def test_a_fresh_registry_exports_every_known_decision_series_at_zero() -> None:
    assert_at_zero(Metrics().exposition().decode())
    ruleset = RULESETS[DEFAULT_RULESET]
    assert "EXPERT_BIAS" in ruleset.reason_codes and "DEVICE" in ruleset.reason_codes


def test_worker_and_kernel_series_exist_once_prepared() -> None:
    metrics = Metrics()
    metrics.prepare_workers([(0, "cpu"), (1, "cuda:0")])
    metrics.prepare_kernels(RUNNABLE)
    found = samples(metrics.exposition().decode())
    restarts = found["moe_control_worker_restarts_total"]
    assert restarts == {
        frozenset({("worker", "0"), ("device", "cpu")}): 0.0,
        frozenset({("worker", "1"), ("device", "cuda:0")}): 0.0,
    }
    assert set(found["moe_control_worker_ready"].values()) == {0.0}
    tokens = found["moe_control_run_moe_tokens_total"]
    assert {dict(labels)["backend"] for labels in tokens} == set(RUNNABLE)
    converted = found["moe_control_convert_bytes_total"]
    assert {tuple(sorted(dict(labels).values())) for labels in converted} == {
        tuple(sorted((backend, direction))) for backend in RUNNABLE for direction in ("in", "out")
    }
    assert {
        dict(labels)["target_format"]
        for labels in found["moe_control_convert_duration_seconds_count"]
    } == set(RUNNABLE)


def test_the_platform_label_is_a_presets_name_explicit_or_worker() -> None:
    assert platform_label(None) == WORKER_PLATFORM
    assert platform_label("H100") == "h100"
    assert platform_label("5090") == "rtx5090"  # an alias: the preset's own name
    assert platform_label({"preset": "a100"}) == "a100"
    assert platform_label({"preset": "a100", "env": {"VLLM_X": "1"}}) == EXPLICIT_PLATFORM
    assert platform_label(PLATFORM_PRESETS["l4"].to_json()) == EXPLICIT_PLATFORM


_CHILD = """
import sys
from service.metrics import Metrics, enable_multiprocess
enable_multiprocess(sys.argv[1])
writer = Metrics()                                  # a process that serves calls
reader = Metrics(multiprocess_dir=sys.argv[1])      # the primary's /metrics
sys.stdout.write(reader.exposition().decode())
"""


def test_multiprocess_mode_exports_the_same_zero_series(tmp_path: Path) -> None:
    # In a child process: multiprocess mode switches prometheus_client's value class for
    # the whole process.
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert_at_zero(result.stdout)
    assert any(tmp_path.glob("counter_*.db"))  # the writer's values, in its own file
