"""Two GPUs behind one server: layers land on both, RunMoE runs on each, a whole-checkpoint
conversion spreads over both and writes what one GPU writes.

Needs at least two CUDA devices (skipped otherwise; `scripts/gpu_multi.sh` runs it on the
two-H200 machine). The server is the real `moe-control serve --devices auto`, which starts
one worker per visible GPU. That each layer is on its GPU is checked twice: by the listing
(its worker's device and kept-layer bytes) and by the device memory in use on each GPU
(cudaMemGetInfo, which sees every process's allocations).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from integration.serverproc import ServerProcess, launch, wait_for, wait_ready

from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc
from service.client.convert import (
    Connection,
    convert_checkpoint_remote,
    convert_layer_remote,
    header_for,
)
from service.client.run import run_request, tensor_from_pb
from service.formats.io.safetensors import tensor_bytes
from service.formats.io.streaming import FROM_TORCH, TensorSpec
from service.formats.readers import GPTQ, SourceQuantization, write_checkpoint
from service.formats.synthetic.checkpoints import SyntheticSpec, write_synthetic_checkpoint
from service.formats.synthetic.quantize import random_layer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs two CUDA GPUs",
    ),
]

QUANT = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
E, H, I, TOP_K = 8, 2048, 2048, 2  # noqa: E741
MIB = 1 << 20


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("multi-gpu") / "root"
    spec = SyntheticSpec(
        num_layers=4, num_experts=8, hidden_size=1024, intermediate_size=1024, group_size=128
    )
    write_synthetic_checkpoint(base / "mixtral", spec)
    return base


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[ServerProcess]:
    process = launch("--devices", "auto", "--data-root", str(root), env={}, timeout=300)
    wait_ready(process, timeout=300)
    with process.channel() as channel:
        stub = pb_grpc.MoeControlServiceStub(channel)
        count = torch.cuda.device_count()
        assert wait_for(
            lambda: stub.ListWorkers(pb.ListWorkersRequest()).ready_workers == count, 300
        ), "".join(process.stderr_lines[-50:])
    yield process
    process.stop()


@pytest.fixture(scope="module")
def stub(server: ServerProcess) -> Iterator[Any]:
    with server.channel() as channel:
        yield pb_grpc.MoeControlServiceStub(channel)


@pytest.fixture(scope="module")
def checkpoint() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    layer = random_layer(E, H, I, bits=4, group_size=128, symmetric=True, generator=gen)
    return write_checkpoint(GPTQ, layer, SourceQuantization(4, 128), naming="mixtral")


def used_bytes(device: int) -> int:
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free)


def keep(server: ServerProcess, tensors: dict[str, torch.Tensor], worker: int | None) -> Any:
    wire = {
        name: (
            TensorSpec.of(name, FROM_TORCH[str(t.dtype).removeprefix("torch.")], t.shape),
            memoryview(tensor_bytes(t)),
        )
        for name, t in tensors.items()
    }
    layer = {"num_experts": E, "top_k": TOP_K, "hidden_size": H, "intermediate_size": I}
    header = header_for(
        deployment_json=json.dumps({"hf_quantization_config": QUANT, "layer": layer}),
        backend="TRITON",
        keep_loaded=True,
        return_tensors=False,
        worker_index=worker,
    )
    result = convert_layer_remote(Connection(server.address, timeout=300), header, wire)
    assert result.summary is not None and result.summary.layer_id
    return result.summary


def test_layers_land_on_both_gpus_and_run_on_each(
    server: ServerProcess, stub: Any, checkpoint: dict[str, torch.Tensor]
) -> None:
    listing = stub.ListWorkers(pb.ListWorkersRequest(), timeout=30)
    devices = [w.device for w in listing.workers]
    assert devices[:2] == ["cuda:0", "cuda:1"], devices
    for worker in listing.workers:
        assert worker.total_memory_bytes > 0 and worker.device_name
    before = [used_bytes(i) for i in range(2)]
    # Unnamed: placement by kept-layer bytes puts equal layers on alternate GPUs.
    summaries = [keep(server, checkpoint, None) for _ in range(2)]
    ids = [s.layer_id for s in summaries]
    after = [used_bytes(i) for i in range(2)]
    listing = stub.ListWorkers(pb.ListWorkersRequest(), timeout=30)
    where = {lid: w.index for w in listing.workers for lid in w.layer_ids}
    assert sorted(where[i] for i in ids) == [0, 1], where
    layer_bytes = summaries[0].bytes_out
    for index in range(2):
        worker = listing.workers[index]
        assert worker.layer_bytes >= layer_bytes
        grown = after[index] - before[index]
        assert grown >= layer_bytes, f"cuda:{index} grew by {grown / MIB:.1f} MiB only"
    layers = {layer.layer_id: layer for layer in stub.ListLayers(pb.ListLayersRequest()).layers}
    for layer_id in ids:
        assert layers[layer_id].device == f"cuda:{where[layer_id]}"

    gen = torch.Generator().manual_seed(9)
    hidden = torch.randn(16, H, generator=gen).to(torch.bfloat16)
    logits = torch.randn(16, E, generator=gen)
    outputs = []
    for layer_id in ids:
        request = run_request(
            hidden, layer_id=layer_id, router_logits=logits, compare=True, iterations=3
        )
        response = stub.RunMoE(request, timeout=300)
        assert response.worker_index == where[layer_id]
        assert response.backend == "TRITON"
        assert response.max_abs_error < 0.1
        outputs.append(tensor_from_pb(response.output).float())
    # The same weights on two GPUs give the same answer (to bf16 rounding).
    assert float((outputs[0] - outputs[1]).norm() / outputs[1].norm()) < 1e-2


def test_checkpoint_spreads_over_both_gpus(server: ServerProcess, root: Path) -> None:
    connection = Connection(server.address, timeout=600)
    events: list[dict[str, Any]] = []
    spread = header_for(backend="TRITON", checkpoint=("mixtral", "out/two"))
    summary = convert_checkpoint_remote(connection, spread, events.append)
    alone = convert_checkpoint_remote(
        connection, header_for(backend="TRITON", checkpoint=("mixtral", "out/one"), worker_index=0)
    )
    assert summary.layers_converted == alone.layers_converted == 4
    logged = [json.loads(line) for line in server.stderr_lines if "convert_spread" in line]
    assert logged and sorted(set(logged[-1]["workers"])) == [0, 1]

    def tree(directory: Path) -> dict[str, bytes]:
        return {
            str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*"))
            if p.is_file()
        }

    assert tree(root / "out" / "two") == tree(root / "out" / "one")
    assert events[-1]["layers_done"] == events[-1]["layers_total"] == 4
