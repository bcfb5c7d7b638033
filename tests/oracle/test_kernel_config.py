"""`--moe-backend` as `vllm serve` parses it: normalised, then checked against KernelConfig."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.cli import main
from service.oracle import DEFAULT_RULESET, SelectionError, select
from service.oracle.kernel_config import normalise_moe_backend, parse_moe_backend
from service.oracle.rulesets import get_ruleset
from service.oracle.rulesets.kernel_names import MOE_BACKENDS_0_33

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
CONFIG = {
    "model_type": "qwen2_moe",
    "hidden_size": 2048,
    "moe_intermediate_size": 1408,
    "intermediate_size": 5632,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "quantization_config": GPTQ,
}
LAYER = {"num_experts": 8, "top_k": 2, "hidden_size": 4096, "intermediate_size": 14336}


def _spec(moe_backend: str, platform: str = "mi300x") -> dict[str, object]:
    return {
        "hf_quantization_config": GPTQ,
        "layer": LAYER,
        "platform": platform,
        "moe_backend": moe_backend,
    }


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("TRITON", "triton"),
        ("flashinfer-trtllm", "flashinfer_trtllm"),
        ("FlashInfer-TRTLLM", "flashinfer_trtllm"),
        ("AUTO", "auto"),
        ("Deep-Gemm", "deep_gemm"),
    ],
)
def test_names_are_normalised_as_vllms_parser_does(raw: str, value: str) -> None:
    assert normalise_moe_backend(raw) == value
    assert parse_moe_backend(raw, MOE_BACKENDS_0_33) == value


def test_the_0_33_ruleset_carries_kernel_configs_names_as_data() -> None:
    names = get_ruleset("vllm-0.33").kernel_config_moe_backends
    assert names == MOE_BACKENDS_0_33
    assert {"auto", "triton", "deep_gemm", "rdna3"} <= set(names)
    # what the WNA16 selection maps is a subset of what KernelConfig accepts
    assert set(get_ruleset("vllm-0.33").user_backends) <= set(names)
    # a release's list is data: a shorter list refuses what it lacks
    with pytest.raises(SelectionError) as info:
        parse_moe_backend("RDNA3", tuple(n for n in names if n != "rdna3"))
    assert "invalid choice: 'rdna3'" in info.value.error.message


def test_upper_case_triton_is_forced_as_vllm_forces_it() -> None:
    assert select(_spec("TRITON")).backend == "TRITON"
    assert select(_spec("triton")).backend == "TRITON"


def test_hyphenated_flashinfer_trtllm_reaches_the_flashinfer_backend() -> None:
    with pytest.raises(SelectionError) as info:
        select(_spec("flashinfer-trtllm", "a100"))
    assert info.value.error.stage == "backend"
    assert "WNA16 MoE backend 'FLASHINFER_TRTLLM'" in info.value.error.message


def test_a_kernel_config_name_that_wna16_does_not_map_fails_at_selection() -> None:
    with pytest.raises(SelectionError) as info:
        select(_spec("DEEP-GEMM"))
    assert info.value.error.stage == "backend"
    assert info.value.error.message.startswith("moe_backend='deep_gemm' is not supported")


def test_an_unknown_name_is_refused_by_the_parser_before_anything_else() -> None:
    with pytest.raises(SelectionError) as info:
        select(_spec("Bogus"))
    error = info.value.error
    assert (error.stage, error.type) == ("kernel_config", "ArgumentError")
    assert error.message == (
        "argument --moe-backend: invalid choice: 'bogus' (choose from 'aiter', "
        "'aiter_mega_moe', 'aiter_triton_mxfp4_bf16', 'aiter_triton_mxfp4_mxfp4', 'auto', "
        "'b12x', 'batched_triton', 'cutlass', 'deep_gemm', 'deep_gemm_mega_moe', 'emulation', "
        "'flashinfer_b12x', 'flashinfer_cutedsl', 'flashinfer_cutlass', "
        "'flashinfer_moe_ep_cutedsl', 'flashinfer_moe_ep_mega_deep_gemm', 'flashinfer_trtllm', "
        "'flydsl', 'hpc', 'humming', 'marlin', 'rdna3', 'triton', 'triton_unfused')"
    )
    answer = info.value.to_json()
    assert answer["quantization"] is None and answer["moe_method"] is None
    assert answer["candidates"] == []
    assert answer["ruleset"] == DEFAULT_RULESET


def test_cli_select_with_upper_case_triton_picks_triton(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    args = ["select", "--config", str(config), "--gpu", "mi300x", "--moe-backend", "TRITON"]
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == "TRITON"
    assert main(args) == 0
    assert "backend: TRITON" in capsys.readouterr().out
