"""The Grafana dashboard and its provisioning files, statically.

Every metric the dashboard queries must exist among the collectors of service/metrics.py
(read from the collectors themselves), with the labels it groups or filters by; the panels
the operations issue asks for must be there; every panel uses `${datasource}` and has a unit.
"""

from __future__ import annotations

import pytest

from tests.deploy.checks import (
    PROVISIONING,
    ROOT,
    dashboard_paths,
    dashboard_problems,
    dashboard_queries,
    family,
    load_dashboard,
    load_yaml_documents,
    panels,
    query_metric_names,
    service_metrics,
)
from tests.deploy.promql import metric_names

DASHBOARD = "moe-control.json"

#: Panels a platform team looks for, and a metric each must query.
REQUIRED_PANELS = {
    "Selections by backend": "moe_control_backend_selections_total",
    "Rejections by backend and reason": "moe_control_backend_rejections_total",
    "Conversion throughput": "moe_control_convert_bytes_total",
    "RunMoE latency by backend (p50, p90, p99)": "moe_control_run_moe_duration_seconds_bucket",
    "Error ratio by method and code": "grpc_server_handled_total",
    "Worker readiness": "moe_control_worker_ready",
    "Restarts": "moe_control_worker_restarts_total",
}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, object]:
    return load_dashboard(next(p for p in dashboard_paths() if p.name == DASHBOARD))


def test_dashboards_pass_every_static_check() -> None:
    assert dashboard_paths(), "no dashboard under deploy/grafana/dashboards"
    for path in dashboard_paths():
        assert dashboard_problems(path) == []


def test_every_metric_the_dashboard_uses_exists_in_service_metrics(
    dashboard: dict[str, object],
) -> None:
    known = set(service_metrics()) | {"up"}
    used = {name for _, expr in dashboard_queries(dashboard) for name in query_metric_names(expr)}
    assert used <= known, sorted(used - known)
    # And it shows every domain metric family the service has.
    domain = {family(name) for name in known if name.startswith("moe_control_")}
    assert domain - {family(name) for name in used} == set()


def test_required_panels_query_their_metrics(dashboard: dict[str, object]) -> None:
    by_title = {panel["title"]: panel for panel in panels(dashboard)}
    for title, metric in REQUIRED_PANELS.items():
        assert title in by_title, f"no panel {title!r}"
        exprs = [target["expr"] for target in by_title[title]["targets"]]
        assert any(metric in metric_names(expr) for expr in exprs), (title, exprs)
    quantiles = {
        expr.split("(", 2)[1].split(",")[0]
        for target in by_title["RunMoE latency by backend (p50, p90, p99)"]["targets"]
        for expr in [target["expr"]]
    }
    assert quantiles == {"0.5", "0.9", "0.99"}


def test_rates_use_the_rate_interval(dashboard: dict[str, object]) -> None:
    for where, expr in dashboard_queries(dashboard):
        for window in expr.split("[")[1:]:
            assert window.split("]")[0] in {"$__rate_interval", "$__range"}, (where, expr)


def test_provisioning_points_at_the_dashboards_folder() -> None:
    (providers,) = load_yaml_documents(PROVISIONING / "dashboards" / "moe-control.yaml")
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards/moe-control"
    (sources,) = load_yaml_documents(PROVISIONING / "datasources" / "prometheus.yaml")
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus"
    assert source["jsonData"]["timeInterval"] == "5s"


def test_the_readme_metrics_reference_lists_every_metric() -> None:
    readme = (ROOT / "docs" / "metrics.md").read_text()
    section = readme.split("## Metrics reference", 1)[1].split("\n## ", 1)[0]
    families = {
        family(name) for name in service_metrics() if not name.startswith(("process_", "python_"))
    }
    documented = {family(name) for name in section.split("`") if name.islower()}
    assert families - documented == set()
