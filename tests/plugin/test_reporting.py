"""The plugin inside the live vLLM release against a real moe-control server on loopback.

vLLM loads the plugin through its own plugin loader (`load_general_plugins`, the plugin
installed in vLLM's environment by `make test`) and builds MoE layers through its real
integration path (the parity harness: quantization resolution, VllmConfig, FusedMoEFactory;
only the machine faked), several layers per deployment. Against a server that compares with
the live release's ruleset every distinct decision arrives once and agrees; against one told to
compare with vLLM 0.32 the deployments 0.32 decides differently are counted and listed; and
against a server that is absent, refusing every report, or asking for another token, vLLM
decides exactly as without the plugin and the plugin costs one warning line; against a stopped
one (it accepts connections and never answers; a report to it cannot end for minutes)
every layer is built while no report has been answered: nothing on vLLM's path waits for it.
"""

from __future__ import annotations

import json
import signal
import socket
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from integration.serverproc import ServerProcess, launch, wait_ready
from prometheus_client.parser import text_string_to_metric_families

from service.api.generated.moe_control.v1 import observed_pb2
from service.cli import main
from service.oracle import DEFAULT_RULESET, RULESETS
from tests.parity.compare import differences, ours
from tests.plugin.driver import LAYERS, DriverRun, deployments, run_driver

pytestmark = [pytest.mark.parity, pytest.mark.timeout(1800)]

METHOD = "/moe_control.v1.MoeControlService/ListObservedDecisions"
TOKEN = "the-right-token"
#: The report deadline of the runs against servers that answer (or refuse at once).
DEADLINE_S = 1.0
#: The report deadline against the stopped server: the plugin's longest (60 s). A report to
#: it can end only when the server answers, which it cannot while stopped, or after three
#: attempts of this long (about three minutes), far beyond what building the layers takes
#: on any machine. What the plugin costs vLLM is a measurement (bench/RESULTS.md), not a
#: verdict here.
HELD_DEADLINE_S = 60.0
FAILURES = ("absent", "refusing", "wrong_token")
LATE = {"refusing": "late"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def world() -> Iterator[dict[str, Any]]:
    """The servers, and one vLLM run per scenario (three at a time)."""
    specs, recorded = deployments()
    servers = {
        "matching": launch(),
        "other_release": launch("--observed-ruleset", "vllm-0.32"),
        "wrong_token": launch("--auth-token", TOKEN),
        "refusing": launch("--max-receive-message-bytes", "64"),
        "slow": launch(),
    }
    try:
        for server in servers.values():
            wait_ready(server, timeout=180)
        servers["slow"].process.send_signal(signal.SIGSTOP)
        addresses = {name: server.address for name, server in servers.items()}
        addresses["absent"] = f"127.0.0.1:{_free_port()}"
        envs = {
            name: {
                "MOE_CONTROL_REPORT_ADDRESS": address,
                "MOE_CONTROL_REPORT_DEADLINE_S": str(DEADLINE_S),
            }
            for name, address in addresses.items()
        }
        envs["wrong_token"]["MOE_CONTROL_REPORT_AUTH_TOKEN"] = "not-" + TOKEN
        # Nothing can leave for the stopped server: the driver's flush window is a formality.
        envs["slow"].update(
            MOE_CONTROL_REPORT_DEADLINE_S=str(HELD_DEADLINE_S), MOE_CONTROL_TEST_FLUSH_S="1"
        )
        with ThreadPoolExecutor(max_workers=3) as pool:
            futures = {
                # The refusing run loads the plugin after vLLM's modules (the rebinding path).
                name: pool.submit(run_driver, specs, env, plugins=LATE.get(name, "first"))
                for name, env in envs.items()
            }
            runs = {name: future.result() for name, future in futures.items()}
        yield {"specs": specs, "recorded": recorded, "servers": servers, "runs": runs}
    finally:
        servers["slow"].process.send_signal(signal.SIGCONT)
        for server in servers.values():
            server.stop()


def listing(server: ServerProcess, *, mismatches_only: bool = False) -> list[Any]:
    with server.channel() as channel:
        call = channel.unary_unary(
            METHOD,
            request_serializer=observed_pb2.ListObservedDecisionsRequest.SerializeToString,
            response_deserializer=observed_pb2.ListObservedDecisionsResponse.FromString,
        )
        answer = call(
            observed_pb2.ListObservedDecisionsRequest(mismatches_only=mismatches_only), timeout=10
        )
    return list(answer.deployments)


def counters(server: ServerProcess, name: str) -> dict[frozenset[tuple[str, str]], float]:
    assert server.metrics_url is not None
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    return {
        frozenset(sample.labels.items()): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


def outcome(answer: dict[str, Any]) -> tuple[str | None, str | None]:
    error = answer.get("error")
    return answer.get("backend"), None if error is None else error["type"]


def observed_outcome(deployment: Any) -> tuple[str | None, str | None]:
    observed = deployment.observed
    return observed.backend or None, observed.error.type or None


def test_vllm_decides_exactly_as_without_the_plugin(world: dict[str, Any]) -> None:
    """Every layer's answer in every run equals vLLM's recorded answer (taken without it)."""
    for name, run in world["runs"].items():
        for answer in run.result["answers"]:
            assert answer == world["recorded"][answer["id"]], (name, answer["id"])


def test_each_distinct_decision_arrives_once_and_agrees(world: dict[str, Any]) -> None:
    specs, run = world["specs"], world["runs"]["matching"].result
    server = world["servers"]["matching"]
    assert run["flushed"] and run["distinct"] == len(specs)
    assert (run["sent"], run["failed"], run["dropped"]) == (len(specs), 0, 0)
    found = listing(server)
    assert len(found) == len(specs)
    for deployment in found:
        assert deployment.count == 1
        assert deployment.ruleset == DEFAULT_RULESET and not deployment.note
        assert not deployment.first_difference, deployment
        assert deployment.vllm_version == RULESETS[DEFAULT_RULESET].release.first
        assert deployment.observed.layer_name == "model.layers.0.mlp.experts"
        spec = json.loads(deployment.observed.deployment_json)
        assert spec["layer"]["name"] == deployment.observed.layer_name
    assert sorted(map(observed_outcome, found), key=str) == sorted(
        (outcome(world["recorded"][s["id"]]) for s in specs), key=str
    )
    observed = counters(server, "moe_control_observed_decisions_total")
    assert sum(observed.values()) == len(specs)
    assert not any(counters(server, "moe_control_prediction_mismatches_total").values())


def test_another_release_mismatches_are_counted_and_listed(
    world: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """Compared with vLLM 0.32's rules, the deployments 0.32 decides differently (as the
    oracle's 0.32 ruleset says of vLLM 0.33's recorded answers) are the mismatches."""
    specs, recorded = world["specs"], world["recorded"]
    expected = [s for s in specs if differences(recorded[s["id"]], ours(s, "vllm-0.32"))]
    assert expected, "no deployment of the set is decided differently by vLLM 0.32"
    server = world["servers"]["other_release"]
    mismatched = listing(server, mismatches_only=True)
    assert len(mismatched) == len(expected)
    assert len(listing(server)) == len(specs)
    for deployment in mismatched:
        assert deployment.ruleset == "vllm-0.32" and deployment.count == 1
        assert deployment.first_difference and deployment.observed_value
        assert deployment.predicted.candidates
    counted = counters(server, "moe_control_prediction_mismatches_total")
    assert sum(counted.values()) == len(expected)
    assert all(dict(labels)["ruleset"] == "vllm-0.32" for labels, v in counted.items() if v)
    assert main(["observed", "--server", server.address, "--mismatches"]) == 0
    text = capsys.readouterr().out
    assert f"{len(specs)} observed deployments" not in text  # only the mismatches
    for deployment in mismatched:
        assert f"first difference {deployment.first_difference}:" in text


@pytest.mark.parametrize("failure", FAILURES)
def test_a_failing_server_costs_one_warning(world: dict[str, Any], failure: str) -> None:
    run: DriverRun = world["runs"][failure]
    result = run.result
    assert result["reporting"] and result["distinct"] == len(world["specs"])
    assert result["flushed"], "the reporter did not give up within the flush window"
    assert result["sent"] == 0 and result["failed"] == result["distinct"]
    assert len(run.warnings) == 1, run.warnings


def test_a_stopped_server_never_holds_vllm_up(world: dict[str, Any]) -> None:
    """Every layer of every deployment was built while the stopped server had answered no
    report (none can end for minutes): an observed call that waited for the server would
    not have returned before one did."""
    run: DriverRun = world["runs"]["slow"]
    result = run.result
    assert result["reporting"] and result["distinct"] == len(world["specs"])
    assert len(result["answers"]) == len(world["specs"]) * LAYERS
    assert result["answered_while_building"] == 0
    assert not result["flushed"]
    assert (result["sent"], result["failed"], result["dropped"]) == (0, 0, 0)
    assert run.warnings == []


def test_the_plugin_reports_its_costs(world: dict[str, Any]) -> None:
    """The plugin times itself on vLLM's thread (register() and every observed call, CPU) and
    its sending thread in the background; the figures go to bench/RESULTS.md."""
    run = world["runs"]["matching"].result
    print(
        f"\nplugin CPU on vLLM's thread: register() {run['register_s'] * 1e3:.1f} ms, observing "
        f"{len(run['layer_s'])} layers ({run['distinct']} distinct decisions) "
        f"{run['observe_s'] * 1e3:.1f} ms, longest call {run['longest_observe_s'] * 1e3:.1f} ms "
        f"wall; sending thread {run['sender_cpu_s'] * 1e3:.1f} ms CPU in the background"
    )
    late = world["runs"]["refusing"].result
    print(
        f"register() after vLLM's modules (the rebinding pass): {late['register_s'] * 1e3:.1f} ms"
    )
    for figures in (run, late):
        assert figures["register_s"] > 0 and figures["observe_s"] > 0
        assert figures["longest_observe_s"] > 0 and figures["sender_cpu_s"] > 0


def test_wrong_token_is_refused_as_unauthenticated(world: dict[str, Any]) -> None:
    run: DriverRun = world["runs"]["wrong_token"]
    assert "UNAUTHENTICATED" in run.warnings[0]
    with pytest.raises(grpc.RpcError) as refused:
        listing(world["servers"]["wrong_token"])
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
