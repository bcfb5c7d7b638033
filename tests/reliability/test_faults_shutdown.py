"""Stopping the server while ConvertWeights streams are open, against the real server.

Two streams are in flight when the signal comes: an inline upload whose client is slow
(half its tensors sent) and a whole-checkpoint conversion in the worker. The server drains
for `--grace-s`, then ends what is still running: each client gets UNAVAILABLE or
CANCELLED (never a hang, never OK for work that was not done), the process exits 0, its
shared-memory segments and runtime directory are gone, nothing in the output directory is
half-written, and the conversion completes when run again, resuming what was finished.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from integration.serverproc import launch, wait_for, wait_ready

from reliability import faults
from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc
from service.client.convert import (
    Connection,
    convert_checkpoint_remote,
    convert_layer_remote,
    header_for,
    tensor_requests,
)
from service.formats.checkpoint.job import convert_checkpoint
from service.formats.checkpoint.plan import MANIFEST_NAME, plan_job
from service.formats.io.paths import DataRoot
from service.formats.synthetic.checkpoints import write_synthetic_checkpoint
from service.oracle import preset
from service.process import RUNTIME_PREFIX

#: What a client of a call the server ended may see.
ENDED = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
#: Shorter than what is left of the conversion when the signal comes.
GRACE_S = 0.1
LONG_MODEL = faults.LONG_MODEL


def test_sigterm_during_convert_streams(tmp_path: Path) -> None:
    data, segments = tmp_path / "root", tmp_path / "segments"
    segments.mkdir()
    write_synthetic_checkpoint(data / "model", LONG_MODEL, keep_layers=False)
    server = launch(
        "--data-root", str(data), "--segment-dir", str(segments), "--grace-s", str(GRACE_S)
    )  # fmt: skip
    try:
        wait_ready(server)
        wire = faults.checkpoint_tensors()
        inline = header_for(
            deployment_json=faults.spec_json(), backend="EMULATION", keep_loaded=True
        )
        messages = list(tensor_requests(inline, wire, chunk_bytes=4096))
        release = threading.Event()
        started = threading.Event()
        path_mode = header_for(backend="TRITON", checkpoint=("model", "out/stopped"))

        def convert() -> Any:
            def progress(event: dict[str, Any]) -> None:
                if event["stage"] == "converting":
                    started.set()

            return convert_checkpoint_remote(
                Connection(server.address, timeout=60), path_mode, progress
            )

        with server.channel() as channel, ThreadPoolExecutor(2) as pool:
            stub = pb_grpc.MoeControlServiceStub(channel)
            upload = stub.ConvertWeights(
                faults.stalled(messages, len(messages) // 2, release), timeout=60
            )
            upload_code = pool.submit(faults.code_of, lambda: upload)
            conversion = pool.submit(faults.code_of, convert)
            assert wait_for(lambda: any("-in-" in p.name for p in segments.rglob("*")), 10)
            assert started.wait(60), "the conversion never started"
            server.process.send_signal(signal.SIGTERM)
            try:
                assert upload_code.result(timeout=30) in ENDED
                assert conversion.result(timeout=30) in ENDED
            finally:
                release.set()
        assert server.process.wait(timeout=30) == 0, "".join(server.stderr_lines[-30:])
    finally:
        server.stop(signal.SIGKILL)
    # Nothing of the server is left: segments, runtime directory.
    assert list(segments.iterdir()) == []
    runtime = os.path.join(tempfile.gettempdir(), f"{RUNTIME_PREFIX}{server.process.pid}-*")
    assert glob.glob(runtime) == []
    # Nothing half-written: complete files only, no manifest yet; a dead writer's temp
    # file (if the worker had to be killed) is hidden and swept by the next run.
    out = data / "out" / "stopped"
    seen = faults.visible_outputs(out)
    assert MANIFEST_NAME not in seen
    for name in seen:
        if name.endswith(".safetensors"):
            faults.complete_safetensors(out / name)
    # The same conversion, run again (here in process, as `moe-control convert` would),
    # resumes and completes; every tensor matches the manifest.
    job = plan_job(
        "model", "out/stopped", root=DataRoot.at(data), platform=preset("cpu"), backend="TRITON"
    )
    result = convert_checkpoint(job)
    assert result.layers_converted + result.layers_skipped == LONG_MODEL.num_layers
    assert result.manifest_path is not None
    assert faults.temp_files(out) == []
    manifest = json.loads(result.manifest_path.read_text())
    for unit in manifest["units"]:
        if "tensors" in unit:
            actual = faults.complete_safetensors(out / unit["file"])
            assert actual == {n: t["sha256"] for n, t in unit["tensors"].items()}


def test_sigkill_leaves_segments_the_next_server_sweeps(tmp_path: Path) -> None:
    """A server killed outright deletes nothing: the segments of its calls in flight stay
    (in a pod's memory-backed /dev/shm, until the pod goes). The next server on the same
    segment base removes them as it makes its own directory."""
    base = tmp_path / "segments"
    base.mkdir()
    wire = faults.checkpoint_tensors()
    header = header_for(deployment_json=faults.spec_json(), backend="EMULATION")
    messages = list(tensor_requests(header, wire, chunk_bytes=4096))
    first = launch("--segment-dir", str(base))
    release = threading.Event()
    try:
        wait_ready(first)
        with first.channel() as channel, ThreadPoolExecutor(1) as pool:
            call = pb_grpc.MoeControlServiceStub(channel).ConvertWeights(
                faults.stalled(messages, len(messages) // 2, release), timeout=30
            )
            ended = pool.submit(faults.code_of, lambda: call)
            assert wait_for(lambda: any("-in-" in p.name for p in base.rglob("*")), 10)
            first.process.kill()
            release.set()
            assert ended.result(timeout=30) is grpc.StatusCode.UNAVAILABLE
    finally:
        release.set()
        first.stop(signal.SIGKILL)
    (dead,) = list(base.iterdir())
    assert faults.files_under(dead), "the killed server's segments should still be there"
    second = launch("--segment-dir", str(base))
    try:
        wait_ready(second)
        result = convert_layer_remote(Connection(second.address, timeout=60), header, wire)
        assert result.summary is not None
        assert not dead.exists(), "the dead server's segments were not swept"
        assert list(base.iterdir()) != [] and faults.files_under(base) == []
    finally:
        second.stop()
    assert list(base.iterdir()) == []
