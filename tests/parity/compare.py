"""Our oracle's answer in the reference runner's shape, and a field-by-field comparison."""

from __future__ import annotations

from typing import Any

from service.oracle import DEFAULT_RULESET, InvalidSpecError, SelectionError, select

#: The fields both sides give and that must agree exactly.
COMPARED = (
    "quantization",
    "moe_method",
    "backend",
    "experts_class",
    "weight_key",
    "may_have_zp",
    "may_have_bias",
    "allow_tile_padding",
    "error",
)


def ours(spec: dict[str, Any], ruleset: str = DEFAULT_RULESET) -> dict[str, Any]:
    """The oracle's answer to a normalised spec under `ruleset`, shaped like the reference's."""
    try:
        result = select({k: v for k, v in spec.items() if k != "id"}, ruleset=ruleset).to_json()
    except SelectionError as exc:
        result = exc.to_json()
    except InvalidSpecError as exc:
        return {"invalid": str(exc)}
    result["candidates"] = [
        {"backend": c["backend"], "verdict": c["verdict"], "reason": c["reason"]}
        for c in result.get("candidates", [])
    ]
    return result


def differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Every field where our answer departs from vLLM's, as readable lines."""
    if "harness_error" in expected:
        return [f"reference harness error: {expected['harness_error']}"]
    if "invalid" in actual:
        return [f"oracle rejected the spec: {actual['invalid']}"]
    diffs = [
        f"{key}: vllm={expected.get(key)!r} ours={actual.get(key)!r}"
        for key in COMPARED
        if expected.get(key) != actual.get(key)
    ]
    theirs, mine = expected.get("candidates", []), actual.get("candidates", [])
    if len(theirs) != len(mine):
        diffs.append(f"candidates: vllm={theirs!r} ours={mine!r}")
    else:
        diffs.extend(
            f"candidate {i}: vllm={a!r} ours={b!r}"
            for i, (a, b) in enumerate(zip(theirs, mine, strict=True))
            if a != b
        )
    return diffs
