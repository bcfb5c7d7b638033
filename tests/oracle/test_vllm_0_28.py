"""vLLM 0.28's ruleset is 0.29's plus the rows 0.28.0's source differs in; each row here.

The checked-in record (tests/parity/records/vllm-0.28.jsonl.gz) proves the whole ruleset
against 0.28.0's own code; these name the delta rows so that a failure reads plainly, each
beside 0.29's answer to the same deployment.
"""

from __future__ import annotations

from typing import Any

from service.oracle.rulesets import RULESETS
from service.oracle.rulesets import vllm_0_28 as v028
from service.oracle.rulesets import vllm_0_29 as v029
from service.oracle.rulesets.kernel_names import MOE_BACKENDS_0_28, MOE_BACKENDS_0_29
from tests.oracle.specs import answer, ct, gptq, misanswered, reasons, spec

OLD, NEW = "vllm-0.28", "vllm-0.29"


def test_humming_takes_only_the_keys_it_lists() -> None:
    group_32 = spec(ct(group=32), "h200", moe_backend="humming")
    refused = answer(group_32, OLD)
    assert refused["error"]["type"] == "ValueError"
    assert reasons(refused)["HUMMING"] == (
        "kernel does not support quantization scheme "
        "QuantKey(uint4b8,scale(f16,static,GroupShape(row=1, col=32)),symmetric)xNone"
    )
    assert answer(group_32, NEW)["backend"] == "HUMMING"
    assert answer(spec(gptq(), "h200", moe_backend="humming"), OLD)["backend"] == "HUMMING"


def test_triton_wna16_has_no_asymmetric_keys_and_no_swigluoai_uninterleave() -> None:
    (triton,) = v028.EXPERTS_CLASSES["TRITON"]
    (newer,) = v029.EXPERTS_CLASSES["TRITON"]
    assert newer.activations - triton.activations == {"swigluoai_uninterleave"}
    uninterleave = spec(ct(), layer={"activation": "swigluoai_uninterleave"}, moe_backend="triton")
    assert reasons(answer(uninterleave, OLD))["TRITON"] == (
        "kernel does not support MoEActivation.SWIGLUOAI_UNINTERLEAVE activation"
    )
    assert answer(uninterleave, NEW)["backend"] == "TRITON"
    asymmetric = spec(ct(symmetric=False), moe_backend="triton")
    assert reasons(answer(asymmetric, OLD))["TRITON"].startswith(
        "kernel does not support quantization scheme QuantKey(uint4,"
    )


def test_compressed_tensors_8_bit_must_be_channel_wise_as_the_scheme_writes_it() -> None:
    grouped = answer(spec(ct(num_bits=8)), OLD)
    assert grouped["error"] == {"stage": "moe_method", "type": "AssertionError", "message": ""}
    unset = answer(spec(ct(group=None, strategy="channel", num_bits=8)), OLD)
    assert unset["error"]["type"] == "AssertionError"
    explicit = answer(spec(ct(group=-1, strategy="channel", num_bits=8)), OLD)
    assert explicit["backend"] == "MARLIN"
    assert answer(spec(ct(num_bits=8)), NEW)["backend"] == "MARLIN"


def test_compressed_tensors_refuses_widths_other_than_4_and_8() -> None:
    three_bit = answer(spec(ct(num_bits=3)), OLD)
    assert three_bit["error"] == {
        "stage": "moe_method",
        "type": "ValueError",
        "message": "CompressedTensorsWNA16MoEMethod only supports int4 and int8 now.",
    }
    assert three_bit["candidates"] == []
    assert answer(spec(ct(num_bits=3)), NEW)["backend"] == "HUMMING"


def test_asymmetric_compressed_tensors_runs_on_marlin_only() -> None:
    on_marlin = answer(spec(ct(symmetric=False)), OLD)
    assert on_marlin["backend"] == "MARLIN"
    emulated = answer(spec(ct(symmetric=False), moe_backend="emulation"), OLD)
    assert emulated["error"] == {
        "stage": "moe_method",
        "type": "AssertionError",
        "message": "Only symmetric quantization is supported for MoE",
    }
    assert answer(spec(ct(symmetric=False), moe_backend="emulation"), NEW)["backend"] == (
        "EMULATION"
    )


def test_the_format_refusal_reads_as_the_tuple_of_its_pieces() -> None:
    naive = {**ct(), "format": "naive-quantized"}
    old, new = answer(spec(naive), OLD), answer(spec(naive), NEW)
    assert old["error"]["message"] == (
        "('For Fused MoE layers, only format: ', 'pack-quantized ', "
        "' and bits: [2, 3, 4, 5, 6, 7, 8] is supported ', "
        "'but got format: pack-quantized  and bits: 4')"
    )
    assert new["error"]["message"] == (
        "For Fused MoE layers, only format: pack-quantized and bits: [2, 3, 4, 5, 6, 7, 8] "
        "is supported but got format: pack-quantized and bits: 4"
    )


def test_moe_wna16_8_bit_must_be_channel_wise() -> None:
    grouped = answer(spec(gptq(bits=8), quantization="moe_wna16"), OLD)
    assert grouped["error"] == {"stage": "moe_method", "type": "AssertionError", "message": ""}
    channel = answer(spec(gptq(bits=8, group_size=-1), quantization="moe_wna16"), OLD)
    assert channel["moe_method"] == "MoeWNA16Method" and channel["backend"] == "TRITON"
    assert answer(spec(gptq(bits=8), quantization="moe_wna16"), NEW)["backend"] == "TRITON"


def test_kernel_config_lacks_the_names_0_29_added() -> None:
    assert set(MOE_BACKENDS_0_29) - set(MOE_BACKENDS_0_28) == {
        "b12x",
        "flashinfer_moe_ep_mega_deep_gemm",
        "flashinfer_moe_ep_mega_cutedsl",
    }
    refused = answer(spec(gptq(), moe_backend="b12x"), OLD)
    assert refused["error"]["stage"] == "kernel_config"
    assert answer(spec(gptq(), moe_backend="b12x"), NEW)["error"]["stage"] != "kernel_config"


def test_everything_else_is_0_29_s() -> None:
    old, new = RULESETS[OLD], RULESETS[NEW]
    assert old.backends == new.backends and old.structural_rules is new.structural_rules
    assert old.priority is new.priority and old.user_backends == new.user_backends
    changed = {b for b in new.experts_classes if old.experts_classes[b] != new.experts_classes[b]}
    assert changed == set(v028.EXPERTS_DELTA) == {"HUMMING", "TRITON"}


def _reason_texts(expected: dict[str, Any]) -> str:
    error = expected.get("error") or {}
    reasons = " | ".join(c["reason"] for c in expected.get("candidates", []))
    return f"{error.get('stage')}: {error.get('message')} | {reasons}"


#: What identifies, in a recorded 0.28.0 answer, each row of the delta (a text it carries).
DELTA_ROWS = {
    "8-bit must be channel-wise": "moe_method:  |",
    "int4 and int8 only": "only supports int4 and int8 now.",
    "symmetric off Marlin": "Only symmetric quantization is supported for MoE",
    "format refusal in pieces": "('For Fused MoE layers, only format: ', ",
    "KernelConfig names": "kernel_config: argument --moe-backend: invalid choice",
    "Humming keys": "scheme QuantKey(uint4b8,scale(f16,static,GroupShape(row=1, col=32))",
    "Triton keys": "support quantization scheme QuantKey(uint4,",
    "Triton activations": "MoEActivation.SWIGLUOAI_UNINTERLEAVE activation",
    # Quark's legacy layer-config lookup walks a missing layer_quant_config unguarded and
    # reads the type table only after it.
    "Quark legacy lookup, no layer table": "argument of type 'NoneType' is not iterable",
    "Quark legacy lookup, type table": "'NoneType' object has no attribute 'items'",
}


def test_the_0_28_record_proves_every_delta_row() -> None:
    # 0.29's ruleset gets some of the record's answers wrong: each such answer carries one
    # of the delta rows' texts, and every row has at least one answer that proves it.
    wrong = [_reason_texts(expected) for _, expected in misanswered(OLD, NEW)]
    unexplained = [text for text in wrong if not any(t in text for t in DELTA_ROWS.values())]
    assert not unexplained, unexplained[:3]
    proved = {row for row, text in DELTA_ROWS.items() if any(text in w for w in wrong)}
    assert proved == set(DELTA_ROWS)
