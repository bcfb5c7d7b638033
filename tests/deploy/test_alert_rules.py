"""The alert rules: promtool accepts them and the Prometheus config, each alert fires on the
synthetic series of alerts.test.yml (and only there), and the Kubernetes PrometheusRule
carries exactly the same groups."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy.checks import (
    ALERTS,
    PROMETHEUS_CONFIG,
    alert_problems,
    alert_rules,
    load_yaml_documents,
    objects_by_kind,
)

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is not installed (it comes with Debian's prometheus package; .ci/run "
    "installs it)",
)
HERE = Path(__file__).parent


def _promtool(*args: str, cwd: Path | None = None) -> str:
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=cwd, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_every_alert_names_known_metrics_and_labels() -> None:
    assert alert_problems() == []


def test_alerts_have_severity_and_annotations() -> None:
    for rule in alert_rules():
        assert rule["alert"].startswith("MoeControl"), rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert {"summary", "description"} <= set(rule["annotations"])


@needs_promtool
def test_promtool_accepts_rules_and_config() -> None:
    assert f"SUCCESS: {len(alert_rules())} rules found" in _promtool("check", "rules", str(ALERTS))
    _promtool("check", "config", str(PROMETHEUS_CONFIG))


@needs_promtool
def test_each_alert_fires_on_its_synthetic_series(tmp_path: Path) -> None:
    shutil.copy(ALERTS, tmp_path / "alerts.yml")
    shutil.copy(HERE / "alerts.test.yml", tmp_path / "alerts.test.yml")
    assert "SUCCESS" in _promtool("test", "rules", "alerts.test.yml", cwd=tmp_path)
    # Every alert has a case in which it fires.
    (cases,) = load_yaml_documents(HERE / "alerts.test.yml")
    fired = {
        test["alertname"]
        for case in cases["tests"]
        for test in case["alert_rule_test"]
        if test["exp_alerts"]
    }
    assert fired == {rule["alert"] for rule in alert_rules()}


def test_prometheus_rule_resource_matches_the_rule_file() -> None:
    (resource,) = objects_by_kind("PrometheusRule")
    (rule_file,) = load_yaml_documents(ALERTS)
    assert resource.body["spec"]["groups"] == rule_file["groups"]
