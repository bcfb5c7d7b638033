"""A deployment spec from a model's Hugging Face config.json.

MoE families name the same things differently (`num_local_experts` in Mixtral, `num_experts`
in Qwen, `n_routed_experts` in DeepSeek; `moe_intermediate_size` next to a dense
`intermediate_size`). This reads the MoE layer's shape and router from whichever names the
family uses, so a user can hand over config.json as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.oracle.errors import FieldViolation, InvalidSpecError
from service.oracle.spec import MAX_SIZE

_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts")
_INTERMEDIATE_KEYS = ("moe_intermediate_size", "expert_intermediate_size", "intermediate_size")
_ACTIVATIONS = {"silu": "silu", "swiglu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}
#: Families whose MoE block is not named `mlp` in vLLM's module tree.
_MOE_BLOCK_NAMES = {"mixtral": "block_sparse_moe", "phimoe": "block_sparse_moe"}


def _first(config: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return None


def _number(
    config: Mapping[str, Any], key: str, default: float, violations: list[FieldViolation]
) -> Any:
    """An optional numeric field the spec derives from (not one it copies through to its own
    validation); anything but a finite number of a size a spec holds is a violation naming
    `config.<key>` (NaN compares false, so it fails the bound too)."""
    value = config.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not abs(value) <= MAX_SIZE:
        violations.append(
            FieldViolation(f"config.{key}", f"must be a number of magnitude <= {MAX_SIZE}")
        )
        return default
    return value


def _count(config: Mapping[str, Any], key: str, violations: list[FieldViolation]) -> int | None:
    """An optional count the spec derives from: a non-negative integer or absent."""
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        violations.append(
            FieldViolation(f"config.{key}", f"must be an integer >= 0, got {value!r}")
        )
        return None
    return value


def deployment_from_model_config(config_json: Mapping[str, Any]) -> dict[str, Any]:
    """Build a deployment spec (without platform) from a model's config.json object."""
    if not isinstance(config_json, Mapping):
        raise InvalidSpecError.single("config", "config.json must hold a JSON object")
    text = config_json.get("text_config")
    config: Mapping[str, Any] = (
        {**config_json, **text} if isinstance(text, Mapping) else config_json
    )
    violations: list[FieldViolation] = []
    quant = config.get("quantization_config")
    if not isinstance(quant, Mapping):
        violations.append(
            FieldViolation("config.quantization_config", "the model is not quantized")
        )
    num_experts = _first(config, _EXPERT_COUNT_KEYS)
    top_k = _first(config, _TOP_K_KEYS)
    intermediate = _first(config, _INTERMEDIATE_KEYS)
    hidden = config.get("hidden_size")
    for value, keys in (
        (num_experts, _EXPERT_COUNT_KEYS),
        (top_k, _TOP_K_KEYS),
        (intermediate, _INTERMEDIATE_KEYS),
        (hidden, ("hidden_size",)),
    ):
        if value is None:
            violations.append(
                FieldViolation(f"config.{keys[0]}", f"not a MoE config: none of {list(keys)}")
            )
    first_moe_layer = _count(config, "first_k_dense_replace", violations) or 0
    n_group = _count(config, "n_group", violations)
    scaling = _number(config, "routed_scaling_factor", 1.0, violations)
    if violations:
        raise InvalidSpecError(violations)
    model_type = str(config.get("model_type", ""))
    block = _MOE_BLOCK_NAMES.get(model_type, "mlp")
    scoring = config.get("scoring_func") or "softmax"
    grouped = n_group is not None and n_group > 1
    renormalize = config.get("norm_topk_prob")
    if renormalize is None:
        renormalize = model_type not in ("qwen2_moe",)
    return {
        "hf_quantization_config": dict(quant),  # type: ignore[arg-type]
        "layer": {
            "name": f"model.layers.{first_moe_layer}.{block}.experts",
            "num_experts": num_experts,
            "top_k": top_k,
            "hidden_size": hidden,
            "intermediate_size": intermediate,
            "activation": _ACTIVATIONS.get(str(config.get("hidden_act", "silu")), "silu"),
            "dtype": "float16" if config.get("torch_dtype") == "float16" else "bfloat16",
            "routing": {
                "scoring_func": scoring,
                "renormalize": bool(renormalize),
                "use_grouped_topk": grouped,
                "num_expert_group": n_group if grouped else None,
                "topk_group": config.get("topk_group") if grouped else None,
                "e_score_correction_bias": config.get("topk_method") == "noaux_tc",
                "routed_scaling_factor": float(scaling or 1.0),
            },
        },
    }
