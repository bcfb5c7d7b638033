"""What the oracle declares for the metrics' label lists is complete: every reason code a
check answers, every stage and vLLM exception type a `SelectionError` carries, every
integration a decision names. (The metrics create their series from these lists at start,
so a code missing here would be a series born at its first use.)"""

from __future__ import annotations

import ast
from itertools import product
from pathlib import Path
from typing import Any

import pytest

import service.oracle
from service.oracle import PLATFORM_PRESETS, RULESETS, SelectionError, select
from service.oracle.errors import STAGES, VLLM_EXCEPTIONS
from service.oracle.quantization import INTEGRATIONS

ORACLE = Path(service.oracle.__file__).parent
LAYER = {"num_experts": 60, "top_k": 4, "hidden_size": 2048, "intermediate_size": 1408}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
CT = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 128,
                "dynamic": False,
                "actorder": None,
            },
        }
    },
    "ignore": ["lm_head"],
}


def _constant(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def returned_codes() -> set[str]:
    """The code of every `return "CODE", "reason text"` in the oracle's checks (a tuple of
    two names, like a priority list, is not one)."""
    codes = set()
    for path in ORACLE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple):
                elements = node.value.elts
                code = _constant(elements[0]) if len(elements) == 2 else None
                text = elements[1] if len(elements) == 2 else None
                is_text = isinstance(text, ast.JoinedStr) or not (_constant(text) or "A").isupper()
                if code is not None and code.isupper() and is_text:
                    codes.add(code)
    return codes


def raised_errors() -> set[tuple[str | None, str | None]]:
    """(stage, type) of every `vllm_error(...)` / `ErrorInfo(...)` with literal arguments
    (None where the argument is a variable)."""
    found = set()
    for path in ORACLE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("vllm_error", "ErrorInfo")
                and len(node.args) >= 2
            ):
                found.add((_constant(node.args[0]), _constant(node.args[1])))
    return found


def test_every_reason_code_a_check_answers_is_declared() -> None:
    codes = returned_codes()
    assert {"DEVICE", "EXPERT_COUNT", "BF16_REQUIRED"} <= codes  # the scan finds them
    for ruleset in RULESETS.values():
        assert codes <= set(ruleset.reason_codes), codes - set(ruleset.reason_codes)
        assert len(set(ruleset.reason_codes)) == len(ruleset.reason_codes)


def test_every_stage_and_exception_type_raised_is_declared() -> None:
    raised = raised_errors()
    assert len(raised) >= 4
    stages = {stage for stage, _ in raised if stage is not None}
    types = {kind for _, kind in raised if kind is not None}
    assert stages == set(STAGES)
    assert types <= set(VLLM_EXCEPTIONS)


def _spec(quant: dict[str, Any], platform: str, quantization: str | None) -> dict[str, Any]:
    return {
        "hf_quantization_config": quant,
        "layer": LAYER,
        "platform": platform,
        "quantization": quantization,
    }


@pytest.mark.parametrize("quantization", [None, "moe_wna16", "marlin"])
def test_every_integration_a_decision_names_is_declared(quantization: str | None) -> None:
    for quant, preset in product((GPTQ, AWQ, CT), sorted(PLATFORM_PRESETS)):
        try:
            decision = select(_spec(quant, preset, quantization))
        except SelectionError as failure:
            assert failure.quantization is None or failure.quantization in INTEGRATIONS
            continue
        except service.oracle.InvalidSpecError:
            continue
        assert decision.quantization in INTEGRATIONS, decision.quantization
