"""Start the real server (`moe-control serve`) as a subprocess on free loopback ports."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.api.names import SERVICE_NAME

SERVICE = SERVICE_NAME
_LISTENING = re.compile(
    r"listening for gRPC on (\S+?)(?:; metrics at (\S+?))?(?:; HTTP at (\S+))?$"
)


@dataclass
class ServerProcess:
    process: subprocess.Popen[str]
    address: str
    metrics_url: str | None
    stderr_lines: list[str] = field(default_factory=list)
    #: The HTTP/JSON API's base URL (None: off, as here by default: `--http-port 0`; a test
    #: that speaks HTTP passes a free port).
    http_url: str | None = None

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def launch(*args: str, env: dict[str, str] | None = None, timeout: float = 30.0) -> ServerProcess:
    """Start `moe-control serve` on ephemeral ports and wait for its listening line."""
    command = [
        sys.executable,
        "-m",
        "service.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--http-port",
        "0",
        "--devices",
        "cpu",
        "--grace-s",
        "2",
        # One process unless a test asks for more (a later flag wins): replicas are tested
        # where they matter (the shared `server` fixture, test_replicas.py).
        "--server-processes",
        "1",
        *args,
    ]
    full_env = {**os.environ, **(env or {})}
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
    )
    stderr_lines: list[str] = []

    def drain() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            stderr_lines.append(line)

    threading.Thread(target=drain, daemon=True).start()
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    line = ""
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if line or process.poll() is not None:
            break
    match = _LISTENING.search(line.strip())
    if match is None:
        process.kill()
        process.wait()
        raise RuntimeError(f"server did not start: {line!r}\n{''.join(stderr_lines)}")
    return ServerProcess(process, match.group(1), match.group(2), stderr_lines, match.group(3))


def health_status(channel: grpc.Channel, service: str = "", timeout: float = 30.0) -> str:
    stub = health_pb2_grpc.HealthStub(channel)
    response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


def wait_for(predicate: Callable[[], bool], timeout: float = 60.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def wait_ready(server: ServerProcess, timeout: float = 180.0) -> None:
    with server.channel() as channel:
        ok = wait_for(lambda: health_status(channel, SERVICE) == "SERVING", timeout)
    assert ok, "server never became ready:\n" + "".join(server.stderr_lines)
