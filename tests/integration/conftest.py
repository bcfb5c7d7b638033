"""Fixtures: real servers started as subprocesses (see serverproc.py)."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from integration.serverproc import ServerProcess, launch, wait_ready
from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc


@pytest.fixture
def server_factory() -> Iterator[Callable[..., ServerProcess]]:
    started: list[ServerProcess] = []

    def factory(*args: str, env: dict[str, str] | None = None, ready: bool = True) -> ServerProcess:
        server = launch(*args, env=env)
        started.append(server)
        if ready:
            wait_ready(server)
        return server

    yield factory
    for server in started:
        server.stop(signal.SIGKILL if server.process.poll() is None else signal.SIGTERM)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """One plain server shared by a module's tests: a primary and a replica, as the default
    on a 2-core machine is (calls land on either; the answers must not differ)."""
    process = launch("--server-processes", "2")
    wait_ready(process)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def stub(server: ServerProcess) -> Iterator[Any]:
    with server.channel() as channel:
        yield pb_grpc.MoeControlServiceStub(channel)
