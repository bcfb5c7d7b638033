"""ParallelConfig's refusal of expert-parallel load balancing, per release: vLLM 0.30 and
older balance on CUDA and ROCm only, 0.31 and later on XPU too."""

from __future__ import annotations

from typing import Any

import pytest

from service.oracle import PLATFORM_PRESETS, SelectionError, select
from service.oracle.parallel_config import eplb_refusal
from service.oracle.spec import ParallelSpec

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
EPLB = {
    "data_parallel_size": 2,
    "enable_expert_parallel": True,
    "all2all_backend": "deepep_high_throughput",
    "enable_eplb": True,
}


def xpu_spec(parallel: dict[str, Any]) -> dict[str, Any]:
    return {
        "hf_quantization_config": GPTQ,
        "layer": {"num_experts": 128, "top_k": 8, "hidden_size": 2048, "intermediate_size": 768},
        "platform": PLATFORM_PRESETS["xpu"].to_json(),
        "parallel": parallel,
    }


@pytest.mark.parametrize("ruleset", ["vllm-0.29", "vllm-0.30"])
def test_eplb_on_xpu_is_vllm_s_validation_error_up_to_0_30(ruleset: str) -> None:
    with pytest.raises(SelectionError) as caught:
        select(xpu_spec(EPLB), ruleset=ruleset)
    answer = caught.value.to_json()
    assert answer["quantization"] == "auto_gptq" and answer["moe_method"] is None
    assert answer["error"] == {
        "stage": "moe_method",
        "type": "ValidationError",
        "message": "1 validation error for ParallelConfig\n"
        "  Value error, Expert parallelism load balancing is only supported on CUDA devices "
        "or ROCm devices now. [type=value_error, input_value=ArgsKwargs((), "
        "{'tensor_p...eepep_high_throughput'}), input_type=ArgsKwargs]\n"
        "    For further information visit https://errors.pydantic.dev/2.14/v/value_error",
    }


@pytest.mark.parametrize("ruleset", ["vllm-0.31", "vllm-0.33"])
def test_eplb_on_xpu_reaches_the_oracle_from_0_31(ruleset: str) -> None:
    # The oracle picks XPU; then the layer refuses EPLB for a method that cannot balance.
    with pytest.raises(SelectionError) as caught:
        select(xpu_spec(EPLB), ruleset=ruleset)
    answer = caught.value.to_json()
    assert answer["candidates"][0]["backend"] == "XPU"
    assert answer["error"]["message"] == "EPLB is not supported AutoGPTQMoEMethod."


def test_no_refusal_without_eplb_or_on_a_balancing_device() -> None:
    parallel = ParallelSpec(enable_expert_parallel=True)
    assert eplb_refusal(parallel, "xpu", ("cuda", "rocm"), "auto_gptq") is None
    balanced = ParallelSpec(enable_expert_parallel=True, enable_eplb=True)
    assert eplb_refusal(balanced, "rocm", ("cuda", "rocm"), "auto_gptq") is None
    refused = eplb_refusal(balanced, "xpu", ("cuda", "rocm", "xpu"), "auto_gptq")
    assert refused is None
