"""The fast soak (`bench/soak.py` for ~10 s): every RPC at once against the real server.

Why a test: a server that answers each call correctly alone can still leak, mix up answers
or refuse calls it should serve when everything runs together. The same criteria as
`make soak` (minutes), asserted here on the script's JSON report, item by item, so a
failure says which one broke: no unexpected status, every method exercised, every limit
provoked and answered RESOURCE_EXHAUSTED, refusals only at a provoked limit, memory and
descriptors flat, nothing left behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb

REPO = Path(__file__).resolve().parents[2]
SOAK = REPO / "bench" / "soak.py"
SECONDS = 10


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("soak")
    done = subprocess.run(
        [
            sys.executable,
            str(SOAK),
            "--seconds",
            str(SECONDS),
            "--warmup",
            "3",
            "--json",
            str(out / "report.json"),
            "--markdown",
            str(out / "report.md"),
            "--workdir",
            str(out),
            "--watchdog",
            "240",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=SECONDS + 300,
        check=False,
    )
    path = out / "report.json"
    assert path.is_file(), f"no report (exit {done.returncode}):\n{done.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(path.read_text())
    result["exit_status"] = done.returncode
    result["markdown"] = (out / "report.md").read_text()
    return result


def rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["method"]: row for row in report["rows"]}


def test_no_unexpected_outcome(report: dict[str, Any]) -> None:
    assert report["failures"] == [], report["markdown"]
    assert report["problems"] == [], report["markdown"]
    assert report["passed"] and report["exit_status"] == 0


#: Every RPC of the service, from the contract itself, plus the health check.
RPCS = [m.name for m in pb.DESCRIPTOR.services_by_name["MoeControlService"].methods]
#: The limits the soak configures; each must have been provoked.
LIMITS = (
    "max_concurrent_rpcs",
    "max_receive_message_bytes",
    "max_send_message_bytes",
    "run_max_tokens",
    "run_max_inline_bytes",
    "layer_budget_mib",
    "max_concurrent_convert",
)


def test_every_method_was_exercised(report: dict[str, Any]) -> None:
    for rpc in [*RPCS, "Health.Check"]:
        served = [
            row
            for name, row in rows(report).items()
            if name.split(" (")[0] == rpc and row["measured_ok"] > 0
        ]
        assert served, f"{rpc} never answered OK in the measured window"
    modes = {"ConvertWeights (inline)", "ConvertWeights (checkpoint)", "RunMoE (inline)"}
    assert all(rows(report)[mode]["measured_ok"] > 0 for mode in modes)


def test_every_limit_was_provoked_and_refused(report: dict[str, Any]) -> None:
    probes = {name: row for name, row in rows(report).items() if name.startswith("limit:")}
    for limit in LIMITS:
        assert any(limit in name for name in probes), f"{limit} never provoked"
    for name, row in probes.items():
        # For a probe, "OK" means: answered RESOURCE_EXHAUSTED with the limit's message;
        # the concurrent-RPC limit may refuse it first while a burst holds every slot.
        assert row["codes"].get("OK", 0) >= 1, name
        assert set(row["codes"]) <= {"OK", "RESOURCE_EXHAUSTED"}, (name, row["codes"])
        assert row["codes"].get("RESOURCE_EXHAUSTED", 0) == row["refused_in_burst"], name


def test_refusals_only_at_a_provoked_limit(report: dict[str, Any]) -> None:
    """The other methods answer OK, or RESOURCE_EXHAUSTED only by the concurrent-RPC limit
    while a Watch burst held every slot."""
    for name, row in rows(report).items():
        if name.startswith("limit:"):
            continue
        codes = row["codes"]
        assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, (name, codes)
        assert codes.get("RESOURCE_EXHAUSTED", 0) == row["refused_in_burst"], name


def test_the_server_logs_no_error(report: dict[str, Any]) -> None:
    """Provoked limits, cancels and deadlines are the clients' doing: none is a server error
    (an answer over the send limit used to reach grpc's core and be logged there as one)."""
    assert report["server_error_logs"] == {}, report["markdown"]


def test_memory_and_descriptors_stay_flat(report: dict[str, Any]) -> None:
    total = report["memory"]["total"]
    assert total["last_mib"] <= total["allowed_mib"], report["memory"]
    fds = report["fds"]
    # Once idle, only the soak's own connections are more than before the load.
    assert fds["after"] <= fds["baseline"] + fds["connections"] + 8, fds
    assert report["samples"] >= SECONDS, "too few RSS/fd samples"


def test_nothing_is_left_behind(report: dict[str, Any]) -> None:
    final = report["final"]
    assert final["ready"] and final["worker_restarts"] == 0
    assert final["leftover_layers"] == [] and final["resident_layers_kept"]
    # Conversions ran through shared-memory segments, and none is left once they ended.
    assert report["peak"]["segments"] > 0
    assert not any("segments left" in problem for problem in report["problems"])
