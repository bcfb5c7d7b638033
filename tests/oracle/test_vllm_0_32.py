"""vLLM 0.32's ruleset is 0.33's plus the rows 0.32.0's source differs in; each row here.

The checked-in record (tests/parity/records/vllm-0.32.jsonl.gz) proves the whole ruleset
against 0.32.0's own code; these name the delta rows so that a failure reads plainly.
"""

from __future__ import annotations

from typing import Any

import pytest

from service.oracle import DEFAULT_RULESET, SelectionError, select
from service.oracle.rulesets import RULESETS, get_ruleset
from service.oracle.rulesets import vllm_0_32 as v032
from service.oracle.rulesets import vllm_0_33 as v033
from service.oracle.rulesets.kernel_names import MOE_BACKENDS_0_32, MOE_BACKENDS_0_33
from tests.oracle.specs import GPTQ, misanswered, spec
from tests.parity.compare import differences, ours
from tests.parity.grid import generate
from tests.parity.records import load, record_path


def cpu_spec(activation: str, **fields: Any) -> dict[str, Any]:
    """A GPTQ Mixtral layer with `activation` on a CPU."""
    return spec(GPTQ, "cpu", layer={"activation": activation}, **fields)


def _backend(spec: dict[str, Any], ruleset: str) -> str | None:
    try:
        return select(spec, ruleset=ruleset).to_json()["backend"]
    except SelectionError:
        return None


def test_a_0_32_patch_release_resolves_to_0_32() -> None:
    assert DEFAULT_RULESET != "vllm-0.32"
    assert get_ruleset("0.32.5") is RULESETS["vllm-0.32"] is v032.RULESET


def test_cpu_int4_takes_gelu_tanh_from_0_33_only() -> None:
    assert v032.CPU_INT4.activations == frozenset({"silu"})
    assert v033.CPU_INT4.activations == frozenset({"silu", "gelu_tanh"})
    assert _backend(cpu_spec("silu"), "vllm-0.32") == _backend(cpu_spec("silu"), "vllm-0.33")
    assert _backend(cpu_spec("gelu_tanh"), "vllm-0.33") == "CPU"
    assert _backend(cpu_spec("gelu_tanh"), "vllm-0.32") is None


def test_cpu_int4_rejects_gelu_tanh_with_vllm_s_reason_in_0_32() -> None:
    with pytest.raises(SelectionError) as caught:
        select(cpu_spec("gelu_tanh", moe_backend="auto"), ruleset="vllm-0.32")
    candidates = {c["backend"]: c for c in caught.value.to_json()["candidates"]}
    assert candidates["CPU"]["reason"].endswith("MoEActivation.GELU_TANH activation")


@pytest.mark.parametrize(
    ("dtype", "routing", "in_0_32", "in_0_33"),
    [
        ("float32", "Simulated", True, False),
        ("float32", "DeepSeekV3", True, True),
        ("float32", "Renormalize", False, False),
        ("bfloat16", "Simulated", True, True),
    ],
)
def test_trtllm_mxint4_router_logits(
    dtype: str, routing: str, in_0_32: bool, in_0_33: bool
) -> None:
    for cls, expected in ((v032.TRTLLM_MXINT4, in_0_32), (v033.TRTLLM_MXINT4, in_0_33)):
        assert cls.supports_router_logits is not None
        assert cls.supports_router_logits(dtype, routing) is expected


def test_trtllm_mxint4_accepts_simulated_routing_in_0_32_only() -> None:
    assert v032.TRTLLM_MXINT4.routing_methods is not None
    assert v033.TRTLLM_MXINT4.routing_methods is not None
    assert v032.TRTLLM_MXINT4.routing_methods - v033.TRTLLM_MXINT4.routing_methods == {"Simulated"}


def test_kernel_config_lacks_aiter_triton_mxfp4_mxfp4_in_0_32() -> None:
    assert set(MOE_BACKENDS_0_33) - set(MOE_BACKENDS_0_32) == {"aiter_triton_mxfp4_mxfp4"}
    spec = cpu_spec("silu", moe_backend="aiter_triton_mxfp4_mxfp4")
    with pytest.raises(SelectionError) as caught:
        select(spec, ruleset="vllm-0.32")
    assert caught.value.to_json()["error"]["stage"] == "kernel_config"
    with pytest.raises(SelectionError) as other:
        select(spec, ruleset="vllm-0.33")
    assert other.value.to_json()["error"]["stage"] != "kernel_config"


def test_everything_else_is_0_33_s() -> None:
    old, new = v032.RULESET, v033.RULESET
    assert old.backends == new.backends and old.structural_rules is new.structural_rules
    assert old.priority is new.priority and old.user_backends == new.user_backends
    changed = {b for b in new.experts_classes if old.experts_classes[b] != new.experts_classes[b]}
    assert changed == set(v032.EXPERTS_DELTA) == {"CPU", "FLASHINFER_TRTLLM"}


def test_the_0_32_record_tells_the_releases_apart() -> None:
    # 0.33's ruleset fails exactly two kinds of the record's answers: the kernel_config
    # refusals, whose choice lists name aiter_triton_mxfp4_mxfp4, and GELU_TANH layers on an
    # AMX CPU, which 0.32's CPUExpertsInt4 refuses; so the record proves both rows.
    record = load(record_path("vllm-0.32"))
    specs = generate()
    wrong = {spec["id"] for spec, _ in misanswered("vllm-0.32", "vllm-0.33")}
    refused = {
        spec["id"]
        for spec, expected in zip(specs, record.answers, strict=True)
        if (expected.get("error") or {}).get("stage") == "kernel_config"
    }
    gelu_tanh_on_cpu = {
        spec["id"]
        for spec in specs
        if spec["id"].endswith("|gelu-tanh")
        and spec["id"].split("|")[0].startswith("cpu")
        and differences(record.answers[specs.index(spec)], ours(spec, "vllm-0.33"))
    }
    assert refused and gelu_tanh_on_cpu
    assert wrong == refused | gelu_tanh_on_cpu
