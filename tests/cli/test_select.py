"""`moe-control select` in local mode, through its real entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.cli import main

CONFIG = {
    "model_type": "qwen2_moe",
    "hidden_size": 2048,
    "moe_intermediate_size": 1408,
    "intermediate_size": 5632,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "quantization_config": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": False,
        "sym": True,
    },
}


@pytest.fixture
def config_path(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    return path


@pytest.mark.parametrize(
    ("gpu", "packages", "backend"),
    [("a100", None, "MARLIN"), ("h200", None, "HUMMING"), ("h200", "none", "MARLIN")],
)
def test_config_and_gpu(
    config_path: Path,
    gpu: str,
    packages: str | None,
    backend: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["select", "--config", str(config_path), "--gpu", gpu, "--json"]
    if packages:
        args += ["--packages", packages]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["backend"] == backend
    assert len(result["candidates"]) == 7


def test_table_output_lists_every_backend(
    config_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["select", "--config", str(config_path), "--gpu", "a100"]) == 0
    out = capsys.readouterr().out
    assert "backend: MARLIN" in out
    assert "[ZERO_POINTS_OR_BIAS] zero points and bias are not supported" in out


def test_jsonl_answers_in_order_with_failures(
    tmp_path: Path, config_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = {
        "hf_quantization_config": CONFIG["quantization_config"],
        "layer": {"num_experts": 8, "top_k": 2, "hidden_size": 4096, "intermediate_size": 14336},
    }
    lines = [
        {**base, "platform": "a100"},
        {**base, "platform": "a100", "moe_backend": "triton"},
        {**base, "platform": "nope"},
    ]
    path = tmp_path / "many.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    status = main(["select", "--deployment", str(path), "--json"])
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert status == 2
    assert answers[0]["backend"] == "MARLIN"
    assert answers[1]["error"]["type"] == "ValueError"
    assert answers[2]["invalid"][0]["field"] == "platform"


def test_missing_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["select", "--config", str(tmp_path / "absent.json"), "--gpu", "a100", "--json"])
    assert status == 2
    assert "cannot read" in capsys.readouterr().err
