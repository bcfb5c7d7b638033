"""Numbers no deployment could hold in the CLI's JSON files (`select --config`,
`select --deployment`, `convert --config`, `convert --deployment`): exit 2 and a line
naming the field, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from service.client.exits import EXIT_BAD_INPUT

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
CONFIG = {
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "quantization_config": GPTQ,
}
SPEC = {
    "hf_quantization_config": GPTQ,
    "layer": {"num_experts": 8, "top_k": 2, "hidden_size": 4096, "intermediate_size": 1024},
    "platform": "a100",
}


def _file(tmp_path: Path, base: dict[str, object], key: str, token: str) -> Path:
    """`base` as a JSON file, the number at `key` (dotted) replaced by the raw `token`."""
    value = json.loads(json.dumps(base))
    *parents, last = key.split(".")
    target = value
    for name in parents:
        target = target[name]
    target[last] = "@@"
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps(value).replace('"@@"', token))
    return path


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("token", "says"),
    [
        ("9" * 5000, "an integer of 5000 digits"),
        ("NaN", "NaN is not a JSON number"),
        ("-Infinity", "-Infinity is not a JSON number"),
        ("1e999", "overflows"),
        ("8.5", "must be an integer >= 1, got 8.5"),
        ("-3", "must be an integer >= 1, got -3"),
        (str(10**12), "must be at most 2147483647"),
    ],
)
def test_select_config_and_deployment_files(tmp_path: Path, token: str, says: str) -> None:
    for flag, base, key in (
        ("--config", CONFIG, "num_local_experts"),
        ("--deployment", SPEC, "layer.num_experts"),
    ):
        path = _file(tmp_path, base, key, token)
        done = _cli("select", flag, str(path), "--gpu", "a100")
        output = done.stderr + done.stdout
        assert done.returncode == EXIT_BAD_INPUT, output
        assert "Traceback" not in output
        assert says in output
        # named as config.json names it where the text is refused, else as the spec does
        assert f"config.{key}" in output or "layer.num_experts" in output, output


@pytest.mark.parametrize("token", ["9" * 5000, "NaN", "1e999"])
def test_convert_config_and_deployment_files(tmp_path: Path, token: str) -> None:
    layer = tmp_path / "layer.safetensors"
    layer.write_bytes(b"")
    for flag, base, key in (
        ("--config", CONFIG, "num_local_experts"),
        ("--deployment", SPEC, "layer.num_experts"),
    ):
        path = _file(tmp_path, base, key, token)
        done = _cli("convert", str(layer), str(tmp_path / "out.safetensors"), flag, str(path))
        assert done.returncode == EXIT_BAD_INPUT, done.stderr
        assert "Traceback" not in done.stderr
        assert f"{flag}: " in done.stderr and key in done.stderr, done.stderr
        assert not (tmp_path / "out.safetensors").exists()
