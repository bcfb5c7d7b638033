"""SelectMatrix against the real server: `select --config DIR --gpu all --ruleset ...
--server` asks the whole matrix in one call and prints exactly what the local command
prints (flags, invalid rows and every output form included); the server's health answers
while a matrix of the largest allowed size is being decided."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from integration.serverproc import ServerProcess, health_status, launch, wait_for, wait_ready
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc
from service.cli import main
from service.client.channel import Session
from service.dataplane.matrix import MAX_MATRIX_CELLS
from service.oracle import PLATFORM_PRESETS, RULESETS
from tests.cli.test_matrix import DENSE, MIXTRAL_AWQ, QWEN

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = launch("--server-processes", "2")
    wait_ready(process)
    yield process
    process.stop()


@pytest.fixture
def fleet(tmp_path: Path) -> Path:
    """Three configs, one of them not a quantized MoE model (an invalid row)."""
    root = tmp_path / "fleet"
    root.mkdir()
    for name, config in (("qwen3", QWEN), ("mixtral-awq", MIXTRAL_AWQ), ("dense", DENSE)):
        (root / f"{name}.json").write_text(json.dumps(config))
    return root


def printed(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    status = main(argv)
    return status, capsys.readouterr().out


@pytest.mark.parametrize(
    "flags",
    [
        ["--json"],
        ["--csv"],
        [],
        ["--json", "--packages", "none", "--env", "VLLM_BATCH_INVARIANT=1", "-tp", "2"],
    ],
)
def test_the_remote_matrix_is_the_local_one_in_one_call(
    server: ServerProcess,
    fleet: Path,
    flags: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["select", "--config", str(fleet), "--gpu", "all", "--ruleset", ",".join(RULESETS)]
    local = printed([*argv, *flags], capsys)
    calls: list[str] = []
    unary = Session.unary

    def counted(self: Session, method: str, request: Any) -> Any:
        calls.append(method)
        return unary(self, method, request)

    monkeypatch.setattr(Session, "unary", counted)
    remote = printed([*argv, *flags, "--server", server.address, "--timeout", "120"], capsys)
    assert calls == ["SelectMatrix"]
    assert remote == local
    assert local[0] == 2  # the dense row is invalid on every cell, as locally


def test_invalid_platform_flags_are_invalid_cells_as_locally(
    server: ServerProcess, fleet: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["select", "--config", str(fleet), "--gpu", "a100,h100", "--json"]
    argv += ["--env", "VLLM_NOT_A_FLAG=1"]
    local = printed(argv, capsys)
    assert printed([*argv, "--server", server.address], capsys) == local
    assert {cell["outcome"] for cell in json.loads(local[1])["cells"]} == {"invalid"}


def largest_matrix() -> pb.SelectMatrixRequest:
    """Rows of one spec, enough for the cell limit over every preset and ruleset."""
    per_row = len(PLATFORM_PRESETS) * len(RULESETS)
    spec = {
        "hf_quantization_config": QWEN["quantization_config"],
        "layer": {"num_experts": 128, "top_k": 8, "hidden_size": 2048, "intermediate_size": 768},
    }
    models = [
        pb.MatrixModel(label=f"m{i}", spec_json=json.dumps({**spec, "id": i}))
        for i in range(MAX_MATRIX_CELLS // per_row)
    ]
    return pb.SelectMatrixRequest(
        models=models, gpus=list(PLATFORM_PRESETS), rulesets=list(RULESETS)
    )


def test_health_answers_while_the_largest_matrix_is_decided(server: ServerProcess) -> None:
    """Ordering, not timing: a health check sent once cells are being decided answers
    before the matrix does, on a connection of its own."""
    request = largest_matrix()
    assert len(request.models) * len(request.gpus) * len(request.rulesets) <= MAX_MATRIX_CELLS
    done = threading.Event()
    answer: dict[str, Any] = {}

    def decide() -> None:
        with server.channel() as channel:
            answer["matrix"] = pb_grpc.MoeControlServiceStub(channel).SelectMatrix(
                request, timeout=120
            )
        done.set()

    thread = threading.Thread(target=decide)
    before = _decisions(server)
    thread.start()
    try:
        assert wait_for(lambda: _decisions(server) > before or done.is_set(), timeout=60)
        answered = []
        with grpc.insecure_channel(
            server.address, options=[("grpc.use_local_subchannel_pool", 1)]
        ) as channel:
            for _ in range(5):
                answered.append((health_status(channel, timeout=30), done.is_set()))
        assert [status for status, _ in answered] == ["SERVING"] * 5
        assert not answered[0][1], "the matrix was done before health was asked: too small"
    finally:
        thread.join(120)
    cells = answer["matrix"].cells
    assert len(cells) == len(request.models) * len(request.gpus) * len(request.rulesets)
    assert all(cell.outcome != pb.MATRIX_OUTCOME_ERROR for cell in cells)


def _decisions(server: ServerProcess) -> float:
    """Decisions counted so far by the server (every process)."""
    import urllib.request

    assert server.metrics_url is not None
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("moe_control_backend_selections_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total
