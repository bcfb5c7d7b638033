"""Shutdown, worker supervision, TLS, mTLS and token auth against real server processes."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from integration.serverproc import SERVICE, ServerProcess, health_status, wait_for
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc
from service.cli import main as cli_main
from service.client.errors import RemoteSelectionError
from service.client.select import remote_select

SPEC = {
    "hf_quantization_config": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "sym": True,
        "desc_act": False,
    },
    "layer": {"num_experts": 8, "top_k": 2, "hidden_size": 4096, "intermediate_size": 14336},
    "platform": "a100",
}
Factory = Callable[..., ServerProcess]


def watch_readiness(channel: grpc.Channel) -> tuple[queue.Queue[str], Any]:
    """Stream readiness changes (grpc.health.v1 Watch) into a queue."""
    updates: queue.Queue[str] = queue.Queue()
    stub = health_pb2_grpc.HealthStub(channel)
    call = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=60)

    def pump() -> None:
        try:
            for response in call:
                updates.put(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))
        except grpc.RpcError:
            updates.put("<closed>")

    threading.Thread(target=pump, daemon=True).start()
    return updates, call


def next_status(updates: queue.Queue[str], timeout: float = 20.0) -> str:
    return updates.get(timeout=timeout)


def test_sigterm_drains_health_then_exits_cleanly(server_factory: Factory) -> None:
    server = server_factory()
    with server.channel() as channel:
        updates, _ = watch_readiness(channel)
        assert next_status(updates) == "SERVING"
        server.process.send_signal(signal.SIGTERM)
        assert next_status(updates) == "NOT_SERVING"
        assert server.process.wait(timeout=20) == 0
    log = "".join(server.stderr_lines)
    events = [json.loads(line).get("event") for line in log.splitlines() if line.startswith("{")]
    assert events.index("shutdown") < events.index("stopped")


def test_killed_worker_is_restarted_and_readiness_follows(server_factory: Factory) -> None:
    server = server_factory("--worker-restart-backoff-s", "0.5")
    with server.channel() as channel:
        stub = pb_grpc.MoeControlServiceStub(channel)
        before = stub.ListWorkers(pb.ListWorkersRequest(), timeout=5).workers[0]
        updates, _ = watch_readiness(channel)
        assert next_status(updates) == "SERVING"
        os.kill(before.pid, signal.SIGKILL)
        assert next_status(updates) == "NOT_SERVING"
        # Without a platform the request needs the (dead) worker's profile.
        request = pb.SelectBackendRequest(spec_json=json.dumps({**SPEC, "platform": None}))
        with pytest.raises(grpc.RpcError) as caught:
            stub.SelectBackend(request, timeout=5)
        assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
        status = rpc_status.from_call(caught.value)  # type: ignore[arg-type]
        assert status is not None
        retry = error_details_pb2.RetryInfo()
        assert status.details[0].Unpack(retry) and retry.retry_delay.seconds == 1
        # A what-if answer needs no worker.
        what_if = pb.SelectBackendRequest(spec_json=json.dumps(SPEC))
        assert stub.SelectBackend(what_if, timeout=5).backend
        assert next_status(updates) == "SERVING"
        after = stub.ListWorkers(pb.ListWorkersRequest(), timeout=5)
        assert after.ready
        worker = after.workers[0]
        assert worker.restarts == 1
        assert worker.pid not in (0, before.pid)
        assert "SIGKILL" in worker.last_exit_reason, "".join(server.stderr_lines)
        try:  # the worker's own platform is known again (the CPU may have no backend)
            stub.SelectBackend(request, timeout=5)
        except grpc.RpcError as error:
            assert error.code() is grpc.StatusCode.FAILED_PRECONDITION
    import urllib.request

    assert server.metrics_url is not None
    with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
        text = response.read().decode()
    assert 'moe_control_worker_restarts_total{device="cpu",worker="0"} 1.0' in text
    assert 'moe_control_worker_ready{device="cpu",worker="0"} 1.0' in text


# ---------------------------------------------------------------------------------------
# Token auth


def test_bearer_token_is_required_except_for_health(server_factory: Factory) -> None:
    server = server_factory(env={"MOE_CONTROL_AUTH_TOKEN": "s3cret-token"})
    with server.channel() as channel:
        assert health_status(channel, SERVICE) == "SERVING"
        stub = pb_grpc.MoeControlServiceStub(channel)
        request = pb.SelectBackendRequest(spec_json=json.dumps(SPEC))
        for metadata in (
            (),
            (("authorization", "Bearer wrong"),),
            (("authorization", "s3cret-token"),),
        ):
            with pytest.raises(grpc.RpcError) as caught:
                stub.SelectBackend(request, timeout=5, metadata=metadata)
            assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
        good = (("authorization", "Bearer s3cret-token"),)
        assert stub.SelectBackend(request, timeout=5, metadata=good).backend == "MARLIN"
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.ConvertWeights(iter([]), timeout=5))
        assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(RemoteSelectionError) as refused:
        remote_select(server.address, SPEC, token="wrong")
    assert refused.value.code is grpc.StatusCode.UNAUTHENTICATED
    assert remote_select(server.address, SPEC, token="s3cret-token")["backend"] == "MARLIN"


# ---------------------------------------------------------------------------------------
# TLS and mTLS


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway CA, a server cert for localhost/127.0.0.1 and a client cert."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("pki")
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-subj", "/CN=test-ca", "-keyout", "ca.key", "-out", "ca.pem", cwd=d)  # fmt: skip
    for name, ext in (("server", ["-extfile", "san.ext"]), ("client", [])):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "2", "-out", f"{name}.pem", *ext, cwd=d)  # fmt: skip
    return d


def _secure(server: ServerProcess, pki: Path, client_cert: bool) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca.pem").read_bytes(),
        private_key=(pki / "client.key").read_bytes() if client_cert else None,
        certificate_chain=(pki / "client.pem").read_bytes() if client_cert else None,
    )
    return grpc.secure_channel(f"localhost:{server.port}", credentials)


def test_tls_accepts_verified_clients_and_refuses_plaintext(
    server_factory: Factory, pki: Path
) -> None:
    server = server_factory(
        "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"), ready=False
    )
    with _secure(server, pki, client_cert=False) as channel:
        assert wait_for(lambda: health_status(channel, SERVICE) == "SERVING", 20)
    with server.channel() as plaintext, pytest.raises(grpc.RpcError) as caught:
        health_status(plaintext, "", timeout=3)
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
    target = f"localhost:{server.port}"
    assert remote_select(target, SPEC, tls_ca=pki / "ca.pem")["backend"] == "MARLIN"


def test_mtls_requires_a_client_certificate(
    server_factory: Factory, pki: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = server_factory(
        "--tls-cert", str(pki / "server.pem"),
        "--tls-key", str(pki / "server.key"),
        "--tls-client-ca", str(pki / "ca.pem"),
        ready=False,
    )  # fmt: skip
    with _secure(server, pki, client_cert=True) as channel:
        assert wait_for(lambda: health_status(channel, SERVICE) == "SERVING", 20)
    with _secure(server, pki, client_cert=False) as channel, pytest.raises(grpc.RpcError) as caught:
        health_status(channel, "", timeout=3)
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
    result = remote_select(
        f"localhost:{server.port}",
        SPEC,
        tls_ca=pki / "ca.pem",
        tls_cert=pki / "client.pem",
        tls_key=pki / "client.key",
    )
    assert result["backend"] == "MARLIN"
    # The CLI: `select --server` with the client certificate, without it, with half of it.
    deployment = tmp_path / "deployment.json"
    deployment.write_text(json.dumps(SPEC))
    base = ["select", "--deployment", str(deployment), "--json"]
    base += ["--server", f"localhost:{server.port}", "--tls-ca", str(pki / "ca.pem")]
    capsys.readouterr()
    client = ["--tls-cert", str(pki / "client.pem"), "--tls-key", str(pki / "client.key")]
    assert cli_main([*base, *client]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["backend"] == "MARLIN"
    assert answer["server_platform"]["device"] == "cpu"
    assert cli_main(base) == 3  # the handshake fails: a transport error
    assert json.loads(capsys.readouterr().out)["error"]["type"] == "UNAVAILABLE"
    assert cli_main([*base, "--tls-cert", str(pki / "client.pem")]) == 2
    assert "--tls-key" in capsys.readouterr().out


def test_calls_beyond_max_concurrent_rpcs_are_resource_exhausted(server_factory: Factory) -> None:
    server = server_factory("--max-concurrent-rpcs", "1")
    with server.channel() as holder, server.channel() as other:
        # A long call holds the one slot. The server frees a finished call's slot just after
        # the client has its answer, so the readiness probe that started the server may
        # still hold it for a moment (seen under load): open the watch until it is admitted.
        for _ in range(50):
            updates, watch = watch_readiness(holder)
            status = next_status(updates)
            if status != "<closed>":
                break
            time.sleep(0.1)
        assert status == "SERVING"
        with pytest.raises(grpc.RpcError) as caught:
            health_status(other, "", timeout=5)
        assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        watch.cancel()
        assert wait_for(lambda: _serving_or_none(other), 10)


def _serving_or_none(channel: grpc.Channel) -> bool:
    try:
        return health_status(channel, "", timeout=2) == "SERVING"
    except grpc.RpcError:
        return False


def test_bad_settings_fail_fast(tmp_path: Path) -> None:
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--tls-cert", str(tmp_path / "x.pem")],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert "tls_cert and tls_key go together" in done.stderr
