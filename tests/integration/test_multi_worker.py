"""Several workers behind one server, over real gRPC: two CPU workers (`--cpu-workers 2`)
stand in for two GPUs, through the same code paths.

Kept layers spread over the workers (least kept-layer bytes first) or go where a request
names; RunMoE routes each layer id to its worker; ListWorkers shows each worker's device,
memory (total, kept-layer bytes, budget) and layer ids. A whole-checkpoint conversion
spreads its layers over both workers and writes byte for byte what one worker writes, its
progress counts growing to the totals. Killing one worker leaves the server SERVING on the
other: its layers keep running, the dead worker's answer NOT_FOUND saying it restarted.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from integration.serverproc import SERVICE, ServerProcess, health_status, launch, wait_for
from integration.serverproc import wait_ready as wait_serving
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc
from service.api.generated.moe_control.v1 import platform_pb2
from service.client.convert import (
    Connection,
    convert_checkpoint_remote,
    convert_layer_remote,
    header_for,
)
from service.client.run import run_request, tensor_from_pb
from service.formats.checkpoint.plan import MANIFEST_NAME
from service.formats.io.safetensors import tensor_bytes
from service.formats.io.streaming import FROM_TORCH, TensorSpec
from service.formats.readers import GPTQ, SourceQuantization, write_checkpoint
from service.formats.synthetic.checkpoints import SyntheticSpec, write_synthetic_checkpoint
from service.formats.synthetic.quantize import random_layer

QUANT = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
E, H, I = 4, 64, 64  # noqa: E741
CHECKPOINT = SyntheticSpec(num_layers=4, num_experts=4, hidden_size=128, intermediate_size=128)
BUDGET_MIB = 64


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("multi")
    write_synthetic_checkpoint(base / "root" / "mixtral", CHECKPOINT)
    return base / "root"


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[ServerProcess]:
    process = launch(
        "--cpu-workers",
        "2",
        "--data-root",
        str(root),
        "--layer-budget-mib",
        str(BUDGET_MIB),
        "--worker-restart-backoff-s",
        "0.2",
    )
    wait_serving(process)
    with process.channel() as channel:
        stub = pb_grpc.MoeControlServiceStub(channel)
        assert wait_for(lambda: stub.ListWorkers(pb.ListWorkersRequest()).ready_workers == 2)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def stub(server: ServerProcess) -> Iterator[Any]:
    with server.channel() as channel:
        yield pb_grpc.MoeControlServiceStub(channel)


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    layer = random_layer(E, H, I, bits=4, group_size=32, symmetric=True, generator=gen)
    return write_checkpoint(GPTQ, layer, SourceQuantization(4, 32), naming="mixtral")


def keep(server: ServerProcess, tensors: dict[str, torch.Tensor], worker: int | None = None) -> str:
    wire = {
        name: (
            TensorSpec.of(name, FROM_TORCH[str(t.dtype).removeprefix("torch.")], t.shape),
            memoryview(tensor_bytes(t)),
        )
        for name, t in tensors.items()
    }
    spec = {"hf_quantization_config": QUANT, "layer": {"num_experts": E, "top_k": 2}}
    spec["layer"].update(hidden_size=H, intermediate_size=I)
    header = header_for(
        deployment_json=json.dumps(spec),
        backend="EMULATION",
        keep_loaded=True,
        return_tensors=False,
        worker_index=worker,
    )
    result = convert_layer_remote(Connection(server.address, timeout=60), header, wire)
    assert result.summary is not None and result.summary.layer_id
    return result.summary.layer_id


def run(stub: Any, layer_id: str) -> pb.RunMoEResponse:
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, H, generator=gen).to(torch.bfloat16)
    request = run_request(hidden, layer_id=layer_id, router_logits=torch.randn(3, E, generator=gen))
    response: pb.RunMoEResponse = stub.RunMoE(request, timeout=60)
    assert tuple(tensor_from_pb(response.output).shape) == (3, H)
    return response


def workers(stub: Any) -> list[Any]:
    return list(stub.ListWorkers(pb.ListWorkersRequest(), timeout=10).workers)


def test_two_cpu_workers_listed_with_memory(stub: Any) -> None:
    listing = stub.ListWorkers(pb.ListWorkersRequest(), timeout=10)
    assert listing.ready and listing.ready_workers == 2
    assert [(w.index, w.device) for w in listing.workers] == [(0, "cpu"), (1, "cpu")]
    assert len({w.pid for w in listing.workers}) == 2
    for worker in listing.workers:
        assert worker.state == platform_pb2.WORKER_STATE_READY
        assert worker.layer_budget_bytes == BUDGET_MIB * 1024 * 1024


def test_kept_layers_spread_and_route_to_their_worker(
    server: ServerProcess, stub: Any, tensors: dict[str, torch.Tensor]
) -> None:
    before = {w.index: len(w.layer_ids) for w in workers(stub)}
    first, second = keep(server, tensors), keep(server, tensors)
    where = {lid: w.index for w in workers(stub) for lid in w.layer_ids}
    # Least kept-layer bytes first: equal layers alternate between the two workers.
    assert {where[first], where[second]} == {0, 1}, where
    for layer_id in (first, second):
        assert run(stub, layer_id).worker_index == where[layer_id]
    named = keep(server, tensors, worker=1)
    listing = {w.index: w for w in workers(stub)}
    assert named in listing[1].layer_ids
    assert run(stub, named).worker_index == 1
    for index, worker in listing.items():
        assert len(worker.layer_ids) == before[index] + (2 if index == 1 else 1)
        assert worker.layer_bytes > 0
        assert worker.layer_bytes <= worker.layer_budget_bytes
    layers = stub.ListLayers(pb.ListLayersRequest(), timeout=10).layers
    assert {(layer.layer_id, layer.worker_index) for layer in layers} >= {
        (first, where[first]),
        (second, where[second]),
        (named, 1),
    }
    freed = stub.UnloadLayer(pb.UnloadLayerRequest(layer_id=named), timeout=10).freed_bytes
    assert freed > 0
    assert named not in {lid for w in workers(stub) for lid in w.layer_ids}


def tree(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def test_checkpoint_spreads_over_both_workers_identical_to_one(
    server: ServerProcess, root: Path
) -> None:
    connection = Connection(server.address, timeout=120)
    events: list[dict[str, Any]] = []
    spread = header_for(backend="TRITON", checkpoint=("mixtral", "out/two"))
    summary = convert_checkpoint_remote(connection, spread, events.append)
    single = header_for(backend="TRITON", checkpoint=("mixtral", "out/one"), worker_index=0)
    alone = convert_checkpoint_remote(connection, single)

    assert summary.manifest_path == f"out/two/{MANIFEST_NAME}"
    assert (summary.layers_converted, summary.layers_skipped) == (CHECKPOINT.num_layers, 0)
    assert (summary.bytes_in, summary.bytes_out) == (alone.bytes_in, alone.bytes_out)
    assert [(t.name, t.sha256) for t in summary.tensors] == [
        (t.name, t.sha256) for t in alone.tensors
    ]
    two, one = tree(root / "out" / "two"), tree(root / "out" / "one")
    assert sorted(two) == sorted(one)
    assert [name for name in two if two[name] != one[name]] == []

    logged = [json.loads(line) for line in server.stderr_lines if "convert_spread" in line]
    assert logged and sorted(set(logged[-1]["workers"])) == [0, 1]
    assert sum(logged[-1]["layers_by_worker"].values()) == CHECKPOINT.num_layers
    assert {"convert", "write_hash", "hash_sources"} <= set(logged[-1]["stage_seconds"])

    assert events[0]["stage"] == "planning" and events[-1]["stage"] == "finalizing"
    total_layers, total_bytes = events[0]["layers_total"], events[0]["bytes_total"]
    assert total_layers == CHECKPOINT.num_layers
    for before, after in itertools.pairwise(events):
        assert after["layers_done"] >= before["layers_done"]
        assert after["bytes_done"] >= before["bytes_done"]
        assert (after["layers_total"], after["bytes_total"]) == (total_layers, total_bytes)
    assert (events[-1]["layers_done"], events[-1]["bytes_done"]) == (total_layers, total_bytes)
    assert sum(e["stage"] == "converted" for e in events) == CHECKPOINT.num_layers

    again = convert_checkpoint_remote(connection, spread)  # a re-run only verifies
    assert (again.layers_converted, again.layers_skipped) == (0, CHECKPOINT.num_layers)
    assert tree(root / "out" / "two") == two


def test_killing_one_worker_leaves_the_other_serving(
    server: ServerProcess, stub: Any, tensors: dict[str, torch.Tensor], root: Path
) -> None:
    """Last in the module: it kills worker 1, in the middle of a spread conversion."""
    on_zero, on_one = keep(server, tensors, worker=0), keep(server, tensors, worker=1)
    victim = workers(stub)[1]
    seen: dict[str, str] = {}

    def kill_once(event: dict[str, Any]) -> None:
        if seen or event["stage"] != "converted":
            return
        os.kill(victim.pid, signal.SIGKILL)
        assert wait_for(lambda: workers(stub)[1].state != platform_pb2.WORKER_STATE_READY, 30)
        with server.channel() as channel:  # readiness: one worker of two is enough
            seen["health"] = health_status(channel, SERVICE)

    connection = Connection(server.address, timeout=120)
    header = header_for(backend="TRITON", checkpoint=("mixtral", "out/killed"))
    summary = convert_checkpoint_remote(connection, header, kill_once)
    assert seen == {"health": "SERVING"}
    # The dead worker's range went back to the queue; the other worker finished the job.
    assert summary.layers_converted + summary.layers_skipped == CHECKPOINT.num_layers
    if not (root / "out" / "one").exists():
        single = header_for(backend="TRITON", checkpoint=("mixtral", "out/one"), worker_index=0)
        convert_checkpoint_remote(connection, single)
    assert tree(root / "out" / "killed") == tree(root / "out" / "one")

    assert wait_for(lambda: workers(stub)[1].restarts == victim.restarts + 1, timeout=30)
    assert run(stub, on_zero).worker_index == 0
    with pytest.raises(grpc.RpcError) as caught:
        run(stub, on_one)
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND
    message = caught.value.details() or ""
    assert on_one in message and "worker 1" in message and "restarted" in message
    assert "SIGKILL" in message
    assert wait_for(lambda: stub.ListWorkers(pb.ListWorkersRequest()).ready_workers == 2, 30)
    listing = {w.index: w for w in workers(stub)}
    assert on_zero in listing[0].layer_ids and on_one not in listing[1].layer_ids
    with pytest.raises(grpc.RpcError) as again:
        run(stub, on_one)  # still gone after the worker came back, still explained
    assert again.value.code() is grpc.StatusCode.NOT_FOUND and "restarted" in (
        again.value.details() or ""
    )
    assert run(stub, on_zero).worker_index == 0
