"""`moe-control select --server` through the shared client flags, against the real server
on loopback: `--wait-ready` waits for a server still starting, `--timeout` bounds the whole
command (a measured call given too little time ends in one line naming --timeout, exit 3,
no table and no "None"), the measured policy says what it is doing before it waits, and a
fleet matrix asks all its cells in one session."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from integration.serverproc import ServerProcess, launch, wait_ready
from service.cli import main
from service.client.channel import Connection

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
CONFIG = {
    "model_type": "mixtral",
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "quantization_config": SPEC["hf_quantization_config"],
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


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_wait_ready_waits_for_a_server_still_starting(
    spec_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = _free_port()
    argv = ["select", "--deployment", str(spec_path), "--server", f"127.0.0.1:{port}"]
    argv += ["--wait-ready", "--timeout", "90", "--json"]
    status: list[int] = []
    client = threading.Thread(target=lambda: status.append(main(argv)))
    client.start()  # before the server even listens: the client waits, within --timeout
    starting = launch("--port", str(port))
    try:
        client.join(120)
        assert not client.is_alive()
    finally:
        starting.stop()
    answer = json.loads(capsys.readouterr().out)
    # decided for the worker's own platform: only a ready worker can answer that (a failed
    # answer, on a CPU without AMX, carries that platform as its `platform`)
    decided_for = answer.get("server_platform") or answer["platform"]
    assert decided_for["device"] == "cpu"
    assert answer.get("error", {}).get("stage") != "server"
    assert status[0] in (0, 1)  # vLLM picks CPU with AMX, fails the layer without it
    assert status[0] == (0 if answer.get("backend") else 1)


def test_not_ready_within_timeout_is_one_line_and_exit_1(
    spec_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["select", "--deployment", str(spec_path), "--server", f"127.0.0.1:{_free_port()}"]
    assert main([*argv, "--wait-ready", "--timeout", "0.5"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("moe-control select: not ready after ")
    assert len(captured.err.splitlines()) == 1


def test_a_measured_call_out_of_time_is_one_line_naming_timeout(
    server: ServerProcess, spec_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["select", "--policy", "measured", "--refresh", "--tokens", "4096,2048"]
    argv += ["--deployment", str(spec_path), "--server", server.address, "--timeout", "0.05"]
    assert main(argv) == 3
    captured = capsys.readouterr()
    assert captured.out == ""  # no table, no "None" headers
    notice, error = captured.err.splitlines()
    assert notice.startswith("measuring ") and notice.endswith("(--timeout 0.05 s)")
    assert error.startswith("moe-control select: no answer within 0.05 s (DEADLINE_EXCEEDED)")
    assert "--timeout SECONDS" in error
    assert "None" not in captured.err

    assert main([*argv, "--json"]) == 3
    result = json.loads(capsys.readouterr().out)
    assert result["error"]["type"] == "DEADLINE_EXCEEDED"
    assert "--timeout" in result["error"]["message"]


def test_a_measured_call_says_what_it_measures_and_prints_no_none(
    server: ServerProcess, spec_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["select", "--policy", "measured", "--tokens", "1", "--wait-ready"]
    status = main([*argv, "--deployment", str(spec_path), "--server", server.address])
    captured = capsys.readouterr()
    assert status in (0, 1), captured.err
    (notice,) = captured.err.splitlines()
    assert notice.startswith("measuring ") and "at token counts 1 on the server's worker" in notice
    assert notice.endswith("(--timeout 300 s)")  # the measured policy's default deadline
    assert "measured on worker 0 (cpu)" in captured.out
    assert "None" not in captured.out


def test_a_fleet_matrix_asks_every_cell_in_one_session(
    server: ServerProcess,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    sessions: list[Connection] = []
    session = Connection.session

    def counted(self: Connection, *args: Any, **kwargs: Any) -> Any:
        sessions.append(self)
        return session(self, *args, **kwargs)

    monkeypatch.setattr(Connection, "session", counted)
    argv = ["select", "--config", str(config), "--gpu", "a100,h100,h200", "--json"]
    argv += ["--server", server.address, "--timeout", "60", "--wait-ready"]
    assert main(argv) == 0
    table = json.loads(capsys.readouterr().out)
    assert len(sessions) == 1
    assert sessions[0].timeout == 60.0 and sessions[0].wait_ready
    text = json.dumps(table)
    assert "MARLIN" in text and "HUMMING" in text
