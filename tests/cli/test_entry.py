"""The `moe-control` entry point: a reader that closes the pipe early (`| head -4`) ends
every command quietly, with the status a shell gives a tool killed by SIGPIPE."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

#: How a shell reports a tool killed by SIGPIPE.
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE

CONFIG = {
    "model_type": "qwen2_moe",
    "hidden_size": 2048,
    "moe_intermediate_size": 1408,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True},
}


def _into_closed_pipe(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI with stdout a pipe whose reader has already gone (what `head` leaves
    once it has its lines)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "service.cli", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)


@pytest.fixture
def config_path(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    return path


def test_select_into_a_closed_pipe_exits_quietly(config_path: Path) -> None:
    done = _into_closed_pipe("select", "--config", str(config_path), "--gpu", "h100")
    assert done.returncode == EXIT_BROKEN_PIPE
    assert done.stderr == ""


@pytest.mark.parametrize(
    "argv",
    [
        ["health", "--server", "127.0.0.1:1", "--timeout", "2"],
        ["run", "--experts", "4", "--tokens", "2"],
    ],
    ids=["health", "run"],
)
def test_every_command_into_a_closed_pipe_exits_quietly(argv: list[str]) -> None:
    done = _into_closed_pipe(*argv)
    assert done.returncode == EXIT_BROKEN_PIPE
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
