"""vLLM 0.31's ruleset is 0.32's plus the rows 0.31.0's source differs in; each row here.

The checked-in record (tests/parity/records/vllm-0.31.jsonl.gz) proves the whole ruleset
against 0.31.0's own code; these name the delta rows so that a failure reads plainly.
"""

from __future__ import annotations

from typing import Any

import pytest

from service.oracle import PLATFORM_PRESETS, SelectionError, select
from service.oracle.hazards import RELEASE_HAZARDS
from service.oracle.rulesets import RULESETS, get_ruleset
from service.oracle.rulesets import vllm_0_31 as v031
from service.oracle.rulesets import vllm_0_32 as v032
from service.oracle.rulesets.kernel_names import MOE_BACKENDS_0_31, MOE_BACKENDS_0_32
from tests.oracle.specs import GPTQ, QWEN3, ct, misanswered, spec
from tests.parity.grid import generate
from tests.parity.records import load, record_path

CT_W4A16_G32 = ct(group=32, symmetric=True)


def qwen3(**fields: Any) -> dict[str, Any]:
    """Qwen3-30B-A3B's layer, GPTQ, on an H200."""
    return spec(GPTQ, "h200", model=QWEN3, **fields)


def test_the_series_resolves_here() -> None:
    assert get_ruleset("0.31.2") is RULESETS["vllm-0.31"] is v031.RULESET


def test_sm90_keeps_marlin_ahead_of_humming_without_prioritize_humming() -> None:
    assert select(qwen3(), ruleset="vllm-0.31").backend == "MARLIN"
    assert select(qwen3(), ruleset="vllm-0.32").backend == "HUMMING"
    order = v031.PRIORITY(PLATFORM_PRESETS["h200"])
    assert order.index("MARLIN") < order.index("HUMMING")


@pytest.mark.parametrize("platform", ["a100", "b200", "rtx5090", "mi300x", "gfx1100", "cpu", "xpu"])
def test_the_order_elsewhere_is_0_32_s(platform: str) -> None:
    profile = PLATFORM_PRESETS[platform]
    assert v031.PRIORITY(profile) == v032.RULESET.priority(profile)


def test_kernel_config_names_differ_from_0_32_s_in_three_entries() -> None:
    assert set(MOE_BACKENDS_0_31) ^ set(MOE_BACKENDS_0_32) == {
        "flashinfer_moe_ep_mega_cutedsl",
        "flashinfer_moe_ep_cutedsl",
        "aiter_mega_moe",
    }
    assert "flashinfer_moe_ep_mega_cutedsl" in MOE_BACKENDS_0_31
    for name, release, stage in (
        ("flashinfer_moe_ep_mega_cutedsl", "vllm-0.31", "backend"),
        ("flashinfer_moe_ep_mega_cutedsl", "vllm-0.32", "kernel_config"),
        ("aiter_mega_moe", "vllm-0.31", "kernel_config"),
        ("aiter_mega_moe", "vllm-0.32", "backend"),
    ):
        with pytest.raises(SelectionError) as caught:
            select(qwen3(moe_backend=name), ruleset=release)
        assert caught.value.to_json()["error"]["stage"] == stage, (name, release)


def test_rdna3_carries_the_0_31_conversion_hazard_only_there() -> None:
    ct_on_gfx1100 = spec(CT_W4A16_G32, "gfx1100", model=QWEN3)
    codes = {}
    for release in ("vllm-0.31", "vllm-0.32", "vllm-0.33"):
        decision = select(ct_on_gfx1100, ruleset=release)
        assert decision.backend == "RDNA3"
        codes[release] = {h.code for h in decision.hazards}
    assert "RDNA3_CONVERSION_LAYOUT" in codes["vllm-0.31"]
    assert "RDNA3_CONVERSION_LAYOUT" not in codes["vllm-0.32"] | codes["vllm-0.33"]


def test_every_release_hazard_names_known_rulesets() -> None:
    for row in RELEASE_HAZARDS:
        assert row.rulesets and row.rulesets <= set(RULESETS), row.code


def test_everything_else_is_0_32_s() -> None:
    old, new = v031.RULESET, v032.RULESET
    assert old.backends == new.backends and old.structural_rules is new.structural_rules
    assert old.experts_classes == new.experts_classes and old.user_backends == new.user_backends
    assert old.env_flags == new.env_flags and old.integrations == new.integrations
    assert old.priority.gpu == new.priority.gpu and old.priority.cpu == new.priority.cpu


def test_the_0_31_record_tells_the_releases_apart() -> None:
    # 0.32's ruleset fails exactly two kinds of the record's answers: CUDA SM90 deployments,
    # where prioritize_humming moved HUMMING ahead, and the kernel_config refusals, whose
    # choice lists differ; so the record proves both rows.
    record = load(record_path("vllm-0.31"))
    specs = generate()
    wrong = {spec["id"] for spec, _ in misanswered("vllm-0.31", "vllm-0.32")}
    on_sm90 = {
        spec["id"]
        for spec in specs
        if spec["platform"]["device"] == "cuda" and spec["platform"]["capability"] == "9.0"
    }
    refused = {
        spec["id"]
        for spec, expected in zip(specs, record.answers, strict=True)
        if (expected.get("error") or {}).get("stage") == "kernel_config"
    }
    assert wrong & on_sm90 and refused
    assert wrong == (wrong & on_sm90) | refused
