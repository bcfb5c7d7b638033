"""A real Prometheus scrapes a real server; every dashboard and alert expression is evaluated.

Debian's `prometheus` package provides the binary (`.ci/run` installs it). The test starts
`moe-control serve` (as tests/integration does) and Prometheus, both on loopback ports, with
a 0.5 s scrape and rule-evaluation interval and deploy/prometheus/alerts.yml loaded as is.
Before any call (health checks aside), every PromQL expression of the dashboard returns data:
the server exports every series whose label values are known at start at zero. It then
drives SelectBackend traffic of every kind the alerts care about (answers, failed
selections, bad requests, and UNAVAILABLE while the worker is killed and restarted), waits
until Prometheus has scraped the final counters, and asks Prometheus' HTTP API:

* every PromQL expression of the dashboard still returns data (two path-mode conversions of
  a small synthetic checkpoint fill the conversion panels with values);
* every alert rule is healthy and in the state the traffic calls for: the error-ratio and
  no-eligible-backend alerts pending, the prediction-mismatch alert firing (one report the
  server answers differently), the unmodelled-release alert firing (one report from a
  release newer than every ruleset), the worker alerts inactive, and, once the server is
  stopped, the target-down alert pending.

Prometheus counts a counter's increase only between two of its samples (a series born at
10 shows no rate), so each kind of call is made once and scraped before the bulk of it.
Everything stops by itself: bounded request loops, deadlines on every wait.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from integration.serverproc import SERVICE, ServerProcess, health_status, launch, wait_ready

from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc
from service.api.generated.moe_control.v1 import observed_pb2
from service.client.convert import Connection, convert_checkpoint_remote, header_for
from service.oracle.releases import DEFAULT_RULESET, RELEASES
from tests.deploy.checks import (
    ALERTS,
    alert_rules,
    dashboard_paths,
    dashboard_queries,
    load_dashboard,
)
from tests.deploy.promql import metric_names, substitute

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        PROMETHEUS is None,
        reason="the prometheus binary is not installed (Debian: apt-get install -y prometheus; "
        ".ci/run installs it)",
    ),
]

JOB = "moe-control"
INTERVAL = "500ms"
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
LAYER = {"num_experts": 60, "top_k": 4, "hidden_size": 2048, "intermediate_size": 1408}


def _spec(quant: dict[str, Any], platform: str | None, **extra: Any) -> pb.SelectBackendRequest:
    body = {"hf_quantization_config": quant, "layer": LAYER, "platform": platform, **extra}
    return pb.SelectBackendRequest(spec_json=json.dumps(body))


#: Each kind of SelectBackend call and the status it must get.
ANSWERS = [_spec(GPTQ, "a100"), _spec(AWQ, "h100"), _spec(GPTQ, "h200"), _spec(GPTQ, "l4")]
NO_ELIGIBLE = _spec(GPTQ, "h100", moe_backend="flashinfer_trtllm")  # FAILED_PRECONDITION
BAD = _spec(GPTQ, "no-such-gpu")  # INVALID_ARGUMENT
NEEDS_WORKER = _spec(GPTQ, None)  # UNAVAILABLE while the only worker is down

#: The state of each alert after the traffic below, while the server still runs.
EXPECTED_WHILE_SERVING = {
    "MoeControlTargetDown": "inactive",
    "MoeControlWorkerNotReady": "inactive",  # the worker is back before the check
    "MoeControlWorkerRestarting": "inactive",  # one restart; it takes three
    # Of the 65 SelectBackend calls counted after the first scrape: 10 UNAVAILABLE (15%,
    # over 5%); of the 50 decisions, 30 fail in backend selection (60%, over 25%), wide
    # enough margins for the extrapolation rate() applies.
    "MoeControlHighErrorRatio": "pending",
    "MoeControlNoEligibleBackendSpike": "pending",
    # One report the server answers differently (it has no `for`).
    "MoeControlPredictionMismatch": "firing",
    # One report from a release newer than every ruleset (no `for` either).
    "MoeControlUnmodelledRelease": "firing",
}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Prometheus:
    """A Prometheus server on a loopback port, scraping one target, with our alert rules."""

    def __init__(self, workdir: Path, target: str) -> None:
        rules = workdir / "alerts.yml"
        shutil.copy(ALERTS, rules)
        config = workdir / "prometheus.yml"
        config.write_text(
            json.dumps(  # JSON is YAML
                {
                    "global": {"scrape_interval": INTERVAL, "evaluation_interval": INTERVAL},
                    "rule_files": [str(rules)],
                    "scrape_configs": [
                        {
                            "job_name": JOB,
                            "scrape_interval": INTERVAL,
                            "scrape_timeout": INTERVAL,
                            "static_configs": [{"targets": [target]}],
                        }
                    ],
                }
            )
        )
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "prometheus.log"
        assert PROMETHEUS is not None
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=workdir,
            )

    def get(self, path: str, **params: str) -> Any:
        url = f"{self.url}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query at the newest scrape; raises on a PromQL error (HTTP 400)."""
        try:
            data = self.get("/api/v1/query", query=expr)
        except urllib.error.HTTPError as error:
            raise AssertionError(f"{expr!r}: {error.read().decode()}") from error
        result: list[dict[str, Any]] = data["result"] if data["resultType"] == "vector" else []
        return result

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def rules(self) -> dict[str, dict[str, Any]]:
        groups = self.get("/api/v1/rules")["groups"]
        return {rule["name"]: rule for group in groups for rule in group["rules"]}

    def wait_ready(self, timeout: float = 30.0) -> None:
        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                    return bool(response.status == 200)
            except OSError:
                return False

        until(ready, timeout, f"Prometheus not ready:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def until(predicate: Callable[[], bool], timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(message)
        time.sleep(0.1)


def _exposed(server: ServerProcess) -> str:
    assert server.metrics_url is not None
    with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
        return str(response.read().decode())


def _select_calls_exposed(server: ServerProcess) -> float:
    """SelectBackend calls the server has counted, from its own /metrics."""
    total = 0.0
    for line in _exposed(server).splitlines():
        if line.startswith("grpc_server_handled_total{") and 'grpc_method="SelectBackend"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _convert(server: ServerProcess, output: str) -> None:
    """A path-mode conversion of the synthetic checkpoint under the data root."""
    header = header_for(checkpoint=("in", output), backend="triton")
    summary = convert_checkpoint_remote(Connection(server.address, timeout=60), header)
    assert summary.target_format.backend == "TRITON"


def _mismatched_report() -> observed_pb2.ReportDecisionsRequest:
    """A vLLM process reporting MARLIN where vLLM 0.33's rules pick HUMMING (an H100 with
    humming installed): the server answers it differently."""
    spec = {"hf_quantization_config": GPTQ, "layer": LAYER, "platform": "h100"}
    decision = observed_pb2.ObservedDecision(
        layer_name="model.layers.0.mlp.experts",
        integration="auto_gptq",
        moe_method="AutoGPTQMoEMethod",
        deployment_json=json.dumps(spec),
        backend="MARLIN",
        experts_class="MarlinExperts",
    )
    process = observed_pb2.ReportingProcess(host="gpu-node-3", vllm_version="0.33.0")
    return observed_pb2.ReportDecisionsRequest(process=process, decisions=[decision])


def _unmodelled_report() -> observed_pb2.ReportDecisionsRequest:
    """The same decision from a vLLM release newer than every ruleset."""
    newest = RELEASES[DEFAULT_RULESET]
    major, minor = (int(part) for part in newest.below.split(".")[:2])
    request = _mismatched_report()
    request.process.vllm_version = f"{major}.{minor + 1}.0"
    return request


def _call(stub: Any, request: pb.SelectBackendRequest) -> grpc.StatusCode:
    try:
        stub.SelectBackend(request, timeout=5)
    except grpc.RpcError as error:
        code: grpc.StatusCode = error.code()
        return code
    return grpc.StatusCode.OK


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[ServerProcess, Prometheus]]:
    # Prometheus first: it applies new scrape targets only every 5 s, which overlaps with
    # the server's start-up this way. The server's /metrics port is chosen here for it.
    from service.formats.synthetic.checkpoints import SyntheticSpec, write_synthetic_checkpoint

    data = tmp_path / "data"
    write_synthetic_checkpoint(data / "in", SyntheticSpec(num_layers=2, fast=True))
    metrics_port = _free_port()
    prometheus = Prometheus(tmp_path, f"127.0.0.1:{metrics_port}")
    server: ServerProcess | None = None
    try:
        # A long restart back-off keeps the killed worker down for several scrapes.
        server = launch(
            "--metrics-port",
            str(metrics_port),
            "--worker-restart-backoff-s",
            "4",
            "--data-root",
            str(data),
            # The HTTP/JSON door is on by default (serverproc turns it off): its series too.
            "--http-port",
            str(_free_port()),
        )
        wait_ready(server)
        prometheus.wait_ready()
        until(
            lambda: prometheus.value(f'up{{job="{JOB}"}}') == 1,
            20,
            f"Prometheus never scraped the server:\n{prometheus.log.read_text()}",
        )
        yield server, prometheus
    finally:
        if server is not None:
            server.stop(signal.SIGKILL if server.process.poll() is None else signal.SIGTERM)
        prometheus.stop()


def _drive_traffic(server: ServerProcess, prometheus: Prometheus) -> None:
    with server.channel() as channel:
        stub = pb_grpc.MoeControlServiceStub(channel)
        # 1. One call of each kind, so every series exists before the bulk counts.
        assert [_call(stub, r) for r in ANSWERS] == [grpc.StatusCode.OK] * len(ANSWERS)
        assert _call(stub, NO_ELIGIBLE) is grpc.StatusCode.FAILED_PRECONDITION
        assert _call(stub, BAD) is grpc.StatusCode.INVALID_ARGUMENT
        stub.ListWorkers(pb.ListWorkersRequest(), timeout=5)
        stub.GetPlatform(pb.GetPlatformRequest(), timeout=5)
        assert stub.ReportDecisions(_mismatched_report(), timeout=10).accepted == 1
        assert stub.ReportDecisions(_unmodelled_report(), timeout=10).accepted == 1
        _convert(server, "out0")
        worker = stub.ListWorkers(pb.ListWorkersRequest(), timeout=5).workers[0]
        os.kill(worker.pid, signal.SIGKILL)  # a child of the server this test started
        until(
            lambda: health_status(channel, SERVICE) == "NOT_SERVING",
            10,
            "the killed worker was not noticed",
        )
        assert _call(stub, NEEDS_WORKER) is grpc.StatusCode.UNAVAILABLE
        until(
            lambda: bool(prometheus.query('grpc_server_handled_total{grpc_code="UNAVAILABLE"}')),
            10,
            "Prometheus never scraped the first UNAVAILABLE",
        )
        # 2. The bulk: 10 UNAVAILABLE (the worker is still in its back-off), 20 answers,
        # 30 failed selections and 5 bad requests.
        unavailable = [_call(stub, NEEDS_WORKER) for _ in range(10)]
        assert unavailable == [grpc.StatusCode.UNAVAILABLE] * 10, "the worker came back early"
        for i in range(20):
            assert _call(stub, ANSWERS[i % len(ANSWERS)]) is grpc.StatusCode.OK
        for _ in range(30):
            assert _call(stub, NO_ELIGIBLE) is grpc.StatusCode.FAILED_PRECONDITION
        for _ in range(5):
            assert _call(stub, BAD) is grpc.StatusCode.INVALID_ARGUMENT
    wait_ready(server)
    _convert(server, "out1")
    # 3. Prometheus holds the final counters and a ready worker, and rules ran on them.
    final = _select_calls_exposed(server)
    selector = f'grpc_server_handled_total{{job="{JOB}", grpc_method="SelectBackend"}}'
    until(
        lambda: prometheus.value(f"sum({selector})") == final,
        15,
        f"Prometheus never scraped all {final} SelectBackend calls",
    )
    until(
        lambda: prometheus.value("sum(moe_control_convert_duration_seconds_count)") == 2,
        15,
        "Prometheus never scraped the second conversion",
    )
    until(
        lambda: prometheus.value(f'min(moe_control_worker_ready{{job="{JOB}"}})') == 1,
        15,
        "Prometheus never saw the worker ready again",
    )
    time.sleep(1.5)  # three rule evaluations after that scrape


def _alert_states(prometheus: Prometheus) -> dict[str, str]:
    return {name: rule.get("state", "?") for name, rule in prometheus.rules().items()}


def _panel_queries() -> list[tuple[str, str]]:
    queries = [
        (f"{path.name}: {where}", expr)
        for path in dashboard_paths()
        for where, expr in dashboard_queries(load_dashboard(path))
        if not expr.lstrip().startswith("label_values(")
    ]
    assert len(queries) >= 20
    return queries


def _without_data(prometheus: Prometheus, queries: list[tuple[str, str]]) -> list[str]:
    """The panel queries with no data, each with the metrics Prometheus holds no series of."""
    return [
        f"{where} (no series of {sorted(_not_emitted(prometheus, expr))})"
        for where, expr in queries
        if not prometheus.query(substitute(expr))
    ]


def _not_emitted(prometheus: Prometheus, expr: str) -> set[str]:
    return {
        name
        for name in metric_names(expr)
        if not prometheus.query(f'count({{__name__="{name}", job="{JOB}"}})')
    }


def test_dashboard_and_alerts_against_a_real_prometheus(
    stack: tuple[ServerProcess, Prometheus],
) -> None:
    server, prometheus = stack
    started = time.monotonic()
    queries = _panel_queries()

    # -- every dashboard expression has data before any call (a rate needs two scrapes)
    deadline = time.monotonic() + 10
    while (empty := _without_data(prometheus, queries)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not empty, f"dashboard queries without data before any call: {empty}"
    assert _select_calls_exposed(server) == 0  # no traffic yet, health checks aside

    _drive_traffic(server, prometheus)

    # -- and after the traffic
    empty = _without_data(prometheus, queries)
    assert not empty, f"dashboard queries without data: {empty}"
    # Template variables resolve to the running job and instance.
    assert prometheus.get("/api/v1/label/job/values", **{"match[]": "moe_control_build_info"}) == [
        JOB
    ]

    # -- every alert rule: healthy, and in the state the traffic calls for
    rules = prometheus.rules()
    assert set(rules) == {rule["alert"] for rule in alert_rules()}
    for name, rule in rules.items():
        assert rule["health"] == "ok", (name, rule.get("lastError"))
    assert _alert_states(prometheus) == EXPECTED_WHILE_SERVING
    for rule in alert_rules():
        fires = bool(prometheus.query(rule["expr"]))
        assert fires == (EXPECTED_WHILE_SERVING[rule["alert"]] != "inactive"), rule["alert"]

    # -- the server goes away: its target is down
    server.stop()
    until(
        lambda: prometheus.value(f'up{{job="{JOB}"}}') == 0,
        10,
        "Prometheus never saw the target down",
    )
    until(
        lambda: _alert_states(prometheus)["MoeControlTargetDown"] == "pending",
        5,
        f"MoeControlTargetDown did not turn pending: {_alert_states(prometheus)}",
    )
    print(
        f"\n{len(queries)} dashboard queries with data before and after traffic; "
        f"{len(rules)} alert rules as expected; "
        f"{time.monotonic() - started:.1f} s"
    )
