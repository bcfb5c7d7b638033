"""The client commands against a real server on loopback: the serve lines, --wait-ready and
--timeout, retries on the server's RetryInfo, `run --layer-id` on a held layer, health's
answer for an unknown service, and the server's log line for a cancelled conversion.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from integration.serverproc import SERVICE, ServerProcess, health_status, launch, wait_for
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc
from service.cli import main
from service.client.channel import Connection, retry_delay
from service.client.convert import convert_layer_remote, header_for
from service.client.run import deployment_pb, run_request
from service.formats.io.safetensors import tensor_bytes
from service.formats.io.streaming import FROM_TORCH, TensorSpec
from service.formats.readers import GPTQ, SourceQuantization, write_checkpoint
from service.formats.synthetic.checkpoints import SyntheticSpec, write_synthetic_checkpoint
from service.formats.synthetic.quantize import random_layer

QUANT = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
#: A held layer's shape unlike `moe-control run`'s defaults (8 experts, hidden 128).
E, H, I, TOP_K = 4, 64, 96, 2  # noqa: E741
#: A checkpoint with layers enough that a conversion is still running when it is cancelled.
MODEL = SyntheticSpec(num_layers=12, num_experts=8, hidden_size=256, intermediate_size=256)


class Started:
    """The server, and what its stdout said after the listening line."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.server.process.stdout is not None
        for line in self.server.process.stdout:
            self.lines.put(line.strip())


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli-client")
    write_synthetic_checkpoint(root / "model", MODEL)
    return root


@pytest.fixture(scope="module")
def started(data_root: Path) -> Iterator[Started]:
    process = launch("--worker-restart-backoff-s", "0.2", "--data-root", str(data_root))
    yield Started(process)
    process.stop()


@pytest.fixture(scope="module")
def ready_line(started: Started) -> tuple[str, str]:
    """The line after the listening one, and the readiness health when it came."""
    line = started.lines.get(timeout=60)
    with started.server.channel() as channel:
        return line, health_status(channel, SERVICE)


@pytest.fixture(scope="module")
def server(started: Started, ready_line: tuple[str, str]) -> ServerProcess:
    return started.server


def test_serve_says_ready_only_once_a_worker_is(ready_line: tuple[str, str]) -> None:
    line, readiness = ready_line
    assert line == "moe-control ready: 1 of 1 workers ready"
    assert readiness == "SERVING"


def _checkpoint() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    layer = random_layer(E, H, I, bits=4, group_size=32, symmetric=True, generator=gen)
    return write_checkpoint(GPTQ, layer, SourceQuantization(4, 32), naming="mixtral")


def _wire(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[TensorSpec, memoryview]]:
    return {
        name: (
            TensorSpec.of(name, FROM_TORCH[str(t.dtype).removeprefix("torch.")], t.shape),
            memoryview(tensor_bytes(t)),
        )
        for name, t in tensors.items()
    }


def _spec_json() -> str:
    import json

    layer = {"num_experts": E, "top_k": TOP_K, "hidden_size": H, "intermediate_size": I}
    return json.dumps({"hf_quantization_config": QUANT, "layer": layer})


@pytest.fixture
def held_layer(server: ServerProcess) -> str:
    header = header_for(
        deployment_json=_spec_json(), backend="EMULATION", keep_loaded=True, return_tensors=False
    )
    result = convert_layer_remote(
        Connection(server.address, timeout=60), header, _wire(_checkpoint())
    )
    assert result.summary is not None and result.summary.layer_id
    return result.summary.layer_id


def test_run_on_a_held_layer_takes_its_shape_and_the_servers_reference(
    server: ServerProcess, held_layer: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["run", "--server", server.address, "--layer-id", held_layer, "--tokens", "3"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert f"EMULATION on worker 0, layer {held_layer}: 3 tokens" in out
    assert "vs the server's fp32 reference" in out and out.rstrip().endswith(": ok")
    assert "None" not in out


def test_run_on_a_held_layer_fails_over_the_tolerance(
    server: ServerProcess, held_layer: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "--server", server.address, "--layer-id", held_layer, "--tolerance", "0"]
    assert main(argv) == 1
    assert "FAIL (> 0)" in capsys.readouterr().out


def test_run_on_a_held_layer_refuses_a_contradicting_shape(
    server: ServerProcess, held_layer: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # A flag that contradicts the held layer is a bad flag: one line, exit 2.
    argv = ["run", "--server", server.address, "--layer-id", held_layer, "--hidden", "128"]
    assert main(argv) == 2
    assert f"--hidden 128: the held layer has {H}" in capsys.readouterr().err


def test_run_on_a_layer_nobody_holds_lists_the_held_ones(
    server: ServerProcess, held_layer: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--server", server.address, "--layer-id", "nope"]) == 1
    err = capsys.readouterr().err
    assert "no worker holds layer 'nope'" in err and held_layer in err


def test_health_of_an_unknown_service_names_the_known_ones(
    server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["health", "--server", server.address, "--service", "foo"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("NOT_FOUND: the server reports no health for service 'foo'")
    assert "'' (liveness" in out and f"'{SERVICE}' (readiness" in out


def test_wait_ready_on_nothing_listening_waits_out_the_timeout(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Without the wait this is UNAVAILABLE at once (exit 3); with it, NOT_READY once the
    # timeout has passed (exit 1), and the message says how long it waited.
    argv = ["health", "--server", "127.0.0.1:1", "--ready", "--wait-ready", "--timeout", "1"]
    assert main(argv) == 1
    assert "not ready after 1." in capsys.readouterr().err


def _worker_pid(stub: Any) -> int:
    return int(stub.ListWorkers(pb.ListWorkersRequest(), timeout=10).workers[0].pid)


def _kill_worker(server: ServerProcess, stub: Any) -> None:
    os.kill(_worker_pid(stub), signal.SIGKILL)
    with server.channel() as channel:
        assert wait_for(lambda: health_status(channel, SERVICE) != "SERVING", 10)


def _inline_run() -> pb.RunMoERequest:
    gen = torch.Generator().manual_seed(1)
    spec = deployment_pb(QUANT, num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I)
    return run_request(
        torch.randn(2, H, generator=gen).to(torch.bfloat16),
        inline=(spec, _checkpoint()),
        router_logits=torch.randn(2, E, generator=gen),
        backend="EMULATION",
    )


def test_idempotent_calls_retry_as_the_servers_retry_info_says(server: ServerProcess) -> None:
    with server.channel() as channel:
        stub = pb_grpc.MoeControlServiceStub(channel)
        _kill_worker(server, stub)
        # Without retries: UNAVAILABLE, with the server's RetryInfo.
        with pytest.raises(grpc.RpcError) as caught:
            stub.RunMoE(_inline_run(), timeout=30)
        assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
        assert retry_delay(caught.value) == 1.0
        # With them: the same call succeeds once the restarted worker is ready.
        with Connection(server.address, timeout=120, max_retries=60).session() as session:
            response = session.unary("RunMoE", _inline_run())
        assert response.backend == "EMULATION"


def test_wait_ready_waits_for_a_restarting_worker(
    server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    with server.channel() as channel:
        _kill_worker(server, pb_grpc.MoeControlServiceStub(channel))
    argv = ["run", "--server", server.address, "--wait-ready", "--timeout", "120"]
    argv += ["--experts", "4", "--hidden", "64", "--intermediate", "64", "--tokens", "2"]
    status = main(argv)
    out = capsys.readouterr().out
    assert status == 0, out
    assert "EMULATION" in out and "an inline layer" in out


def test_a_cancelled_conversion_is_logged(server: ServerProcess) -> None:
    header = header_for(backend="TRITON", checkpoint=("model", "out/cancelled"))
    with server.channel() as channel:
        stub = pb_grpc.MoeControlServiceStub(channel)
        call = stub.ConvertWeights(iter([pb.ConvertWeightsRequest(header=header)]), timeout=60)
        first = next(call)
        assert first.WhichOneof("message") == "progress"
        call.cancel()

    def logged() -> bool:
        return any('"event": "convert_cancelled"' in line for line in server.stderr_lines)

    assert wait_for(logged, 10), "".join(server.stderr_lines[-20:])
    line = next(line for line in server.stderr_lines if "convert_cancelled" in line)
    assert '"mode": "checkpoint"' in line


def test_health_takes_a_url_and_exits_3_when_nothing_answers(
    server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--server http://HOST:PORT` is the same server; a refused connection is a transport
    error (exit 3, as every client command), not a NOT_SERVING answer (exit 1)."""
    assert main(["health", "--server", f"http://{server.address}/"]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"
    import socket

    with socket.socket() as probe:  # a port nobody listens on: bound, never listening
        probe.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{probe.getsockname()[1]}"
        assert main(["health", "--server", closed, "--timeout", "5"]) == 3
    assert capsys.readouterr().out.startswith("UNAVAILABLE")
