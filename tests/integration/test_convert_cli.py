"""`moe-control convert --server` against a real server, and the server staying torch-free."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from integration.serverproc import ServerProcess, launch, wait_ready
from service.formats import registry
from service.formats.synthetic.checkpoints import SyntheticSpec, write_synthetic_checkpoint

SPEC = SyntheticSpec(num_layers=2, num_experts=4, hidden_size=128, intermediate_size=128)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Any]]:
    base = tmp_path_factory.mktemp("cli-remote")
    return base, write_synthetic_checkpoint(base / "mixtral", SPEC)


@pytest.fixture(scope="module")
def server(root: tuple[Path, Any]) -> Iterator[ServerProcess]:
    process = launch("--data-root", str(root[0]))
    wait_ready(process)
    yield process
    process.stop()


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", "convert", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_remote_checkpoint_then_resume(server: ServerProcess, root: tuple[Path, Any]) -> None:
    args = ["mixtral", "out/triton", "--server", server.address, "--backend", "triton"]
    first = cli(*args, "--json", "--progress")
    assert first.returncode == 0, first.stderr
    summary = json.loads(first.stdout)
    assert (summary["layers_converted"], summary["layers_skipped"]) == (2, 0)
    assert summary["manifest_path"] == "out/triton/moe-control-manifest.json"
    assert "converted moe-layer-00001.safetensors" in first.stderr
    second = cli(*args)
    assert second.returncode == 0, second.stderr
    assert "0 layers converted, 2 verified and kept" in second.stdout


def test_remote_layer_file(server: ServerProcess, root: tuple[Path, Any], tmp_path: Path) -> None:
    base, layers = root
    shard = sorted((base / "mixtral").glob("model-*.safetensors"))[0]
    out = tmp_path / "layer.safetensors"
    done = cli(
        str(shard), str(out), "--server", server.address, "--backend", "TRITON", "--layer", "0"
    )
    assert done.returncode == 0, done.stderr
    written = load_file(out)
    module = "model.layers.0.block_sparse_moe.experts"
    for name, tensor in registry.convert(layers[0], "TRITON", source="gptq").tensors.items():
        assert torch.equal(written[f"{module}.{name}"], tensor)


@pytest.mark.parametrize(
    ("argv", "code", "text"),
    [
        (["../elsewhere", "out/x", "--backend", "TRITON"], 2, "PERMISSION_DENIED"),
        (["mixtral", "out/cpu", "--backend", "CPU"], 1, "UNIMPLEMENTED"),
        (["mixtral", "out/y", "--backend", "NOPE"], 2, "INVALID_ARGUMENT"),
    ],
)
def test_remote_failures_exit_with_the_status(
    server: ServerProcess, argv: list[str], code: int, text: str
) -> None:
    done = cli(*argv, "--server", server.address)
    assert done.returncode == code, done.stderr
    assert text in done.stderr


def test_the_server_process_never_imports_torch() -> None:
    """The server process stays small: the ConvertWeights path (codec, streaming, paths,
    planning, checkpoint discovery) imports no torch; only workers do."""
    code = (
        "import sys, service.server.primary, service.dataplane.convert, "
        "service.formats.checkpoint.plan, service.formats.io.naming; "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "False"
