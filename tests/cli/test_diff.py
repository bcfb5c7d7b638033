"""`moe-control diff` locally, through the real entry point: deployments from a JSON Lines
file or from configs on GPUs, one row per deployment whose answer changes in a field of
`--fail-on`, the other differences apart, `--json` as POST /v1/diff answers, and the exit
status a CI gate reads (1 when a gated field changes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from service.cli import main
from service.oracle.upgrade import upgrade

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


def layer(activation: str) -> dict[str, Any]:
    return {
        "num_experts": 8,
        "top_k": 2,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "activation": activation,
    }


GELU = {
    "id": "gelu",
    "hf_quantization_config": GPTQ,
    "layer": layer("gelu_tanh"),
    "platform": "cpu",
}
SILU = {"id": "silu", "hf_quantization_config": GPTQ, "layer": layer("silu"), "platform": "cpu"}
#: A config.json whose layers use GELU_TANH (Gemma-style `hidden_act`).
GELU_CONFIG = {
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "hidden_act": "gelu_pytorch_tanh",
    "quantization_config": GPTQ,
}


def jsonl(tmp_path: Path, *specs: dict[str, Any]) -> Path:
    path = tmp_path / "specs.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in specs))
    return path


def test_a_change_is_one_row_with_both_answers_and_the_cause_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    specs = jsonl(tmp_path, GELU, SILU)
    assert (
        main(["diff", "--from", "vllm-0.32", "--to", "vllm-0.33", "--deployment", str(specs)]) == 1
    )
    out = capsys.readouterr().out.splitlines()
    header, row = out[0].split(), out[1]
    assert header == ["DEPLOYMENT", "vllm-0.32", "vllm-0.33", "CAUSE"]
    expected = upgrade(GELU, "vllm-0.32", "vllm-0.33").changes[0]
    assert row.startswith("gelu ") and "FAILS (backend)" in row and "CPU" in row
    assert expected.cause in row
    assert not any(line.startswith("silu") for line in out)  # unchanged: no row
    assert out[-1] == (
        "1 of 2 deployments change from vllm-0.32 to vllm-0.33 (backend, experts_class, failure)"
    )


def test_nothing_changing_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["diff", "--from", "0.32", "--to", "0.33", "--deployment", str(jsonl(tmp_path, SILU))]
    assert main(args) == 0
    assert capsys.readouterr().out.strip() == (
        "no answer changes from vllm-0.32 to vllm-0.33 (1 deployment; backend, experts_class, "
        "failure)"
    )


def test_json_prints_every_deployment_as_the_http_answer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    specs = jsonl(tmp_path, GELU, SILU)
    assert (
        main(["diff", "--from", "0.32", "--to", "0.33", "--deployment", str(specs), "--json"]) == 1
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line.pop("deployment") for line in lines] == ["gelu", "silu"]
    assert lines == [upgrade(s, "0.32", "0.33").to_json() for s in (GELU, SILU)]


def test_configs_on_gpus_reuse_select_s_matrix_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = tmp_path / "fleet"
    fleet.mkdir()
    (fleet / "gemma-like.json").write_text(json.dumps(GELU_CONFIG))
    (fleet / "dense.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    args = ["diff", "--from", "0.32", "--to", "0.33", "--config", str(fleet), "--gpu", "cpu,h200"]
    assert main([*args, "--json"]) == 2  # the dense config is bad input, and wins
    rows = {r["deployment"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(rows) == {"dense on cpu", "dense on h200", "gemma-like on cpu", "gemma-like on h200"}
    assert "invalid" in rows["dense on cpu"]
    assert (
        rows["gemma-like on cpu"]["changed"]
        and rows["gemma-like on cpu"]["after"]["backend"] == "CPU"
    )
    assert not rows["gemma-like on h200"]["changed"]
    (fleet / "dense.json").unlink()
    assert main(args) == 1
    table = capsys.readouterr().out
    assert "gemma-like on cpu" in table and "gemma-like on h200" not in table


def test_an_unknown_ruleset_is_the_resolver_s_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    specs = str(jsonl(tmp_path, SILU))
    assert main(["diff", "--from", "vllm-0.99", "--deployment", specs]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-control diff: --from: unknown ruleset 'vllm-0.99'; known: ")
    assert main(["diff", "--from", "0.32", "--to", "nope", "--deployment", specs, "--json"]) == 2
    (violation,) = json.loads(capsys.readouterr().err)["invalid"]
    assert violation["field"] == "--to" and "vllm-0.33" in violation["description"]


def test_several_gpus_need_configs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    specs = str(jsonl(tmp_path, SILU))
    assert main(["diff", "--from", "0.32", "--deployment", specs, "--gpu", "a100,h100"]) == 2
    assert "--gpu: several GPUs need --config" in capsys.readouterr().err


def test_help_says_what_the_exit_status_means(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["diff", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "0 when no field of --fail-on changes, 1 when one does" in text
    assert "failure (whether vLLM fails the deployment, at which stage" in text


def test_an_unreachable_server_is_exit_3_and_said_per_deployment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    specs = str(jsonl(tmp_path, GELU))
    argv = ["diff", "--from", "0.32", "--deployment", specs, "--server", "127.0.0.1:1"]
    assert main([*argv, "--timeout", "5"]) == 3
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("error gelu (server): UNAVAILABLE: ")
    assert out[-1] == "no deployment was answered"


#: A forced backend neither 0.32 nor 0.33 maps: both fail at KernelConfig, in other words.
REWORDED = {**SILU, "id": "reworded", "moe_backend": "cpu"}


def test_a_difference_outside_fail_on_is_listed_apart_and_passes_the_gate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    specs = str(jsonl(tmp_path, REWORDED, SILU))
    assert main(["diff", "--from", "0.32", "--to", "0.33", "--deployment", specs]) == 0
    out = capsys.readouterr().out.splitlines()
    assert not any(line.startswith("DEPLOYMENT") for line in out)  # nothing gated changes
    (change,) = upgrade(REWORDED, "0.32", "0.33").changes
    assert out[0] == (
        "1 more differ only outside --fail-on backend,experts_class,failure (not gated; "
        "--json lists them), by difference and cause:"
    )
    assert out[1] == f"     1 x error: {change.cause}"
    assert out[-1].endswith("; 1 more differ only in other fields (not gated)")
    # gated on the error's whole text, the same deployment fails the gate
    argv = ["diff", "--from", "0.32", "--to", "0.33", "--deployment", specs]
    assert main([*argv, "--fail-on", "error"]) == 1
    assert capsys.readouterr().out.splitlines()[1].startswith("reworded ")
    assert main([*argv, "--fail-on", "backend", "--fail-on", "verdict,error", "--json"]) == 1
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["fail_on"] for r in rows] == [["backend", "error", "verdict"]] * 2
    assert [r["changed"] for r in rows] == [True, False]


def test_json_lists_gated_and_other_differences_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    specs = str(jsonl(tmp_path, REWORDED))
    assert main(["diff", "--from", "0.32", "--deployment", specs, "--json"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["changed"] is False and row["differences"] == []
    assert [d["field"] for d in row["other_differences"]] == ["error"]


@pytest.mark.parametrize("flag", ["stage", "backend,verdicts", ""])
def test_an_unknown_fail_on_field_is_bad_input_listing_the_accepted(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    specs = str(jsonl(tmp_path, SILU))
    status = main(["diff", "--from", "0.32", "--deployment", specs, "--fail-on", flag])
    err = capsys.readouterr().err
    if not flag:  # empty: the default
        assert status == 0 and not err
        return
    assert status == 2
    assert err.startswith("moe-control diff: --fail-on: unknown field ")
    assert "accepted: backend, experts_class, failure, error, verdict" in err
