"""Calls that end early or ask too much, against the real server (one for the module).

Clients that cancel mid-stream (ConvertWeights' tensor stream in and out, path mode's
progress stream), deadlines that pass during RunMoE and conversions, and kept layers past
the worker's layer budget. After each: the answer is the status the client caused
(CANCELLED, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED), the server and the same worker keep
serving, and the work is freed: no segment left, no layer registered for a call that did
not complete, no temp file, and the worker stops computing for the caller that left.
Finally 100 rounds of such calls, with the server's and the worker's descriptors and
resident memory read from /proc before and after, and the server's shared-memory files
checked gone once it stops.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from integration.serverproc import ServerProcess, launch, wait_for, wait_ready

from reliability import faults
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc
from service.client.convert import (
    Connection,
    convert_checkpoint_remote,
    header_for,
    tensor_requests,
)
from service.client.run import run_request
from service.formats.checkpoint.plan import MANIFEST_NAME
from service.process import RUNTIME_PREFIX

MODEL = faults.MODEL
#: The worker's layer budget here, and the size of one kept EMULATION layer (dense bf16
#: w13 and w2 of E experts): ten fit, the eleventh evicts.
BUDGET_MIB = 1
LAYER_BYTES = faults.E * 3 * faults.H * faults.I * 2
#: A worker this busy (share of a core) is still computing for someone.
IDLE = 0.1
#: Leak margins over 100 rounds (after 10 rounds of warm-up): descriptors must come back to
#: the same count; resident memory may move by allocator noise only.
FD_MARGIN = 2
SERVER_RSS_MARGIN = 4 << 20
WORKER_RSS_MARGIN = 8 << 20
ROUNDS = 100
#: The deadline of a path-mode conversion cut short. Its worker is stopped (SIGSTOP) once the
#: job reports progress, so the deadline passes mid-conversion however fast or loaded the
#: machine is; it only has to leave room for the first progress event to arrive.
PATH_DEADLINE_S = 10.0


@pytest.fixture(scope="module")
def shm() -> Iterator[Path]:
    """The server's segment directory lives under this one, on /dev/shm when there is one."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix="moe-control-faults-", dir=base))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def server(root: Path, shm: Path) -> Iterator[ServerProcess]:
    faults.model_into(root / "root" / "model")
    process = launch(
        "--data-root", str(root / "root"),
        "--segment-dir", str(shm),
        "--layer-budget-mib", str(BUDGET_MIB),
    )  # fmt: skip
    wait_ready(process)
    yield process
    alive = process.process.poll() is None
    assert process.stop() == 0 and alive, "".join(process.stderr_lines[-40:])
    # A stopped server leaves nothing in shared memory or in its runtime directory.
    assert faults.files_under(shm) == [] and list(shm.iterdir()) == []
    runtime = glob.glob(
        os.path.join(tempfile.gettempdir(), f"{RUNTIME_PREFIX}{process.process.pid}-*")
    )
    assert runtime == []


@pytest.fixture(scope="module")
def stub(server: ServerProcess) -> Iterator[Any]:
    with server.channel() as channel:
        yield pb_grpc.MoeControlServiceStub(channel)


@pytest.fixture(scope="module")
def wire() -> faults.Wire:
    return faults.checkpoint_tensors()


def worker_pid(stub: Any) -> int:
    return int(stub.ListWorkers(pb.ListWorkersRequest(), timeout=10).workers[0].pid)


def layers(stub: Any) -> list[Any]:
    return list(stub.ListLayers(pb.ListLayersRequest(), timeout=10).layers)


def segments(shm: Path) -> list[str]:
    return faults.files_under(shm)


def freed(stub: Any, shm: Path, pid: int) -> None:
    """The work of calls that ended is gone: no segment, no layer, an idle worker (the
    same one: nothing crashed)."""
    assert faults.wait_empty(lambda: segments(shm)) == []
    assert faults.wait_empty(lambda: [x.layer_id for x in layers(stub)]) == []
    assert faults.wait_idle(pid) < IDLE, "the worker still computes for a caller that left"
    assert worker_pid(stub) == pid


# ---------------------------------------------------------------------------------------
# Cancelled clients


def test_cancel_during_upload_registers_nothing(stub: Any, shm: Path, wire: faults.Wire) -> None:
    pid = worker_pid(stub)
    header = header_for(deployment_json=faults.spec_json(), backend="EMULATION", keep_loaded=True)
    messages = list(tensor_requests(header, wire, chunk_bytes=4096))
    release = threading.Event()
    call = stub.ConvertWeights(faults.stalled(messages, len(messages) // 2, release), timeout=30)
    assert wait_for(lambda: any("-in-" in p.name for p in shm.rglob("*")), 10), "no segment"
    call.cancel()
    release.set()
    assert faults.code_of(lambda: call) is grpc.StatusCode.CANCELLED
    freed(stub, shm, pid)


def test_cancel_while_results_stream_back_unloads_the_layer(
    stub: Any, shm: Path, wire: faults.Wire
) -> None:
    pid = worker_pid(stub)
    header = header_for(deployment_json=faults.spec_json(), backend="EMULATION", keep_loaded=True)
    header.max_chunk_bytes = 1024  # many response messages: the cancel lands among them
    call = stub.ConvertWeights(tensor_requests(header, wire), timeout=30)
    assert next(call).WhichOneof("message") == "tensor"
    call.cancel()
    assert faults.code_of(lambda: call) is grpc.StatusCode.CANCELLED
    freed(stub, shm, pid)


def test_cancel_path_mode_stops_the_job(stub: Any, shm: Path, root: Path) -> None:
    pid = worker_pid(stub)
    header = header_for(backend="TRITON", checkpoint=("model", "out/cancelled"))
    call = stub.ConvertWeights(iter([pb.ConvertWeightsRequest(header=header)]), timeout=60)
    for response in call:
        if response.progress.stage in ("converting", "converted"):
            call.cancel()
            break
    assert faults.code_of(lambda: call) is grpc.StatusCode.CANCELLED
    out = root / "root" / "out" / "cancelled"
    assert faults.wait_empty(lambda: faults.temp_files(out)) == []
    freed(stub, shm, pid)
    seen = faults.visible_outputs(out)
    assert MANIFEST_NAME not in seen
    for name in seen:
        if name.endswith(".safetensors"):
            faults.complete_safetensors(out / name)


# ---------------------------------------------------------------------------------------
# Deadlines


def test_run_moe_deadline_stops_the_forward(
    stub: Any, shm: Path, server: ServerProcess, wire: faults.Wire
) -> None:
    layer_id = faults.keep_layer(server, wire, faults.spec_json())
    pid = worker_pid(stub)
    # The whole run's work, in the worker's CPU seconds (what a load slows, not what it
    # adds): the run cut short by its deadline must stop far short of it.
    began = faults.cpu_seconds(pid)
    assert stub.RunMoE(faults.long_run(layer_id), timeout=600).backend == "EMULATION"
    whole = faults.cpu_seconds(pid) - began
    began = faults.cpu_seconds(pid)
    assert (
        faults.code_of(lambda: stub.RunMoE(faults.long_run(layer_id), timeout=0.5))
        is grpc.StatusCode.DEADLINE_EXCEEDED
    )
    assert faults.wait_idle(pid, timeout=60) < IDLE
    cut = faults.cpu_seconds(pid) - began
    assert cut < whole / 2, f"the forwards ran on for nobody: {cut:.2f} of {whole:.2f} CPU s"
    quick = faults.long_run(layer_id)
    quick.warmup_iterations, quick.timed_iterations = 0, 1
    assert stub.RunMoE(quick, timeout=30).backend == "EMULATION"
    stub.UnloadLayer(pb.UnloadLayerRequest(layer_id=layer_id), timeout=10)
    freed(stub, shm, pid)


def test_conversion_deadlines_then_resume(
    stub: Any, shm: Path, server: ServerProcess, root: Path, wire: faults.Wire
) -> None:
    pid = worker_pid(stub)
    header = header_for(backend="TRITON", checkpoint=("model", "out/deadline"))
    call = stub.ConvertWeights(
        iter([pb.ConvertWeightsRequest(header=header)]), timeout=PATH_DEADLINE_S
    )
    try:
        with contextlib.suppress(grpc.RpcError):  # the deadline may pass before any event
            for response in call:
                if response.progress.stage in ("converting", "converted"):
                    os.kill(pid, signal.SIGSTOP)  # the job cannot finish before the deadline
                    break
        assert faults.code_of(lambda: call) is grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        os.kill(pid, signal.SIGCONT)
    out = root / "root" / "out" / "deadline"
    assert faults.wait_empty(lambda: faults.temp_files(out)) == []
    freed(stub, shm, pid)
    # Inline: the client stops sending half way and the deadline passes.
    inline = header_for(deployment_json=faults.spec_json(), backend="EMULATION", keep_loaded=True)
    messages = list(tensor_requests(inline, wire, chunk_bytes=4096))
    release = threading.Event()
    stream = faults.stalled(messages, len(messages) // 2, release)
    try:
        code = faults.code_of(lambda: stub.ConvertWeights(stream, timeout=1))
    finally:
        release.set()
    assert code is grpc.StatusCode.DEADLINE_EXCEEDED
    freed(stub, shm, pid)
    # The conversion cut short by its deadline completes when run again.
    summary = convert_checkpoint_remote(Connection(server.address, timeout=120), header)
    assert summary.layers_converted + summary.layers_skipped == MODEL.num_layers
    assert (out / MANIFEST_NAME).exists() and faults.temp_files(out) == []


# ---------------------------------------------------------------------------------------
# Layer budget


def test_layers_past_the_budget_evict_lru_and_oversize_is_refused(
    stub: Any, shm: Path, server: ServerProcess, wire: faults.Wire
) -> None:
    pid = worker_pid(stub)
    restarts = stub.ListWorkers(pb.ListWorkersRequest(), timeout=10).workers[0].restarts
    fit = (BUDGET_MIB << 20) // LAYER_BYTES
    kept = [faults.keep_layer(server, wire, faults.spec_json()) for _ in range(fit)]
    assert [x.byte_size for x in layers(stub)] == [LAYER_BYTES] * fit
    # A forward is a use: the first layer becomes the most recent, the second the oldest.
    quick = faults.long_run(kept[0])
    quick.warmup_iterations, quick.timed_iterations = 0, 1
    stub.RunMoE(quick, timeout=30)
    newest = faults.keep_layer(server, wire, faults.spec_json())
    listed = {x.layer_id for x in layers(stub)}
    assert listed == {kept[0], *kept[2:], newest}
    assert sum(x.byte_size for x in layers(stub)) <= BUDGET_MIB << 20
    evicted = faults.long_run(kept[1])
    assert faults.code_of(lambda: stub.RunMoE(evicted, timeout=30)) is grpc.StatusCode.NOT_FOUND
    # One layer larger than the whole budget: refused, nothing evicted for it.
    big = faults.checkpoint_tensors(experts=8, hidden=256, intermediate=256)
    with pytest.raises(grpc.RpcError) as caught:
        faults.keep_layer(server, big, faults.spec_json(8, 256, 256))
    assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "layer budget" in (caught.value.details() or "")
    assert {x.layer_id for x in layers(stub)} == listed
    workers = stub.ListWorkers(pb.ListWorkersRequest(), timeout=10).workers[0]
    assert (workers.pid, workers.restarts) == (pid, restarts)
    for layer_id in listed:
        stub.UnloadLayer(pb.UnloadLayerRequest(layer_id=layer_id), timeout=10)
    freed(stub, shm, pid)


# ---------------------------------------------------------------------------------------
# Leaks


def one_round(
    stub: Any, layer_id: str, messages: list[pb.ConvertWeightsRequest], bad_hidden: Any
) -> list[grpc.StatusCode]:
    """A deadline, a cancel and two errors (one from the server, one from the worker)."""
    codes = [faults.code_of(lambda: stub.RunMoE(faults.long_run(layer_id), timeout=0.05))]
    release = threading.Event()
    call = stub.ConvertWeights(faults.stalled(messages, 3, release), timeout=10)
    time.sleep(0.01)
    call.cancel()
    release.set()
    codes.append(faults.code_of(lambda: call))
    codes.append(faults.code_of(lambda: stub.RunMoE(bad_hidden, timeout=10)))
    corrupt = list(messages)
    corrupt[1] = pb.ConvertWeightsRequest(tensor=messages[1].tensor)
    corrupt[1].tensor.sha256 = "0" * 64
    codes.append(faults.code_of(lambda: stub.ConvertWeights(iter(corrupt), timeout=10)))
    return codes


def test_no_descriptor_memory_or_segment_leaks_over_100_rounds(
    stub: Any, shm: Path, server: ServerProcess, wire: faults.Wire
) -> None:
    layer_id = faults.keep_layer(server, wire, faults.spec_json())
    header = header_for(deployment_json=faults.spec_json(), backend="EMULATION")
    messages = list(tensor_requests(header, wire, chunk_bytes=4096))
    inputs = faults.run_inputs()
    bad_hidden = run_request(
        torch.zeros(4, faults.H // 2, dtype=torch.bfloat16),
        layer_id=layer_id,
        router_logits=inputs["router_logits"][:4],
    )
    want = [
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.INVALID_ARGUMENT,
    ]
    server_pid, pid = server.process.pid, worker_pid(stub)

    def sample() -> dict[str, int]:
        assert faults.wait_empty(lambda: segments(shm)) == []
        faults.wait_idle(pid)
        return {
            "server_fds": faults.fd_count(server_pid),
            "worker_fds": faults.fd_count(pid),
            "server_rss": faults.rss_bytes(server_pid),
            "worker_rss": faults.rss_bytes(pid),
        }

    for _ in range(10):
        assert one_round(stub, layer_id, messages, bad_hidden) == want
    before = sample()
    began = time.monotonic()
    for number in range(ROUNDS):
        assert one_round(stub, layer_id, messages, bad_hidden) == want, f"round {number}"
    elapsed = time.monotonic() - began
    after = sample()
    print(f"\nleak check: {ROUNDS} rounds in {elapsed:.1f} s; before {before}; after {after}")
    for name, owner in (("server_fds", server_pid), ("worker_fds", pid)):
        settled = faults.wait_fds(owner, before[name] + FD_MARGIN)
        assert settled <= before[name] + FD_MARGIN, (name, faults.fd_targets(owner))
    assert after["server_rss"] - before["server_rss"] <= SERVER_RSS_MARGIN
    assert after["worker_rss"] - before["worker_rss"] <= WORKER_RSS_MARGIN
    assert worker_pid(stub) == pid
    assert [x.layer_id for x in layers(stub)] == [layer_id]
    stub.UnloadLayer(pb.UnloadLayerRequest(layer_id=layer_id), timeout=10)
