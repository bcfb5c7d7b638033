"""vLLM 0.30's ruleset is 0.31's plus the rows 0.30.0's source differs in; each row here.

The checked-in record (tests/parity/records/vllm-0.30.jsonl.gz) proves the whole ruleset
against 0.30.0's own code; these name the delta rows so that a failure reads plainly.
"""

from __future__ import annotations

from typing import Any

import pytest

from service.oracle import InvalidSpecError, SelectionError, select
from service.oracle.platform import DECISION_ENV_FLAGS
from service.oracle.rulesets import RULESETS, get_ruleset
from service.oracle.rulesets import vllm_0_30 as v030
from service.oracle.rulesets import vllm_0_31 as v031
from tests.oracle.specs import ct, misanswered, spec
from tests.parity.grid import generate

ZEN_CPU = {"preset": "cpu", "packages": ["zentorch"]}


def test_the_series_resolves_here() -> None:
    assert get_ruleset("v0.30.0") is RULESETS["vllm-0.30"] is v030.RULESET


def test_zen_cpu_does_not_exist() -> None:
    assert "ZEN_CPU" in v031.RULESET.backends
    assert "ZEN_CPU" not in v030.RULESET.backends
    assert "ZEN_CPU" not in v030.RULESET.experts_classes
    assert all("ZEN_CPU" not in rule.backends for rule in v030.RULESET.structural_rules)
    assert v030.PRIORITY.cpu == ("CPU",)


def test_a_zen_cpu_with_zentorch_gets_cpu() -> None:
    assert select(spec(platform=ZEN_CPU), ruleset="vllm-0.31").backend == "ZEN_CPU"
    decision = select(spec(platform=ZEN_CPU), ruleset="vllm-0.30")
    assert decision.backend == "CPU"
    assert [c.backend for c in decision.candidates] == ["CPU"]


def test_the_other_rules_are_0_31_s_in_order() -> None:
    kept = [r for r in v031.RULESET.structural_rules if r.backends != frozenset({"ZEN_CPU"})]
    assert [(r.backends, r.code) for r in v030.RULESET.structural_rules] == [
        (r.backends, r.code) for r in kept
    ]


def test_vllm_cpu_int4_w4a8_is_a_field_error_naming_what_0_30_reads() -> None:
    platform = {**ZEN_CPU, "env": {"VLLM_CPU_INT4_W4A8": "0"}}
    in_0_31 = select(spec(platform=platform), ruleset="vllm-0.31")
    assert in_0_31.backend == "CPU"
    assert in_0_31.candidates[0].reason == "VLLM_CPU_INT4_W4A8=0 disables the DA8W4 path"
    with pytest.raises(InvalidSpecError) as caught:
        select(spec(platform=platform), ruleset="vllm-0.30")
    (violation,) = caught.value.violations
    assert violation.field == "platform.env.VLLM_CPU_INT4_W4A8"
    assert "vllm-0.30" in violation.description
    assert str(sorted(RULESETS["vllm-0.31"].env_flags - {"VLLM_CPU_INT4_W4A8"})) in (
        violation.description
    )
    assert "VLLM_CPU_INT4_W4A8" in DECISION_ENV_FLAGS


def test_the_flags_0_30_reads_are_still_accepted() -> None:
    platform = {"preset": "a100", "env": {"VLLM_BATCH_INVARIANT": "1"}}
    decision = select(spec(platform=platform), ruleset="vllm-0.30")
    reasons = {c.backend: c.reason for c in decision.candidates}
    assert reasons["MARLIN"] == "kernel does not support batch invariance"
    assert decision.backend == select(spec(platform=platform), ruleset="vllm-0.31").backend


@pytest.mark.parametrize("bits", [2, 3, 5, 6, 7])
def test_asymmetric_ct_widths_other_than_4_and_8_raise_key_error(bits: int) -> None:
    with pytest.raises(SelectionError) as caught:
        select(spec(ct(num_bits=bits, symmetric=False)), ruleset="vllm-0.30")
    assert caught.value.to_json()["error"] == {
        "stage": "moe_method",
        "type": "KeyError",
        "message": str(bits),
    }
    try:
        select(spec(ct(num_bits=bits, symmetric=False)), ruleset="vllm-0.31")
    except SelectionError as exc:
        assert exc.to_json()["error"]["type"] != "KeyError"


@pytest.mark.parametrize("bits", [4, 8])
def test_asymmetric_4_and_8_bit_ct_and_symmetric_3_bit_reach_the_oracle(bits: int) -> None:
    for quant in (ct(bits, symmetric=False), ct(3, symmetric=True)):
        try:
            decision = select(spec(quant), ruleset="vllm-0.30")
        except SelectionError as exc:
            assert exc.to_json()["error"]["stage"] == "backend"
        else:
            assert decision.backend is not None


def test_ct_expert_bias_is_a_0_30_hazard() -> None:
    for release, expected in (("vllm-0.30", True), ("vllm-0.31", False)):
        quant = ct(symmetric=True)
        decision = select(spec(quant, layer={"has_bias": True}), ruleset=release)
        codes = {h.code for h in decision.hazards}
        assert ("CT_EXPERT_BIAS_NOT_LOADED" in codes) is expected, release


def test_expert_load_balancing_on_xpu_is_refused_by_0_30s_parallel_config() -> None:
    on_xpu = [
        s for s in generate() if s["platform"]["device"] == "xpu" and s["parallel"]["enable_eplb"]
    ]
    assert on_xpu
    for deployment in on_xpu:
        with pytest.raises(SelectionError) as newer:  # 0.31's method refuses EPLB itself
            select(deployment, ruleset="vllm-0.31")
        assert newer.value.error.type != "ValidationError"
        with pytest.raises(SelectionError) as caught:
            select(deployment, ruleset="vllm-0.30")
        assert caught.value.error.type == "ValidationError"
        assert "only supported on CUDA devices or ROCm devices" in caught.value.error.message


def test_the_0_30_record_tells_the_releases_apart() -> None:
    # 0.31's ruleset fails exactly four kinds of the record's answers: AMD Quark int4
    # weight-only layers (0.31 added its WNA16 MoE method), CPU deployments (ZEN_CPU is among
    # 0.31's candidates), asymmetric compressed-tensors checkpoints of widths without a
    # zero-point type, and EPLB on XPU; so the record proves each row.
    specs = generate()
    wrong = {spec["id"] for spec, _ in misanswered("vllm-0.30", "vllm-0.31")}

    def kind(spec: dict[str, Any]) -> str | None:
        weights = [
            group.get("weights") or {}
            for group in (spec["hf_quantization_config"].get("config_groups") or {}).values()
        ]
        if spec["hf_quantization_config"].get("quant_method") == "quark":
            return "quark-w4a16"
        if spec["platform"]["device"] == "cpu":
            return "cpu"
        if any(not w.get("symmetric", True) and w.get("num_bits") not in (4, 8) for w in weights):
            return "ct-zero-point-width"
        if spec["platform"]["device"] == "xpu" and spec["parallel"]["enable_eplb"]:
            return "xpu-eplb"
        return None

    kinds = {spec["id"]: kind(spec) for spec in specs}
    assert {kinds[spec_id] for spec_id in wrong} == {
        "quark-w4a16",
        "cpu",
        "ct-zero-point-width",
        "xpu-eplb",
    }
