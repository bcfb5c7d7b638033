"""The fleet matrix of `moe-control select`, locally, through the real entry point: several
configs (files, model directories, a directory of them) by several GPUs, each cell what a
single `select` answers for that pair, hazards and failures marked and explained."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest

from service.cli import main
from service.oracle import DEFAULT_RULESET, PLATFORM_PRESETS, RULESETS

QWEN = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "quantization_config": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": False,
        "sym": True,
    },
}
MIXTRAL_AWQ = {
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "quantization_config": {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 128,
        "zero_point": True,
        "version": "gemm",
    },
}
DENSE = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336}
GPUS = ["a100", "h100", "h200", "mi300x"]


@pytest.fixture
def fleet(tmp_path: Path) -> Path:
    """A directory of configs: two plain files and one model directory."""
    root = tmp_path / "fleet"
    root.mkdir()
    (root / "qwen3-gptq.json").write_text(json.dumps(QWEN))
    (root / "mixtral-awq").mkdir()
    (root / "mixtral-awq" / "config.json").write_text(json.dumps(MIXTRAL_AWQ))
    (root / "README.md").write_text("not a config")
    return root


def run_json(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, Any]:
    status = main(args)
    return status, json.loads(capsys.readouterr().out)


def single_backend(config: Path, gpu: str, capsys: pytest.CaptureFixture[str]) -> str | None:
    _, answer = run_json(["select", "--config", str(config), "--gpu", gpu, "--json"], capsys)
    backend: str | None = answer.get("backend")
    return backend


def test_every_cell_is_the_single_answer(fleet: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, matrix = run_json(
        ["select", "--config", str(fleet), "--gpu", ",".join(GPUS), "--json"], capsys
    )
    assert status == 0
    assert matrix["gpus"] == GPUS
    assert [m["label"] for m in matrix["models"]] == ["mixtral-awq", "qwen3-gptq"]
    assert len(matrix["cells"]) == 2 * len(GPUS)
    files = {"mixtral-awq": fleet / "mixtral-awq", "qwen3-gptq": fleet / "qwen3-gptq.json"}
    for cell in matrix["cells"]:
        assert cell["outcome"] == "chosen"
        assert cell["backend"] == single_backend(files[cell["model"]], cell["gpu"], capsys)
        assert cell["platform"]["name"] == cell["gpu"]
    backends = {c["gpu"]: c["backend"] for c in matrix["cells"] if c["model"] == "qwen3-gptq"}
    # A different backend per GPU generation: the matrix is not one answer repeated.
    assert backends == {"a100": "MARLIN", "h100": "HUMMING", "h200": "HUMMING", "mi300x": "TRITON"}


def test_table_is_models_by_gpus(fleet: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["select", "--config", str(fleet), "--gpu", ",".join(GPUS)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["MODEL", *GPUS]
    assert lines[1].split() == ["mixtral-awq", "MARLIN", "HUMMING", "HUMMING", "TRITON"]
    assert lines[2].split() == ["qwen3-gptq", "MARLIN", "HUMMING", "HUMMING", "TRITON"]
    assert len(lines) == 3  # no hazards, no failures: no notes


def test_hazards_and_failures_are_marked_and_explained(
    fleet: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # On a V100 AWQ fails (capability 7.0 < 7.5) and GPTQ falls to EMULATION with a hazard.
    status = main(["select", "--config", str(fleet), "--gpu", "a100,v100"])
    out = capsys.readouterr().out.splitlines()
    assert status == 1  # the worst cell: vLLM fails one deployment
    assert out[1].split() == ["mixtral-awq", "MARLIN", "FAILS"]
    assert out[2].split() == ["qwen3-gptq", "MARLIN", "EMULATION!"]
    notes = out[4:]
    assert any(
        n.startswith("! qwen3-gptq on v100: hazard GPTQ_EMULATION_ZERO_POINT: ") for n in notes
    )
    assert any(
        n.startswith("FAILS mixtral-awq on v100: ValueError: ") and "capability" in n for n in notes
    )


def test_a_config_that_is_not_a_quantized_moe_is_one_invalid_row(
    fleet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dense = tmp_path / "dense.json"
    dense.write_text(json.dumps(DENSE))
    status = main(["select", "--config", str(dense), "--config", str(fleet), "--gpu", "a100,h100"])
    out = capsys.readouterr().out.splitlines()
    assert status == 2
    assert out[1].split() == ["dense", "invalid", "invalid"]
    invalid_notes = [n for n in out if n.startswith("invalid dense: ")]
    assert len(invalid_notes) == 1 and "not quantized" in invalid_notes[0]


def test_gpu_all_is_every_preset(fleet: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, matrix = run_json(["select", "--config", str(fleet), "--gpu", "all", "--json"], capsys)
    assert matrix["gpus"] == list(PLATFORM_PRESETS)
    assert len(matrix["cells"]) == 2 * len(PLATFORM_PRESETS)


def test_csv_is_one_row_per_cell(fleet: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["select", "--config", str(fleet), "--gpu", "h20,v100", "--csv"]) == 1
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert len(rows) == 4
    by_cell = {(r["model"], r["gpu"]): r for r in rows}
    assert by_cell["qwen3-gptq", "h20"]["backend"] == "HUMMING"
    assert by_cell["qwen3-gptq", "v100"]["hazards"] == "GPTQ_EMULATION_ZERO_POINT"
    assert by_cell["mixtral-awq", "v100"]["outcome"] == "fails"
    assert by_cell["mixtral-awq", "v100"]["backend"] == ""
    assert by_cell["qwen3-gptq", "h20"]["origin"] == str(fleet / "qwen3-gptq.json")


def test_one_config_with_csv_is_a_one_cell_matrix(
    fleet: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["select", "--config", str(fleet / "qwen3-gptq.json"), "--gpu", "a100", "--csv"]) == 0
    )
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [(r["model"], r["gpu"], r["backend"]) for r in rows] == [
        ("qwen3-gptq", "a100", "MARLIN")
    ]


def test_known_ruleset_is_accepted_and_named_in_every_cell(
    fleet: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (name,) = list(RULESETS)[:1]
    _, matrix = run_json(
        ["select", "--config", str(fleet), "--gpu", "a100", "--ruleset", name, "--json"], capsys
    )
    assert matrix["rulesets"] == [name]
    assert {c["ruleset"] for c in matrix["cells"]} == {name}


def test_unknown_ruleset_is_refused_with_the_known_ones(
    fleet: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["select", "--config", str(fleet), "--gpu", "a100", "--ruleset", "vllm-0.33,vllm-9"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--ruleset" in err and "vllm-9" in err and all(name in err for name in RULESETS)


def test_ruleset_flag_takes_every_spelling_of_a_release(
    fleet: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["select", "--config", str(fleet), "--gpu", "a100", "--json"]
    _, matrix = run_json([*args, "--ruleset", "v0.34.0,0.34,VLLM-0.34"], capsys)
    assert matrix["rulesets"] == [DEFAULT_RULESET]
    assert {c["ruleset"] for c in matrix["cells"]} == {DEFAULT_RULESET}


def test_unknown_gpu_fails_before_any_cell(fleet: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["select", "--config", str(fleet), "--gpu", "a100,a1000"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "unknown platform preset 'a1000'" in captured.err


def test_a_matrix_needs_gpus_and_configs(
    fleet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["select", "--config", str(fleet)]) == 2
    assert "--gpu" in capsys.readouterr().err
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"hf_quantization_config": QWEN["quantization_config"]}))
    assert main(["select", "--deployment", str(spec), "--gpu", "a100,h100"]) == 2
    assert "needs --config" in capsys.readouterr().err


def test_platform_flags_apply_to_every_cell(
    fleet: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["select", "--config", str(fleet), "--gpu", "h100,h200", "--packages", "none", "--json"]
    _, matrix = run_json(args, capsys)
    assert {c["backend"] for c in matrix["cells"]} == {"MARLIN"}  # no humming: Marlin wins
    assert {tuple(c["platform"]["packages"]) for c in matrix["cells"]} == {()}
