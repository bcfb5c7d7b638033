"""vLLM 0.27's ruleset is 0.28's plus the rows 0.27.0's source differs in; each row here.

The checked-in record (tests/parity/records/vllm-0.27.jsonl.gz) proves the whole ruleset
against 0.27.0's own code; these name the delta rows so that a failure reads plainly, each
beside 0.28's answer to the same deployment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from service.oracle import PLATFORM_PRESETS, resolve_ruleset
from service.oracle.rulesets import RULESETS
from service.oracle.rulesets import vllm_0_27 as v027
from service.oracle.rulesets import vllm_0_28 as v028
from tests.oracle.specs import GPTQ, answer, ct, misanswered, reasons, spec

OLD, NEW = "vllm-0.27", "vllm-0.28"
CT = ct()


def test_0_27_1_answers_as_0_27() -> None:
    assert resolve_ruleset("0.27.1") == OLD
    assert RULESETS[OLD].release.range_text == ">=0.27.0,<0.28"


def test_the_cpu_backend_needs_no_amx() -> None:
    assert answer(spec(GPTQ, "cpu-noamx"), OLD)["backend"] == "CPU"
    refused = answer(spec(GPTQ, "cpu-noamx"), NEW)
    assert reasons(refused)["CPU"] == "kernel does not support current device cpu"


def test_triton_has_no_padded_expert_cap() -> None:
    many = spec(CT, "mi300x", layer={"num_experts": 993}, moe_backend="triton")
    assert answer(many, OLD)["backend"] == "TRITON"
    assert reasons(answer(many, NEW))["TRITON"] == (
        "kernel's moe_align_block_size requires fewer than 1024 padded experts"
    )
    assert v027.TRITON_WNA16.extra_checks == () and len(v028.TRITON_WNA16.extra_checks) == 1


def test_humming_lists_its_activations_without_situ_and_swigluoai_uninterleave() -> None:
    for activation in ("situ", "swigluoai_uninterleave"):
        forced = spec(GPTQ, "h200", layer={"activation": activation}, moe_backend="humming")
        assert reasons(answer(forced, OLD))["HUMMING"] == (
            f"kernel does not support MoEActivation.{activation.upper()} activation"
        )
        assert answer(forced, NEW)["backend"] == "HUMMING"


def test_humming_declares_no_batch_invariance() -> None:
    h200 = PLATFORM_PRESETS["h200"].to_json()
    invariant = {**h200, "env": {"VLLM_BATCH_INVARIANT": "1"}}
    forced = spec(GPTQ, invariant, moe_backend="humming")
    assert reasons(answer(forced, OLD))["HUMMING"] == "kernel does not support batch invariance"
    assert answer(forced, NEW)["backend"] == "HUMMING"


def test_a_non_gated_layer_warns_of_the_doubled_w13() -> None:
    non_gated = spec(GPTQ, layer={"activation": "silu_no_mul"})
    old, new = answer(non_gated, OLD), answer(non_gated, NEW)
    assert old["backend"] == new["backend"]
    assert "NON_GATED_W13_DOUBLED" in {h["code"] for h in old["hazards"]}
    assert "NON_GATED_W13_DOUBLED" not in {h["code"] for h in new["hazards"]}


def test_compressed_tensors_on_humming_warns_of_the_conversion_type_error() -> None:
    forced = spec(CT, "h200", moe_backend="humming")
    for ruleset in (OLD, NEW):
        result = answer(forced, ruleset)
        assert result["backend"] == "HUMMING"
        assert "CT_HUMMING_SCHEMA_TYPE_ERROR" in {h["code"] for h in result["hazards"]}
    assert "CT_HUMMING_SCHEMA_TYPE_ERROR" not in {
        h["code"] for h in answer(forced, "vllm-0.29")["hazards"]
    }


def test_everything_else_is_0_28_s() -> None:
    old, new = RULESETS[OLD], RULESETS[NEW]
    assert old.backends == new.backends and old.structural_rules is new.structural_rules
    assert old.priority is new.priority and old.user_backends == new.user_backends
    assert old.kernel_config_moe_backends == new.kernel_config_moe_backends
    changed = {b for b in new.experts_classes if old.experts_classes[b] != new.experts_classes[b]}
    assert changed == set(v027.EXPERTS_DELTA) == {"CPU", "HUMMING", "TRITON", "EMULATION"}
    rocm_old = old.integrations.platform_quantizations["rocm"]
    assert new.integrations.platform_quantizations["rocm"] - rocm_old == {"inc"}


def _humming_reason(expected: dict[str, Any]) -> str:
    return next((c["reason"] for c in expected["candidates"] if c["backend"] == "HUMMING"), "")


#: What identifies each row of the delta in a recorded 0.27.0 answer and its scenario.
DELTA_ROWS: dict[str, Callable[[dict[str, Any], dict[str, Any]], bool]] = {
    "CPU on any CPU": lambda spec_, _: (
        spec_["platform"]["device"] == "cpu" and not spec_["platform"]["amx"]
    ),
    "no padded-expert cap": lambda spec_, _: spec_["layer"]["num_experts"] >= 993,
    "Humming activations": lambda _, expected: _humming_reason(expected).endswith(
        ("SITU activation", "SWIGLUOAI_UNINTERLEAVE activation")
    ),
    "Humming batch invariance": lambda _, expected: (
        _humming_reason(expected) == "kernel does not support batch invariance"
    ),
}


def test_the_0_27_record_proves_every_delta_row() -> None:
    # 0.28's ruleset gets some of the record's answers wrong: each such scenario is one of
    # a delta row's, and every row has at least one that proves it.
    wrong = misanswered(OLD, NEW)
    unexplained = [s["id"] for s, e in wrong if not any(p(s, e) for p in DELTA_ROWS.values())]
    assert not unexplained, unexplained[:3]
    proved = {row for row, p in DELTA_ROWS.items() if any(p(s, e) for s, e in wrong)}
    assert proved == set(DELTA_ROWS)
