"""`moe-control select --policy measured --server ...` over real gRPC against the real server
(one CPU worker): the JSON carries the measured part as the server answered it, the table
prints each token count's fastest backend with its time and why the GPU backends did not
run, a repeat comes from the server's cache, and the policy without a server is refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from integration.platforms import FORCED_MARLIN, oracle_on, server_worker_platform
from integration.serverproc import ServerProcess, launch, wait_ready
from service.cli import main
from service.oracle import SelectionError

SPEC: dict[str, Any] = {
    "hf_quantization_config": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 64,
        "sym": True,
        "desc_act": False,
    },
    "layer": {"num_experts": 4, "top_k": 2, "hidden_size": 128, "intermediate_size": 128},
}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = launch()
    wait_ready(process)
    yield process
    process.stop()


@pytest.fixture
def spec_path(tmp_path: Path) -> Path:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(SPEC))
    return path


def select(*args: str) -> list[str]:
    return ["select", "--policy", "measured", *args]


def test_measured_json_then_table_from_the_cache(
    server: ServerProcess, spec_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The static part is vLLM's answer on the worker's own platform, probed from this host's
    # CPU: with AMX vLLM picks CPU (exit 0), without it vLLM fails the layer (exit 1, yet the
    # timings are there).
    expected = oracle_on(SPEC, server_worker_platform(server))
    fails = isinstance(expected, SelectionError)
    static = "" if isinstance(expected, SelectionError) else expected.backend
    code = main(
        select(
            "--deployment", str(spec_path), "--server", server.address, "--json", "--tokens", "1,8"
        )
    )
    answer = json.loads(capsys.readouterr().out)
    assert code == (1 if fails else 0)
    measured = answer.pop("measured")
    answer.pop("server_platform")
    if isinstance(expected, SelectionError):
        assert answer["backend"] is None
        assert answer["candidates"] == [c.to_json() for c in expected.candidates]
        assert [h["code"] for h in answer["hazards"]] == ["VLLM_FAILS"]
    else:
        assert answer == expected.to_json() and answer["backend"] == "CPU"
    assert measured["device_name"] == "cpu" and not measured["from_cache"]
    assert [b["tokens"] for b in measured["buckets"]] == [1, 8]
    for bucket in measured["buckets"]:
        timed = {t["backend"]: t for t in bucket["timings"]}
        assert bucket["fastest_backend"] == "EMULATION"
        assert bucket["fastest_seconds"] == timed["EMULATION"]["device_seconds"] > 0
        assert timed["MARLIN"]["device_seconds"] is None and "CUDA" in timed["MARLIN"]["error"]
        assert bucket["static_backend"] == (static or None) and bucket["static_seconds"] is None

    code = main(
        select("--deployment", str(spec_path), "--server", server.address, "--tokens", "8,1")
    )
    table = capsys.readouterr().out.splitlines()
    assert code == (1 if fails else 0)
    assert any(
        line.startswith("measured on worker 0 (cpu), from the server's cache") for line in table
    )
    header = table.index(next(line for line in table if line.lstrip().startswith("TOKENS")))
    rows = [table[header + 1].split(), table[header + 3].split()]
    assert [row[0] for row in rows] == ["1", "8"]  # the server answers in token order
    assert all(row[1] == "EMULATION" for row in rows)
    assert all(row[4:] == [static or "-", "-", "-"] for row in rows)  # vLLM's choice, untimed
    assert any(line.startswith("not run: MARLIN:") and "CUDA" in line for line in table)

    # Where vLLM fails on any CPU (a forced Marlin backend): exit 1, the failure as a hazard,
    # the timings from the cache all the same.
    forced_spec = {**SPEC, **FORCED_MARLIN}
    forced_failure = oracle_on(forced_spec, server_worker_platform(server))
    assert isinstance(forced_failure, SelectionError)
    spec_path.write_text(json.dumps(forced_spec))
    code = main(
        select(
            "--deployment", str(spec_path), "--server", server.address, "--json", "--tokens", "1,8"
        )
    )
    forced = json.loads(capsys.readouterr().out)
    assert code == 1
    assert forced["backend"] is None
    assert forced["candidates"] == [c.to_json() for c in forced_failure.candidates]
    assert [h["code"] for h in forced["hazards"]] == ["VLLM_FAILS"]
    assert forced["measured"]["from_cache"]
    assert [b["timings"] for b in forced["measured"]["buckets"]] == [
        b["timings"] for b in measured["buckets"]
    ]


def test_measured_needs_a_server(spec_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(select("--deployment", str(spec_path))) == 2
    assert "--policy measured needs --server" in capsys.readouterr().err
