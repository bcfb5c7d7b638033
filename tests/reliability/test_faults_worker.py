"""kill -9 of the worker in the middle of work, against the real server (one per module).

What must hold after each kill (DESIGN.md, process model): the call in flight fails with
UNAVAILABLE and a RetryInfo (a client may retry it as it is); the server keeps answering;
readiness goes NOT_SERVING and back to SERVING once the supervisor has restarted the
worker; no segment is left; no output file is half-written (what a reader of the output
directory sees is complete, renamed files); and running the same conversion again resumes
(keeps what was finished) and ends byte for byte where an uninterrupted run ends, every
tensor matching the manifest's SHA-256.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from integration.serverproc import ServerProcess, health_status, launch, wait_ready

from reliability import faults
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc
from service.client.convert import Connection, convert_checkpoint_remote, header_for
from service.formats.checkpoint.plan import MANIFEST_NAME
from service.formats.synthetic.checkpoints import write_synthetic_checkpoint

MODEL = faults.MODEL
LONG_MODEL = faults.LONG_MODEL


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[ServerProcess]:
    faults.model_into(root / "root" / "model")
    process = launch(
        "--data-root", str(root / "root"),
        "--segment-dir", str(root / "segments"),
        "--worker-restart-backoff-s", "0.2",
        # A primary and a replica, as on a 2-core machine by default: calls reaching the
        # worker through the replica's forwarding must fail the same way.
        "--server-processes", "2",
    )  # fmt: skip
    wait_ready(process)
    yield process
    alive = process.process.poll() is None
    process.stop()
    assert alive, "the server died:\n" + "".join(process.stderr_lines[-40:])


@pytest.fixture(scope="module")
def stub(server: ServerProcess) -> Iterator[Any]:
    with server.channel() as channel:
        yield pb_grpc.MoeControlServiceStub(channel)


def worker(stub: Any) -> Any:
    return stub.ListWorkers(pb.ListWorkersRequest(), timeout=10).workers[0]


def kill_and_recover(server: ServerProcess, stub: Any, pid: int) -> None:
    """SIGKILL the worker; readiness must drop, then come back with a new worker."""
    before = worker(stub).restarts
    with server.channel() as channel:
        readiness = faults.Readiness(channel)
        assert readiness.next() == "SERVING"
        os.kill(pid, signal.SIGKILL)
        assert readiness.next() == "NOT_SERVING"
        # The server itself answers while its worker is down.
        assert health_status(channel) == "SERVING"
        assert readiness.wait_for("SERVING") == ["SERVING"]
        readiness.close()
    after = worker(stub)
    assert after.restarts == before + 1 and after.pid not in (0, pid)
    assert "SIGKILL" in after.last_exit_reason


def in_flight_error(future: Future[Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        future.result(timeout=60)
    return caught.value


def assert_retryable(error: grpc.RpcError) -> None:
    assert error.code() is grpc.StatusCode.UNAVAILABLE, error
    delay = faults.retry_delay_s(error)
    assert delay is not None and 0 < delay <= 5, f"no RetryInfo: {error}"


#: Calls in flight at the kill, each on its own connection (the kernel spreads connections
#: over the two server processes, so some go through the replica).
CALLS = 4


def test_kill_during_run_moe(server: ServerProcess, stub: Any, root: Path) -> None:
    layer_id = faults.keep_layer(server, faults.checkpoint_tensors(), faults.spec_json())
    pid = worker(stub).pid
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.insecure_channel(server.address, options=options) for _ in range(CALLS)]
    try:
        with ThreadPoolExecutor(CALLS) as pool:
            request = faults.long_run(layer_id)
            futures = [
                pool.submit(pb_grpc.MoeControlServiceStub(ch).RunMoE, request, timeout=60)
                for ch in channels
            ]
            # The calls are in the worker once the worker computes (its CPU time moves).
            assert faults.wait_busy(pid), "the RunMoE calls never reached the worker"
            kill_and_recover(server, stub, pid)
            for future in futures:
                assert_retryable(in_flight_error(future))
    finally:
        for ch in channels:
            ch.close()
    assert faults.wait_empty(lambda: faults.files_under(root / "segments")) == []
    # Kept layers lived in the dead worker: the id is gone (NOT_FOUND, not a hang or a crash).
    assert list(stub.ListLayers(pb.ListLayersRequest(), timeout=10).layers) == []
    with pytest.raises(grpc.RpcError) as caught:
        stub.RunMoE(faults.long_run(layer_id), timeout=30)
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND
    # The new worker serves: keep the layer again and run it.
    again = faults.keep_layer(server, faults.checkpoint_tensors(), faults.spec_json())
    request = faults.long_run(again)
    request.warmup_iterations, request.timed_iterations = 0, 1
    assert stub.RunMoE(request, timeout=60).backend == "EMULATION"


def test_kill_during_checkpoint_conversion_then_resume(
    server: ServerProcess, stub: Any, root: Path
) -> None:
    data = root / "root"
    write_synthetic_checkpoint(data / "model-long", LONG_MODEL, keep_layers=False)
    connection = Connection(server.address, timeout=120)
    reference = convert_checkpoint_remote(
        connection, header_for(backend="TRITON", checkpoint=("model-long", "out/reference"))
    )
    assert reference.layers_converted == LONG_MODEL.num_layers

    header = header_for(backend="TRITON", checkpoint=("model-long", "out/killed"))
    pid = worker(stub).pid
    first_done = threading.Event()

    def convert() -> pb.ConvertSummary:
        def progress(event: dict[str, Any]) -> None:
            if event["stage"] == "converted":
                first_done.set()

        return convert_checkpoint_remote(connection, header, progress)

    out = data / "out" / "killed"
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(convert)
        assert first_done.wait(60), "no layer was ever finished"
        # Strike while the next layer's file is being written, if the poll catches it.
        faults.wait_for_file(out, ".moe-layer-", timeout=5.0)
        kill_and_recover(server, stub, pid)
        assert_retryable(in_flight_error(future))

    # What a reader sees: complete files only, each equal to the uninterrupted run's; the
    # manifest (the sign of a whole directory) is not there yet.
    seen = faults.visible_outputs(out)
    assert MANIFEST_NAME not in seen
    reference_files = faults.visible_outputs(data / "out" / "reference")
    for name, digest in seen.items():
        assert digest == reference_files[name], f"{name} differs from the reference"
        if name.endswith(".safetensors"):
            faults.complete_safetensors(out / name)
    # A kill during a write leaves the dead writer's temp file: hidden, never renamed, and
    # swept by the next run (it can be as large as a layer).
    stale = faults.temp_files(out)
    assert all(name.startswith(".") for name in stale)

    resumed = convert_checkpoint_remote(connection, header)
    assert resumed.layers_skipped >= 1, "the layer finished before the kill was redone"
    assert resumed.layers_converted + resumed.layers_skipped == LONG_MODEL.num_layers
    assert faults.temp_files(out) == [], f"left behind: {stale}"
    assert faults.visible_outputs(out) == reference_files
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    for unit in manifest["units"]:
        if "tensors" in unit:
            actual = faults.complete_safetensors(out / unit["file"])
            assert actual == {n: t["sha256"] for n, t in unit["tensors"].items()}
    assert faults.wait_empty(lambda: faults.files_under(root / "segments")) == []
