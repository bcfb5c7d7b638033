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
    if violations:
        raise InvalidSpecError(violations)
    model_type = str(config.get("model_type", ""))
    first_moe_layer = int(config.get("first_k_dense_replace") or 0)
    block = _MOE_BLOCK_NAMES.get(model_type, "mlp")
    scoring = config.get("scoring_func") or "softmax"
    grouped = bool(config.get("n_group")) and int(config.get("n_group") or 1) > 1
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
                "num_expert_group": config.get("n_group") if grouped else None,
                "topk_group": config.get("topk_group") if grouped else None,
                "e_score_correction_bias": config.get("topk_method") == "noaux_tc",
                "routed_scaling_factor": float(config.get("routed_scaling_factor") or 1.0),
            },
        },
    }
