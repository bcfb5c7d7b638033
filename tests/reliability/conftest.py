"""One real server subprocess per test module (loopback, a CPU worker, a data root)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis.configuration import set_hypothesis_home_dir
from integration.serverproc import ServerProcess, health_status, launch, wait_ready

from reliability import wire

# Hypothesis keeps caches under its home directory (default: ./.hypothesis in the repo).
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "moe-control-hypothesis")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("reliability")
    (base / "root").mkdir()
    (base / "segments").mkdir()
    return base


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[ServerProcess]:
    process = launch("--data-root", str(root / "root"), "--segment-dir", str(root / "segments"))
    wait_ready(process)
    yield process
    alive = process.process.poll() is None
    process.stop()
    assert alive, "the server died:\n" + "".join(process.stderr_lines[-40:])


@pytest.fixture(scope="module")
def channel(server: ServerProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(
        server.address, options=[("grpc.max_send_message_length", 64 * 1024 * 1024)]
    ) as ch:
        yield ch


@pytest.fixture(autouse=True)
def still_serving(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test that used the server: it runs and answers health."""
    yield
    if "server" in request.fixturenames:
        server: ServerProcess = request.getfixturevalue("server")
        assert server.process.poll() is None, "".join(server.stderr_lines[-40:])
        with server.channel() as ch:
            assert health_status(ch) == "SERVING"


def pytest_sessionfinish(session: pytest.Session) -> None:
    """MOE_CONTROL_FUZZ_REPORT=path: write the answers counted per method and code."""
    target = os.environ.get("MOE_CONTROL_FUZZ_REPORT")
    if target and wire.TALLY:
        Path(target).write_text(json.dumps(dict(sorted(wire.TALLY.items())), indent=1))
