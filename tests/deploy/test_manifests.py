"""The Kubernetes manifests: schema-valid, and wired the way the server needs.

Schema validation (strict, Kubernetes 1.27 and the newest known) is `checks.manifest_problems`,
which `make lint` runs too; the tests below check what no schema can: that probes ask the
health services the server really serves, that selectors meet their pods, that the
ConfigMap holds only settings the server knows (and values it accepts), that GPUs are
requested the way the device plugin needs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from service.cli.health import SERVICE as READINESS_SERVICE
from service.settings import Settings
from tests.deploy.checks import (
    KUBERNETES,
    Document,
    kubernetes_documents,
    load_yaml_documents,
    manifest_problems,
    objects_by_kind,
)


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        doc.body
        for doc in objects_by_kind(kind)
        if name is None or doc.body["metadata"]["name"] == name
    ]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (main,) = pod_spec(workload)["containers"]
    return main


def test_every_manifest_is_schema_valid() -> None:
    assert manifest_problems() == []


def test_the_kustomization_lists_every_serving_manifest() -> None:
    (kustomization,) = load_yaml_documents(KUBERNETES / "kustomization.yaml")
    files = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    examples = {name for name in files if ".example." in name}
    assert set(kustomization["resources"]) == files - examples


def test_probes_ask_the_health_services_the_server_serves() -> None:
    main = container(one("Deployment", "moe-control"))
    port = next(p["containerPort"] for p in main["ports"] if p["name"] == "grpc")
    for probe in ("startupProbe", "livenessProbe"):
        assert main[probe]["grpc"] == {"port": port, "service": ""}
    assert main["readinessProbe"]["grpc"] == {"port": port, "service": READINESS_SERVICE}


def test_one_gpu_per_pod_with_limits() -> None:
    main = container(one("Deployment", "moe-control"))
    resources = main["resources"]
    # Extended resources: the request must equal the limit; one worker runs per GPU.
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 1
    assert {"memory", "ephemeral-storage"} <= set(resources["limits"])
    assert {"cpu", "memory"} <= set(resources["requests"])
    tolerations = pod_spec(one("Deployment", "moe-control"))["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations


def test_runs_unprivileged() -> None:
    deployment = one("Deployment", "moe-control")
    pod = pod_spec(deployment)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False
    security = container(deployment)["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"]["drop"] == ["ALL"]
    # A read-only root needs writable scratch for /tmp, the JIT caches and shared memory.
    mounts = {m["mountPath"] for m in container(deployment)["volumeMounts"]}
    assert {"/tmp", "/home/moe/.cache", "/dev/shm"} <= mounts


def test_selectors_meet_their_pods_and_ports() -> None:
    deployment = one("Deployment", "moe-control")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    service = one("Service", "moe-control")
    monitor = one("ServiceMonitor", "moe-control")
    budget = one("PodDisruptionBudget", "moe-control")
    for selector in (
        deployment["spec"]["selector"]["matchLabels"],
        service["spec"]["selector"],
        budget["spec"]["selector"]["matchLabels"],
    ):
        assert selector.items() <= pod_labels.items()
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    container_ports = {p["name"] for p in container(deployment)["ports"]}
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= container_ports
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= service_ports
    # The alert rules and the dashboard expect job="moe-control": the Service's name.
    assert service["metadata"]["name"] == "moe-control"
    assert deployment["spec"]["replicas"] > budget["spec"]["maxUnavailable"]


def test_configmap_holds_only_settings_the_server_accepts() -> None:
    data = one("ConfigMap", "moe-control-config")["data"]
    known = {Settings.env_name(f.name) for f in dataclasses.fields(Settings)}
    assert set(data) <= known, sorted(set(data) - known)
    settings = Settings.load({}, data)
    # Ports agree with the container and the probes; shutdown fits the grace period.
    main = container(one("Deployment", "moe-control"))
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert (settings.port, settings.metrics_port) == (ports["grpc"], ports["metrics"])
    assert settings.host == settings.metrics_host == "0.0.0.0"
    grace = pod_spec(one("Deployment", "moe-control"))["terminationGracePeriodSeconds"]
    assert settings.grace_s < grace


def test_secrets_are_referenced_not_inlined() -> None:
    deployment = one("Deployment", "moe-control")
    volumes = {v["name"]: v for v in pod_spec(deployment)["volumes"]}
    assert volumes["auth"]["secret"]["secretName"] == "moe-control-auth"
    assert volumes["tls"]["secret"] == {
        "secretName": "moe-control-tls",
        "optional": True,
        "defaultMode": 0o440,
    }
    data = one("ConfigMap", "moe-control-config")["data"]
    mount = next(m for m in container(deployment)["volumeMounts"] if m["name"] == "auth")
    assert data["MOE_CONTROL_AUTH_TOKEN_FILE"].startswith(mount["mountPath"] + "/")
    assert not any("TOKEN" in key and "FILE" not in key for key in data)
    served = {
        doc.path.name
        for doc in kubernetes_documents()
        if doc.body["kind"] == "Secret" and ".example." not in doc.path.name
    }
    assert served == set(), "real Secrets must not be checked in"


@pytest.mark.parametrize("doc", list(kubernetes_documents()), ids=lambda d: d.name)
def test_every_object_is_labelled(doc: Document) -> None:
    assert doc.body["metadata"]["labels"]["app.kubernetes.io/name"] == "moe-control"
