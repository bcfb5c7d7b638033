"""vLLM 0.34's ruleset is 0.33's plus the rows 0.34.0's source differs in; each row here.

The checked-in record (tests/parity/records/vllm-0.34.jsonl.gz) proves the whole ruleset
against 0.34.0's own code; these name the delta rows so that a failure reads plainly.
"""

from __future__ import annotations

from typing import Any

import pytest

from service.oracle import DEFAULT_RULESET, InvalidSpecError, select
from service.oracle.rulesets import RULESETS
from service.oracle.rulesets import vllm_0_34 as v034
from service.oracle.spec import ALL2ALL_BACKENDS
from tests.oracle.specs import GPTQ, QWEN3, answer, ct, misanswered, reasons, spec

NEW, OLD = "vllm-0.34", "vllm-0.33"
DEEPEP_V2 = {
    "data_parallel_size": 2,
    "enable_expert_parallel": True,
    "all2all_backend": "deepep_v2",
}
PADDED = "kernel does not support ('padded_standard',) activation format"


def test_0_34_is_the_default() -> None:
    assert DEFAULT_RULESET == NEW and RULESETS[NEW] is v034.RULESET


@pytest.mark.parametrize(
    ("quant", "platform", "old", "new"),
    [
        (GPTQ, {"preset": "a100", "packages": []}, "MARLIN", "EMULATION"),
        (ct(group=32), {"preset": "a100", "packages": []}, "MARLIN", "TRITON"),
        (GPTQ, "h200", "HUMMING", "HUMMING"),
    ],
)
def test_deepep_v2_hands_padded_rows_that_marlin_cannot_take(
    quant: dict[str, Any], platform: Any, old: str, new: str
) -> None:
    deployment = spec(quant, platform, layer=QWEN3, parallel=DEEPEP_V2)
    assert answer(deployment, OLD)["backend"] == old
    decided = answer(deployment, NEW)
    assert decided["backend"] == new
    if new != "HUMMING":
        assert reasons(decided)["MARLIN"] == PADDED
        assert reasons(decided)["BATCHED_MARLIN"] == PADDED


def test_deepep_v2_without_data_parallel_is_standard() -> None:
    tp_only = {
        "tensor_parallel_size": 2,
        "enable_expert_parallel": True,
        "all2all_backend": "deepep_v2",
    }
    deployment = spec(GPTQ, {"preset": "a100", "packages": []}, layer=QWEN3, parallel=tp_only)
    assert answer(deployment, NEW)["backend"] == "MARLIN"


def test_every_release_takes_deepep_v2_and_only_its_own_all2all_backends() -> None:
    deployment = spec(GPTQ, "a100", layer=QWEN3, parallel=DEEPEP_V2)
    for name, ruleset in RULESETS.items():
        assert "deepep_v2" in ruleset.all2all_backends
        assert answer(deployment, name)["backend"] is not None
    assert set(ALL2ALL_BACKENDS) == {b for r in RULESETS.values() for b in r.all2all_backends}
    mori = spec(GPTQ, "mi300x", layer=QWEN3, parallel={**DEEPEP_V2, "all2all_backend": "mori"})
    assert answer(mori, NEW)["ruleset"] == NEW
    with pytest.raises(InvalidSpecError) as caught:
        select(mori, ruleset=OLD)
    (violation,) = caught.value.violations
    assert violation.field == "parallel.all2all_backend"
    assert "vllm-0.33 has no all2all backend 'mori'" in violation.description
    assert str(list(RULESETS[OLD].all2all_backends)) in violation.description


def test_the_parallel_config_reason_prints_mori_ep_v2() -> None:
    two_sided = {**DEEPEP_V2, "all2all_backend": "flashinfer_nvlink_two_sided"}
    deployment = spec(GPTQ, "a100", layer=QWEN3, parallel=two_sided)
    assert reasons(answer(deployment, NEW))["MARLIN"].endswith(
        "enable_eplb=False, mori_ep_v2=False)"
    )
    assert reasons(answer(deployment, OLD))["MARLIN"].endswith("enable_eplb=False)")


@pytest.mark.parametrize("value", ["fp8", "int8"])
def test_marlin_input_dtype_fails_at_start_up(value: str) -> None:
    platform = {"preset": "a100", "env": {"VLLM_MARLIN_INPUT_DTYPE": value}}
    error = answer(spec(GPTQ, platform), NEW)["error"]
    assert error == {
        "stage": "environment",
        "type": "ValueError",
        "message": f"VLLM_MARLIN_INPUT_DTYPE has been removed. {v034.MARLIN_INPUT_DTYPE_HINT}",
    }
    # 0.33 refused fp8 only where Marlin's W4A8-FP8 is not built (not SM89/SM12x), later.
    old = answer(spec(GPTQ, platform), OLD)
    assert (old.get("error") or {}).get("stage") == ("moe_method" if value == "fp8" else None)


def test_the_model_runner_v1_is_gone() -> None:
    def on(value: str) -> dict[str, Any]:
        return spec(GPTQ, {"preset": "h200", "env": {"VLLM_USE_V2_MODEL_RUNNER": value}})

    assert answer(on("0"), NEW)["error"] == {
        "stage": "environment",
        "type": "ValueError",
        "message": "VLLM_USE_V2_MODEL_RUNNER=0 is no longer supported: Model Runner V1 has "
        "been removed. Unset this variable.",
    }
    assert answer(on("1"), NEW)["backend"] == "HUMMING"
    # Older releases start whatever it says: the decision is the one without it.
    assert answer(on("0"), OLD)["backend"] == answer(spec(GPTQ, "h200"), OLD)["backend"]


def test_an_x86_cpu_without_triton_cpu_fails_at_start_up() -> None:
    bare = spec(GPTQ, {"preset": "cpu", "packages": []})
    assert answer(bare, NEW)["error"] == {
        "stage": "platform",
        "type": "RuntimeError",
        "message": "vLLM on x86 CPUs requires Triton (triton-cpu).",
    }
    assert answer(bare, OLD)["backend"] == "CPU"
    assert answer(spec(GPTQ, "cpu"), NEW)["backend"] == "CPU"  # the preset has triton-cpu
    arm = spec(GPTQ, {"preset": "cpu", "packages": [], "x86": False})
    assert (answer(arm, NEW)["error"] or {}).get("stage") == "backend"


ZEN = {"preset": "cpu", "packages": ["triton", "zentorch"]}


def test_zentorch_takes_int8_weights() -> None:
    decided = answer(spec(ct(num_bits=8), ZEN), NEW)
    assert (decided["backend"], decided["experts_class"]) == ("ZEN_CPU", "ZentorchExpertsWNA16")
    assert reasons(answer(spec(ct(num_bits=8), ZEN), OLD))["ZEN_CPU"].startswith(
        "kernel does not support quantization scheme QuantKey(uint8b128"
    )


def test_zentorch_reads_the_weight_width() -> None:
    assert reasons(answer(spec(ct(num_bits=3), ZEN), NEW))["ZEN_CPU"] == (
        "unsupported weight width W3A16"
    )
    assert reasons(answer(spec(ct(None, "channel", num_bits=8), ZEN), NEW))["ZEN_CPU"] == (
        "the dynamic-quant path requires group-quantized weights"
    )


def test_zentorch_takes_minimax2_routing() -> None:
    minimax2 = {"scoring_func": "sigmoid", "e_score_correction_bias": True}
    deployment = spec(GPTQ, ZEN, layer={**QWEN3, "routing": minimax2})
    assert answer(deployment, NEW)["backend"] == "ZEN_CPU"
    assert reasons(answer(deployment, OLD))["ZEN_CPU"] == "kernel does not support routing method 7"


def test_the_0_34_record_tells_the_releases_apart() -> None:
    """0.33's ruleset gets some of 0.34.0's recorded answers wrong, and only where a delta row
    of this module acts: data parallelism (DeepEP v2, the parallel repr), the start-up
    refusals (environment, triton-cpu) and ZEN_CPU's rules (tried first on every CPU)."""
    wrong = misanswered(NEW, OLD)
    assert wrong
    assert not misanswered(NEW, NEW)
    for scenario, _ in wrong:
        platform, parallel = scenario["platform"], scenario["parallel"]
        assert (
            parallel["data_parallel_size"] > 1
            or platform["env"]
            or platform["device"] == "cpu"  # ZEN_CPU's rules, triton-cpu
        ), scenario["id"]
