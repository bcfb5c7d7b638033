"""Static checks of everything under deploy/: Kubernetes schemas, alert rules, the dashboard.

`make lint` runs this module (`python -m tests.deploy.checks`); the tests in this folder
call the same functions, so a manifest that lint rejects fails `make test` with the same
message. Nothing here needs a cluster, Docker or a network:

* Kubernetes objects are validated (strict: unknown fields are errors) against the OpenAPI
  JSON schemas that the `kubernetes-validate` package ships, for the oldest Kubernetes the
  manifests support (1.27, the first with GA gRPC probes) and the newest it knows.
* The Prometheus Operator's ServiceMonitor and PrometheusRule are custom resources, which
  those schemas lack: `CRD_SCHEMAS` holds strict schemas for the fields of
  monitoring.coreos.com/v1 that we use or that are commonly set, written from the CRDs.
* The Grafana dashboard: every panel and variable uses the `${datasource}` variable, every
  panel has a unit, ids are unique, and every metric and label an expression names exists
  on a collector of `service/metrics.py` (or is one Prometheus adds itself, like `up`).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.promql import metric_names, substitute

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARDS = DEPLOY / "grafana" / "dashboards"
PROVISIONING = DEPLOY / "grafana" / "provisioning"

#: Kubernetes versions the manifests must validate against: native gRPC probes are GA from
#: 1.27; the newest is whatever kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.27", "latest")

#: Series Prometheus makes itself for every target.
PROMETHEUS_SERIES = frozenset(
    {
        "up",
        "scrape_duration_seconds",
        "scrape_samples_scraped",
        "scrape_samples_post_metric_relabeling",
        "scrape_series_added",
        "ALERTS",
        "ALERTS_FOR_STATE",
    }
)
#: Labels Prometheus adds (target labels) or that belong to a sample type, not a collector.
PROMETHEUS_LABELS = frozenset({"job", "instance", "le", "quantile", "__name__"})

#: The CRDs' Duration pattern.
_DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": _STRING_MAP,
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
        "namespace": {"type": "string"},
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
    },
}
_RELABELINGS = {"type": "array", "items": {"type": "object"}}
_ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "port": {"type": "string"},
        "targetPort": {"type": ["string", "integer"]},
        "path": {"type": "string"},
        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
        "params": {"type": "object"},
        "interval": {"type": "string", "pattern": _DURATION},
        "scrapeTimeout": {"type": "string", "pattern": _DURATION},
        "honorLabels": {"type": "boolean"},
        "honorTimestamps": {"type": "boolean"},
        "trackTimestampsStaleness": {"type": "boolean"},
        "relabelings": _RELABELINGS,
        "metricRelabelings": _RELABELINGS,
        "tlsConfig": {"type": "object"},
        "authorization": {"type": "object"},
        "bearerTokenSecret": {"type": "object"},
        "basicAuth": {"type": "object"},
        "oauth2": {"type": "object"},
        "followRedirects": {"type": "boolean"},
        "enableHttp2": {"type": "boolean"},
        "filterRunning": {"type": "boolean"},
        "proxyUrl": {"type": "string"},
    },
    "oneOf": [{"required": ["port"]}, {"required": ["targetPort"]}],
}
_RULE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["expr"],
    "properties": {
        "alert": {"type": "string"},
        "record": {"type": "string"},
        "expr": {"type": ["string", "integer"]},
        "for": {"type": "string", "pattern": _DURATION},
        "keep_firing_for": {"type": "string", "pattern": _DURATION},
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
    },
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
}
#: Strict schemas of the Prometheus Operator resources (monitoring.coreos.com/v1).
CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "ServiceMonitor"},
            "metadata": _METADATA,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["selector"],
                "properties": {
                    "selector": _LABEL_SELECTOR,
                    "namespaceSelector": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "any": {"type": "boolean"},
                            "matchNames": {"type": "array", "items": {"type": "string"}},
                        },
                    },
                    "endpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT},
                    "jobLabel": {"type": "string"},
                    "targetLabels": {"type": "array", "items": {"type": "string"}},
                    "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                    "sampleLimit": {"type": "integer", "minimum": 0},
                    "targetLimit": {"type": "integer", "minimum": 0},
                    "attachMetadata": {"type": "object"},
                    "scrapeProtocols": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
    ("monitoring.coreos.com/v1", "PrometheusRule"): {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "PrometheusRule"},
            "metadata": _METADATA,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "groups": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["name"],
                            "properties": {
                                "name": {"type": "string", "minLength": 1},
                                "interval": {"type": "string", "pattern": _DURATION},
                                "query_offset": {"type": "string", "pattern": _DURATION},
                                "limit": {"type": "integer"},
                                "labels": _STRING_MAP,
                                "partial_response_strategy": {"type": "string"},
                                "rules": {"type": "array", "items": _RULE},
                            },
                        },
                    }
                },
            },
        },
    },
}

#: Kustomize's own files are not Kubernetes objects.
_NOT_OBJECTS = frozenset({"kustomization.yaml"})


@dataclass(frozen=True)
class Document:
    path: Path
    index: int
    body: dict[str, Any]

    @property
    def name(self) -> str:
        rel = self.path.relative_to(ROOT)
        name = self.body.get("metadata", {}).get("name")
        return f"{rel}#{self.index} {self.body.get('kind')}/{name}"


def load_yaml_documents(path: Path) -> list[dict[str, Any]]:
    with path.open() as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc]


def kubernetes_documents() -> Iterator[Document]:
    """Every Kubernetes object under deploy/kubernetes (examples included)."""
    for path in sorted(KUBERNETES.rglob("*.yaml")):
        if path.name in _NOT_OBJECTS:
            continue
        for index, body in enumerate(load_yaml_documents(path)):
            yield Document(path, index, body)


def objects_by_kind(kind: str) -> list[Document]:
    return [doc for doc in kubernetes_documents() if doc.body.get("kind") == kind]


def _schema_problems(doc: Document, versions: tuple[str, ...]) -> list[str]:
    import jsonschema
    import kubernetes_validate

    key = (doc.body.get("apiVersion", ""), doc.body.get("kind", ""))
    if key in CRD_SCHEMAS:
        validator = jsonschema.Draft202012Validator(CRD_SCHEMAS[key])
        return [
            f"{doc.name}: {'.'.join(map(str, error.path)) or '<root>'}: {error.message}"
            for error in validator.iter_errors(doc.body)
        ]
    problems = []
    for version in versions:
        wanted = kubernetes_validate.latest_version() if version == "latest" else version
        try:
            kubernetes_validate.validate(doc.body, wanted, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(p) for p in error.path)
            problems.append(f"{doc.name} (Kubernetes {error.version}): {path}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            problems.append(f"{doc.name}: {error.message}")
    return problems


def kustomization_problems() -> list[str]:
    problems = []
    for path in sorted(KUBERNETES.rglob("kustomization.yaml")):
        (body,) = load_yaml_documents(path)
        for resource in body.get("resources", []):
            if not (path.parent / resource).is_file():
                problems.append(f"{path.relative_to(ROOT)}: resource {resource} does not exist")
    return problems


def manifest_problems(versions: tuple[str, ...] = KUBERNETES_VERSIONS) -> list[str]:
    problems = kustomization_problems()
    for doc in kubernetes_documents():
        problems.extend(_schema_problems(doc, versions))
    return problems


# -- metrics ------------------------------------------------------------------------------

_SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
}


def service_metrics() -> dict[str, frozenset[str]]:
    """Every sample name the server can expose, with the label names it carries.

    Read from the collectors of `service.metrics.Metrics` themselves: the families a fresh
    registry lists (labelled ones have no samples until first used, so the sample names come
    from each family's type) and, for the labelled ones, their declared label names."""
    from prometheus_client.metrics import MetricWrapperBase

    from service.metrics import Metrics

    metrics = Metrics()
    labels_of: dict[str, frozenset[str]] = {}
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            labels_of[value._name] = frozenset(value._labelnames)
    names: dict[str, frozenset[str]] = {}
    for family in metrics.registry.collect():
        labels = labels_of.get(family.name, frozenset())
        labels |= {key for sample in family.samples for key in sample.labels}
        for suffix in _SAMPLE_SUFFIXES[family.type]:
            names[family.name + suffix] = labels
    return names


_MATCHER_LABELS = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
_CLAUSE_LABELS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)\s*$", re.S)


def label_names(expr: str) -> set[str]:
    """Label names used in matchers and aggregation/matching clauses of `expr`."""
    expr = substitute(expr)
    names = set()
    for matchers in re.findall(r"\{([^{}]*)\}", expr):
        names.update(_MATCHER_LABELS.findall(matchers))
    for clause in _CLAUSE_LABELS.findall(expr):
        names.update(part.strip() for part in clause.split(",") if part.strip())
    return names


def query_metric_names(expr: str) -> set[str]:
    """Metric names of a PromQL expression or of a Grafana `label_values(selector, label)`."""
    match = _LABEL_VALUES.match(expr)
    return metric_names(match.group(1) if match else expr)


_FAMILY_SUFFIXES = re.compile(r"(_total|_bucket|_count|_sum|_created)$")


def family(sample_name: str) -> str:
    """The metric family of a sample name (`x_seconds_bucket` -> `x_seconds`)."""
    return _FAMILY_SUFFIXES.sub("", sample_name)


def expression_problems(where: str, expr: str, known: dict[str, frozenset[str]]) -> list[str]:
    """Unknown metric or label names in one PromQL expression (or Grafana label_values)."""
    extra_labels: set[str] = set()
    match = _LABEL_VALUES.match(expr)
    if match:
        expr, label = match.group(1), match.group(2)
        extra_labels.add(label)
    metrics = metric_names(expr)
    problems = [
        f"{where}: metric {name!r} is not exposed by service/metrics.py"
        for name in sorted(metrics)
        if name not in known and name not in PROMETHEUS_SERIES
    ]
    if not metrics:
        problems.append(f"{where}: no metric in {expr!r}")
    allowed = set(PROMETHEUS_LABELS)
    for name in metrics:
        allowed |= known.get(name, frozenset())
    if metrics & {"ALERTS", "ALERTS_FOR_STATE"}:
        allowed |= {"alertname", "alertstate"}
    for label in sorted((label_names(expr) | extra_labels) - allowed):
        problems.append(f"{where}: label {label!r} is not on {sorted(metrics)}")
    return problems


# -- dashboard ----------------------------------------------------------------------------


def dashboard_paths() -> list[Path]:
    return sorted(DASHBOARDS.glob("*.json"))


def load_dashboard(path: Path) -> dict[str, Any]:
    with path.open() as handle:
        body: dict[str, Any] = json.load(handle)
    return body


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included, rows themselves excluded."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def dashboard_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and query variable."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} target {target['refId']}", target["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable["query"]
            text = query["query"] if isinstance(query, dict) else query
            yield f"variable {variable['name']!r}", text


def dashboard_problems(path: Path) -> list[str]:
    where = path.relative_to(ROOT)
    try:
        dashboard = load_dashboard(path)
    except (OSError, ValueError) as error:
        return [f"{where}: {error}"]
    problems = []
    if "__inputs" in dashboard or "__requires" in dashboard:
        problems.append(f"{where}: an export with __inputs; use the ${{datasource}} variable")
    variables = {v["name"]: v for v in dashboard.get("templating", {}).get("list", [])}
    source = variables.get("datasource")
    if source is None or source.get("type") != "datasource" or source.get("query") != "prometheus":
        problems.append(f"{where}: no datasource variable of type prometheus named 'datasource'")
    for name, variable in variables.items():
        if variable.get("type") == "query" and variable.get("datasource", {}).get("uid") != (
            "${datasource}"
        ):
            problems.append(f"{where}: variable {name!r} does not use ${{datasource}}")
    ids = [p.get("id") for p in dashboard.get("panels", [])] + [
        p.get("id") for row in dashboard.get("panels", []) for p in row.get("panels", [])
    ]
    if len(ids) != len(set(ids)) or None in ids:
        problems.append(f"{where}: panel ids are missing or not unique")
    known = service_metrics()
    for panel in panels(dashboard):
        title = panel.get("title", "?")
        datasources = [panel.get("datasource")] + [t.get("datasource") for t in panel["targets"]]
        if any((ds or {}).get("uid") != "${datasource}" for ds in datasources):
            problems.append(f"{where}: panel {title!r} does not use ${{datasource}} everywhere")
        if not panel.get("fieldConfig", {}).get("defaults", {}).get("unit"):
            problems.append(f"{where}: panel {title!r} has no unit")
        if not panel.get("description"):
            problems.append(f"{where}: panel {title!r} has no description")
        if not panel.get("targets"):
            problems.append(f"{where}: panel {title!r} has no query")
    for query_where, expr in dashboard_queries(dashboard):
        problems.extend(expression_problems(f"{where}: {query_where}", expr, known))
    return problems


def alert_rules() -> list[dict[str, Any]]:
    (body,) = load_yaml_documents(ALERTS)
    return [rule for group in body["groups"] for rule in group["rules"]]


def alert_problems() -> list[str]:
    known = service_metrics()
    problems = []
    for rule in alert_rules():
        name = rule.get("alert") or rule.get("record")
        problems.extend(expression_problems(f"{ALERTS.name}: {name}", str(rule["expr"]), known))
    return problems


def all_problems() -> list[str]:
    problems = manifest_problems() + alert_problems()
    for path in dashboard_paths():
        problems.extend(dashboard_problems(path))
    return problems


def main() -> int:
    problems = all_problems()
    for problem in problems:
        print(problem, file=sys.stderr)
    count = len(list(kubernetes_documents()))
    print(
        f"deploy/: {count} Kubernetes objects, {len(alert_rules())} alert rules and "
        f"{len(dashboard_paths())} dashboard(s) checked; {len(problems)} problem(s)"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
