"""`moe-control select` in local mode, through its real entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.cli import main
from service.oracle import DEFAULT_RULESET

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
    assert f"ruleset: {DEFAULT_RULESET}" in out
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


def test_a_specs_own_ruleset_is_read_without_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = {
        "hf_quantization_config": CONFIG["quantization_config"],
        "layer": {"num_experts": 8, "top_k": 2, "hidden_size": 4096, "intermediate_size": 14336},
        "platform": "a100",
    }
    path = tmp_path / "releases.jsonl"
    lines = [{**base, "ruleset": "v0.33.0"}, {**base, "ruleset": "0.20"}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    main(["select", "--deployment", str(path), "--json"])
    own = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert own[0]["ruleset"] == "vllm-0.33"
    assert own[1]["invalid"][0]["field"] == "ruleset"  # the file's unknown release is refused


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


# ---------------------------------------------------------------------------------------
# --server: the shared client flags, the measured policy's deadline, progress and table


def test_select_has_the_shared_client_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["select", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for flag in ("--server", "--token", "--tls-ca", "--tls-cert", "--tls-key"):
        assert flag in help_text
    assert "--wait-ready" in help_text
    assert "--timeout TIMEOUT" in help_text
    assert "(default 30; 300 with --policy measured" in help_text


@pytest.mark.parametrize(("policy", "expected"), [("static", 30.0), ("measured", 300.0)])
def test_the_default_deadline_depends_on_the_policy(
    monkeypatch: pytest.MonkeyPatch, config_path: Path, policy: str, expected: float
) -> None:
    from service.cli import select as select_cli

    seen: dict[str, object] = {}

    def fake_run(args: object, server: object) -> int:
        seen["timeout"] = getattr(args, "timeout", None)
        seen["connection"] = select_cli.connection_from_args(args)  # type: ignore[arg-type]
        return 0

    monkeypatch.setattr(select_cli, "_run", fake_run)
    argv = ["select", "--config", str(config_path), "--server", "127.0.0.1:1"]
    assert main([*argv, "--policy", policy]) == 0
    assert seen["timeout"] == expected
    assert main([*argv, "--policy", policy, "--timeout", "7", "--wait-ready"]) == 0
    connection = seen["connection"]
    assert getattr(connection, "timeout", None) == 7.0
    assert getattr(connection, "wait_ready", None) is True


def test_the_measuring_notice_says_what_and_how_long() -> None:
    from service.cli.select import measuring_notice
    from service.kernels.registry import RUNNABLE

    line = measuring_notice((), 300.0, refresh=False)
    assert line.startswith(f"measuring {len(RUNNABLE)} backends (")
    assert "at token counts 1,16,256,4096 (the server's default) on the server's worker" in line
    assert "this can take a minute or more" in line and line.endswith("(--timeout 300 s)")
    assert "\n" not in line
    assert "token counts 8,1 on" in measuring_notice((8, 1), 5.0, refresh=True)


def test_the_notice_names_the_servers_real_default_token_counts() -> None:
    from service.cli.select import SERVER_DEFAULT_TOKENS
    from service.dataplane.measured import DEFAULT_TOKENS

    assert SERVER_DEFAULT_TOKENS == DEFAULT_TOKENS


def test_a_measured_table_with_missing_values_prints_no_none() -> None:
    from service.cli.select import render_measured, render_table

    measured = {
        "worker_index": 0,
        "device_name": "",
        "from_cache": False,
        "measured_time": None,
        "measure_seconds": None,
        "versions": {},
        "buckets": [
            {
                "tokens": 16,
                "fastest_backend": None,
                "fastest_seconds": None,
                "static_backend": None,
                "static_seconds": None,
                "speedup": None,
                "timings": [{"backend": "MARLIN", "device_seconds": None, "error": None}],
            }
        ],
    }
    lines = render_measured(measured)
    assert lines[0] == "measured on worker 0, measured now"
    assert lines[2].split() == ["16", "-", "-", "-", "-", "-"]
    assert lines[-1] == "not run: MARLIN: did not run"
    result = {"backend": "CPU", "experts_class": None, "candidates": [], "measured": measured}
    assert "None" not in render_table(result)


def test_a_measured_table_with_times() -> None:
    from service.cli.select import render_measured

    measured = {
        "worker_index": 1,
        "device_name": "cpu",
        "from_cache": True,
        "measure_seconds": 0.0,
        "buckets": [
            {
                "tokens": 1,
                "fastest_backend": "EMULATION",
                "fastest_seconds": 2.5e-4,
                "static_backend": "CPU",
                "static_seconds": 5e-4,
                "speedup": 2.0,
                "timings": [
                    {"backend": "EMULATION", "device_seconds": 2.5e-4, "error": None},
                    {"backend": "MARLIN", "device_seconds": None, "error": "MARLIN: needs CUDA"},
                ],
            }
        ],
    }
    assert render_measured(measured) == [
        "measured on worker 1 (cpu), from the server's cache",
        "TOKENS  FASTEST              TIME  vLLM CHOICE          TIME  SPEEDUP",
        "     1  EMULATION          250 us  CPU                500 us  2.00x",
        "        timed: EMULATION 250 us",
        "not run: MARLIN: needs CUDA",
    ]


@pytest.mark.parametrize("policy", ["static", "measured"])
def test_the_deadline_message_is_one_line_naming_timeout(policy: str) -> None:
    import argparse

    from service.cli.select import deadline_message

    message = deadline_message(argparse.Namespace(timeout=0.05, policy=policy))
    assert "\n" not in message and "None" not in message
    assert "no answer within 0.05 s (DEADLINE_EXCEEDED)" in message
    assert "--timeout SECONDS" in message
    assert ("measuring" in message) == (policy == "measured")


def test_half_a_client_certificate_is_refused_before_any_call(
    config_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cert = tmp_path / "client.pem"
    cert.write_text("not used")
    argv = ["select", "--config", str(config_path), "--server", "127.0.0.1:1", "--json"]
    assert main([*argv, "--tls-cert", str(cert)]) == 2
    (violation,) = json.loads(capsys.readouterr().out)["invalid"]
    assert violation["field"] == "--tls-cert" and "--tls-key" in violation["description"]
