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


def test_table_shows_the_platform_explanations_and_what_would_change(
    config_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["select", "--config", str(config_path), "--gpu", "h200", "--packages", "none"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "platform: preset h200: cuda 9.0  packages: none  env: none" in out
    assert "ruleset: vllm-0.33" in out
    assert "[DEVICE] kernel does not support current device cuda" in out
    assert "= the humming package is not installed (pip install humming-kernels)" in out
    assert "to get HUMMING: install humming-kernels" in out
    triton = next(line for line in out.splitlines() if line.startswith("TRITON"))
    assert "[" not in triton and "not tried: MARLIN" in triton


def test_json_carries_platform_explanations_and_hints_as_data(
    config_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["select", "--config", str(config_path), "--gpu", "h200", "--packages", "none"]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["platform"]["preset"] == "h200"
    assert result["platform"]["packages"] == []
    humming = next(c for c in result["candidates"] if c["backend"] == "HUMMING")
    assert humming["reason"] == "kernel does not support current device cuda"
    assert humming["explanation"]
    hint = next(h for h in result["what_would_change"] if h["backend"] == "HUMMING")
    assert hint["changes"] == [
        {
            "kind": "package",
            "field": "platform.packages",
            "value": "+humming",
            "text": "install humming-kernels",
        }
    ]


def test_an_env_flag_vllm_does_not_read_is_refused(
    config_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["select", "--config", str(config_path), "--gpu", "h100", "--env", "FOO=1", "--json"]
    assert main(args) == 2
    (violation,) = json.loads(capsys.readouterr().out)["invalid"]
    assert violation["field"] == "platform.env.FOO"
    assert "VLLM_USE_FLASHINFER_MOE_INT4" in violation["description"]


def test_jsonl_answers_echo_their_ids(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = {
        "hf_quantization_config": CONFIG["quantization_config"],
        "layer": {"num_experts": 8, "top_k": 2, "hidden_size": 4096, "intermediate_size": 14336},
    }
    lines = [
        {**base, "id": "ok", "platform": "a100"},
        {**base, "id": 7, "platform": "a100", "moe_backend": "triton"},
        {**base, "id": "bad", "platform": "nope"},
    ]
    path = tmp_path / "many.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    main(["select", "--deployment", str(path), "--json"])
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [a["id"] for a in answers] == ["ok", 7, "bad"]


def test_a_layer_left_unquantized_is_explained_not_printed_as_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    quant = {**CONFIG["quantization_config"], "dynamic": {"-:.*mlp.experts": {}}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, "quantization_config": quant}))
    assert main(["select", "--config", str(path), "--gpu", "a100"]) == 0
    out = capsys.readouterr().out
    assert "None" not in out
    assert "moe method: UnquantizedFusedMoEMethod" in out
    assert "backend: none (the layer model.layers.0.mlp.experts is not quantized" in out
    assert "no WNA16 backend" in out


def test_a_failed_answer_prints_its_platform_and_no_none(
    config_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["select", "--config", str(config_path), "--gpu", "cpu-noamx"]) == 1
    out = capsys.readouterr().out
    assert "platform: preset cpu-noamx: cpu x86 without AMX" in out
    assert "None" not in out
    assert "to get ZEN_CPU: install zentorch" in out


def test_a_transport_error_prints_no_empty_decision_fields() -> None:
    from service.cli.select import render_table

    result = {
        "error": {"stage": "server", "type": "UNAVAILABLE", "message": "no worker is ready"},
        "candidates": [],
    }
    assert render_table(result) == "error (server): UNAVAILABLE: no worker is ready"
