"""What the fault tests share: a small kept layer, readiness watching, the retry
information of an error, and what a process holds (open descriptors, resident memory, CPU
time) read from /proc, so a leak shows as a number that grew.

Why /proc and not the server's metrics: a leak the server does not know about (a file
descriptor a failed call never closed, a thread still computing for a caller that left) is
exactly what the metrics cannot show.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import torch
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from integration.serverproc import SERVICE, ServerProcess

from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.client.convert import Connection, convert_layer_remote, header_for
from service.client.run import run_request
from service.formats.io.safetensors import SafetensorsFile, hash_tensors, tensor_bytes
from service.formats.io.streaming import FROM_TORCH, TensorSpec
from service.formats.readers import GPTQ, SourceQuantization, write_checkpoint
from service.formats.synthetic.checkpoints import SyntheticSpec, write_synthetic_checkpoint
from service.formats.synthetic.quantize import random_layer

QUANT = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
E, H, I, TOP_K = 4, 64, 64, 2  # noqa: E741
#: A whole checkpoint big enough that a fault after its first finished layer lands while
#: others are in work (about a second to convert on a quiet 2-core machine).
MODEL = SyntheticSpec(
    num_layers=6, num_experts=8, hidden_size=512, intermediate_size=512, shards=3, fast=True
)
#: Four times `MODEL`'s layers: for the tests that strike in the middle of a whole
#: conversion, which the direct repack routes finish in a few tenths of a second at
#: `MODEL`'s size (a strike after "the first layer is done" could find it all done).
LONG_MODEL = dataclasses.replace(MODEL, num_layers=4 * MODEL.num_layers)
#: The most warm-up plus timed forwards one RunMoE may ask for: seconds of CPU work even at
#: this layer's size, so a call is still running when the test strikes.
LONG_RUN = {"warmup": 1000, "iterations": 1000}

Wire = dict[str, tuple[TensorSpec, memoryview]]


def spec_json(experts: int = E, hidden: int = H, intermediate: int = I) -> str:
    layer = {
        "num_experts": experts,
        "top_k": TOP_K,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
    }
    return json.dumps({"hf_quantization_config": QUANT, "layer": layer})


def checkpoint_tensors(
    experts: int = E, hidden: int = H, intermediate: int = I, seed: int = 11
) -> Wire:
    """One GPTQ layer's checkpoint tensors, as ConvertWeights streams them."""
    gen = torch.Generator().manual_seed(seed)
    layer = random_layer(
        experts, hidden, intermediate, bits=4, group_size=32, symmetric=True, generator=gen
    )
    tensors = write_checkpoint(GPTQ, layer, SourceQuantization(4, 32), naming="mixtral")
    return {
        name: (
            TensorSpec.of(name, FROM_TORCH[str(t.dtype).removeprefix("torch.")], t.shape),
            memoryview(tensor_bytes(t)),
        )
        for name, t in tensors.items()
    }


def keep_layer(server: ServerProcess, wire: Wire, spec: str, backend: str = "EMULATION") -> str:
    """Convert `wire` with keep_loaded; the kept layer's id."""
    header = header_for(
        deployment_json=spec, backend=backend, keep_loaded=True, return_tensors=False
    )
    result = convert_layer_remote(Connection(server.address, timeout=60), header, wire)
    assert result.summary is not None and result.summary.layer_id
    return result.summary.layer_id


def run_inputs(tokens: int = 32, seed: int = 0, hidden: int = H) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16),
        "router_logits": torch.randn(tokens, E, generator=gen),
    }


def long_run(layer_id: str) -> pb.RunMoERequest:
    """A RunMoE that keeps the worker busy for seconds (the most iterations allowed)."""
    tensors = run_inputs()
    return run_request(
        tensors["hidden_states"],
        layer_id=layer_id,
        router_logits=tensors["router_logits"],
        **LONG_RUN,
    )


# ---------------------------------------------------------------------------------------
# Errors


def retry_delay_s(error: grpc.RpcError) -> float | None:
    """The RetryInfo delay an error carries (None without one)."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    for detail in status.details if status is not None else []:
        retry = error_details_pb2.RetryInfo()
        if detail.Unpack(retry):
            return float(retry.retry_delay.ToNanoseconds()) / 1e9
    return None


def code_of(call: Callable[[], Any]) -> grpc.StatusCode:
    """The status code a call ends with (OK when it returns)."""
    try:
        result = call()
        if isinstance(result, Iterator):
            for _ in result:
                pass
    except grpc.RpcError as error:
        return error.code()  # type: ignore[attr-defined,no-any-return]
    return grpc.StatusCode.OK


def stalled(
    messages: list[pb.ConvertWeightsRequest], after: int, release: threading.Event
) -> Iterator[pb.ConvertWeightsRequest]:
    """A client stream that sends `after` messages, then waits (a slow or stuck client)."""
    for number, message in enumerate(messages):
        if number == after:
            release.wait(30)
        yield message


# ---------------------------------------------------------------------------------------
# Readiness


class Readiness:
    """The readiness service's status changes (grpc.health.v1 Watch), as they come."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.updates: queue.Queue[str] = queue.Queue()
        stub = health_pb2_grpc.HealthStub(channel)
        self._call = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=120)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        try:
            for response in self._call:
                name = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
                self.updates.put(name)
        except grpc.RpcError:
            self.updates.put("<closed>")

    def next(self, timeout: float = 30.0) -> str:
        return self.updates.get(timeout=timeout)

    def wait_for(self, status: str, timeout: float = 30.0) -> list[str]:
        """Every status seen up to and including `status`."""
        seen: list[str] = []
        deadline = time.monotonic() + timeout
        while not seen or seen[-1] != status:
            seen.append(self.updates.get(timeout=max(0.01, deadline - time.monotonic())))
        return seen

    def close(self) -> None:
        self._call.cancel()


# ---------------------------------------------------------------------------------------
# Processes (/proc)


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_targets(pid: int) -> list[str]:
    """What each open descriptor of `pid` points at (for a failing leak check's message)."""
    found = []
    for name in sorted(os.listdir(f"/proc/{pid}/fd"), key=int):
        try:
            found.append(f"{name} -> {os.readlink(f'/proc/{pid}/fd/{name}')}")
        except OSError:
            continue
    return found


def wait_fds(pid: int, at_most: int, timeout: float = 60.0) -> int:
    """The descriptor count of `pid` once it is at most `at_most`, or after `timeout`.

    A worker keeps its mappings of the server's pooled segments between calls and closes an
    idle one within about twice its idle time (service.worker.mapped); a descriptor still open
    after waiting this long is a leak, one closing on schedule is not.
    """
    deadline = time.monotonic() + timeout
    count = fd_count(pid)
    while count > at_most and time.monotonic() < deadline:
        time.sleep(0.1)
        count = fd_count(pid)
    return count


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy_fraction(pid: int, window_s: float = 0.5) -> float:
    """Share of one core a process used over `window_s` (a job still running shows ~1)."""
    before = cpu_seconds(pid)
    time.sleep(window_s)
    return (cpu_seconds(pid) - before) / window_s


def wait_busy(pid: int, cpu_s: float = 0.2, timeout: float = 60.0) -> bool:
    """Wait until the process has used `cpu_s` more CPU time (it is computing; on a loaded
    machine it may get only a sliver of a core, so this counts work, not a share)."""
    start = cpu_seconds(pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cpu_seconds(pid) - start >= cpu_s:
            return True
        time.sleep(0.05)
    return False


def wait_idle(pid: int, timeout: float = 60.0, threshold: float = 0.1) -> float:
    """Wait until the process is (nearly) idle; the last busy fraction measured."""
    deadline = time.monotonic() + timeout
    busy = busy_fraction(pid)
    while busy > threshold and time.monotonic() < deadline:
        busy = busy_fraction(pid)
    return busy


# ---------------------------------------------------------------------------------------
# Files


def temp_files(directory: Path) -> list[str]:
    """Temp files of atomic writes (`.NAME.tmp-PID-RANDOM`) anywhere under `directory`."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if ".tmp-" in p.name)


def files_under(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def wait_empty(list_them: Callable[[], list[str]], timeout: float = 60.0) -> list[str]:
    """What `list_them` still lists after waiting for it to empty (cleanup runs as calls end)."""
    deadline = time.monotonic() + timeout
    found = list_them()
    while found and time.monotonic() < deadline:
        time.sleep(0.05)
        found = list_them()
    return found


def visible_outputs(directory: Path) -> dict[str, str]:
    """Every file a reader of `directory` sees (no dot files), by SHA-256 of its bytes."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file() and not p.name.startswith(".")
    }


def complete_safetensors(path: Path) -> dict[str, str]:
    """A safetensors file's tensors by SHA-256 (raises if the file is cut short)."""
    with SafetensorsFile(path):
        pass
    return hash_tensors(path)


def wait_for_file(directory: Path, prefix: str, timeout: float) -> bool:
    """Poll (tightly) until a file whose name starts with `prefix` exists in `directory`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if any(name.startswith(prefix) for name in os.listdir(directory)):
                return True
        except FileNotFoundError:
            pass
        time.sleep(0.0005)
    return False


_MODEL_DIR: list[Path] = []


def model_into(target: Path) -> Path:
    """`MODEL`, written once per test process and hard-linked into `target` (several
    servers' data roots read it: a hard link is a plain file inside each root, where a
    symlink out of the root would be refused)."""
    if not _MODEL_DIR:
        base = Path(tempfile.mkdtemp(prefix="moe-control-faults-model-"))
        atexit.register(shutil.rmtree, base, True)
        write_synthetic_checkpoint(base / "model", MODEL, keep_layers=False)
        _MODEL_DIR.append(base / "model")
    target.mkdir(parents=True, exist_ok=True)
    for path in _MODEL_DIR[0].iterdir():
        os.link(path, target / path.name)
    return target
