"""`moe-control presets`, `workers`, `layers`, `unload` and the fleet matrix against a real
server on loopback (a primary and a replica, as the shared fixture starts it)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from integration.serverproc import ServerProcess
from service.cli import main
from service.client.convert import Connection, convert_layer_remote, header_for
from service.formats.io.safetensors import tensor_bytes
from service.formats.io.streaming import FROM_TORCH, TensorSpec
from service.formats.readers import GPTQ, SourceQuantization, write_checkpoint
from service.formats.synthetic.quantize import random_layer

QUANT = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
E, H, I, TOP_K = 4, 64, 64, 2  # noqa: E741
QWEN = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "quantization_config": {**QUANT, "group_size": 128},
}


def cli_json(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, Any]:
    status = main(args)
    return status, json.loads(capsys.readouterr().out)


def keep_layer(server: ServerProcess) -> str:
    """A small GPTQ layer converted for EMULATION and kept on worker 0."""
    layer = random_layer(
        E, H, I, bits=4, group_size=32, symmetric=True, generator=torch.Generator().manual_seed(3)
    )
    tensors = write_checkpoint(GPTQ, layer, SourceQuantization(4, 32), naming="mixtral")
    wire = {
        name: (
            TensorSpec.of(name, FROM_TORCH[str(t.dtype).removeprefix("torch.")], t.shape),
            memoryview(tensor_bytes(t)),
        )
        for name, t in tensors.items()
    }
    spec = {
        "hf_quantization_config": QUANT,
        "layer": {"num_experts": E, "top_k": TOP_K, "hidden_size": H, "intermediate_size": I},
    }
    header = header_for(
        deployment_json=json.dumps(spec),
        backend="EMULATION",
        keep_loaded=True,
        return_tensors=False,
    )
    result = convert_layer_remote(Connection(server.address, timeout=60), header, wire)
    assert result.summary is not None and result.summary.layer_id
    return result.summary.layer_id


def test_presets_from_the_server_are_the_local_ones(
    server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["presets", "--json"]) == 0
    local = json.loads(capsys.readouterr().out)
    status, remote = cli_json(["presets", "--server", server.address, "--json"], capsys)
    assert status == 0
    # The server lists them by name; the same presets, each with the same profile.
    assert sorted(remote, key=lambda p: p["name"]) == sorted(local, key=lambda p: p["name"])


def test_workers_show_the_ready_cpu_worker(
    server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    status, listing = cli_json(
        ["workers", "--server", server.address, "--json", "--wait-ready"], capsys
    )
    assert status == 0
    assert listing["ready"] is True and listing["ready_workers"] == 1
    (worker,) = listing["workers"]
    assert (worker["index"], worker["device"], worker["state"]) == (0, "cpu", "WORKER_STATE_READY")
    assert worker["platform"]["device"] == "cpu"
    assert worker["pid"] > 0
    assert main(["workers", "--server", server.address]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "server ready: 1 of 1 ready"
    assert table[2].split()[:2] == ["0", "cpu"] and "ready" in table[2].split()


def test_layers_and_unload(server: ServerProcess, capsys: pytest.CaptureFixture[str]) -> None:
    layer_id = keep_layer(server)
    status, layers = cli_json(["layers", "--server", server.address, "--json"], capsys)
    assert status == 0
    (held,) = [layer for layer in layers if layer["layer_id"] == layer_id]
    assert held["format"]["backend"] == "EMULATION"
    assert (held["num_experts"], held["hidden_size"], held["intermediate_size"]) == (E, H, I)
    assert held["byte_size"] > 0
    assert main(["layers", "--server", server.address, "--worker", "0"]) == 0
    assert any(line.startswith(layer_id) for line in capsys.readouterr().out.splitlines())

    status, unloaded = cli_json(["unload", layer_id, "--server", server.address, "--json"], capsys)
    assert status == 0
    assert unloaded == {"layer_id": layer_id, "freed_bytes": held["byte_size"]}
    _, after = cli_json(["layers", "--server", server.address, "--json"], capsys)
    assert layer_id not in [layer["layer_id"] for layer in after]

    # Gone: NOT_FOUND, exit 1, the server's message.
    assert main(["unload", layer_id, "--server", server.address]) == 1
    assert "error: NOT_FOUND: " in capsys.readouterr().err


def test_the_matrix_over_grpc_is_the_local_matrix(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "qwen3.json").write_text(json.dumps(QWEN))
    (tmp_path / "qwen3-desc-act.json").write_text(
        json.dumps(
            {**QWEN, "quantization_config": {**QWEN["quantization_config"], "desc_act": True}}
        )
    )
    args = ["select", "--config", str(tmp_path), "--gpu", "a100,h200,mi300x,v100", "--json"]
    local_status, local = cli_json(args, capsys)
    remote_status, remote = cli_json([*args, "--server", server.address], capsys)
    assert remote_status == local_status
    assert len(remote["cells"]) == 8
    keys = ("model", "gpu", "ruleset", "outcome", "backend", "hazards", "problem")
    assert [{k: c[k] for k in keys} for c in remote["cells"]] == [
        {k: c[k] for k in keys} for c in local["cells"]
    ]
    # desc_act fails where vLLM refuses it: the failure travels as the local one does.
    assert {c["outcome"] for c in remote["cells"]} == {"chosen", "fails"}


def test_wait_ready_answers_once_a_starting_server_is_ready(
    server_factory: Callable[..., ServerProcess], capsys: pytest.CaptureFixture[str]
) -> None:
    starting = server_factory(ready=False)  # called as soon as it listens
    args = ["workers", "--server", starting.address, "--wait-ready", "--timeout", "60", "--json"]
    status, listing = cli_json(args, capsys)
    assert status == 0
    assert listing["ready"] is True
    assert listing["workers"][0]["state"] == "WORKER_STATE_READY"
