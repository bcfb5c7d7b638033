"""The deployment one decision was for, as vLLM saw it, in the spec form the moe-control
server decides (SelectBackend's `spec_json`): the checkpoint's `quantization_config`,
vLLM's resolved `--quantization`, the MoE layer, the parallel layout, the platform, the
`--moe-backend` and LoRA.

Where the facts come from: the layer from the `FusedMoEConfig` the integration passed; the
platform from the `current_platform` of vLLM's own int_wna16 module (the one the decision
read), its package probes and the environment; the model from vLLM's current config
(its model config), else from the last quantization config vLLM built in this process (a
process that builds layers without a model config, such as vLLM's own layer tests).
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from collections.abc import Mapping
from typing import Any, NamedTuple

#: The VLLM_* flags that reach the WNA16 MoE decision (the server's list: a test checks that
#: the two agree). Only these are sent; no other variable of the process ever is.
DECISION_ENV_FLAGS = (
    "VLLM_USE_FLASHINFER_MOE_INT4",
    "VLLM_BATCH_INVARIANT",
    "VLLM_HUMMING_MOE_GEMM_TYPE",
    "VLLM_MARLIN_INPUT_DTYPE",
    "VLLM_CPU_INT4_W4A8",
)

#: vLLM's `RoutingMethodType` name -> the spec's routing inputs that give it (vLLM's
#: `get_routing_method_type` read backwards). A method the spec cannot express (a custom
#: router) is sent as "Unspecified"; a server answer that depends on it then shows as a
#: mismatch rather than being hidden.
ROUTING_INPUTS: Mapping[str, Mapping[str, Any]] = {
    "Default": {"scoring_func": "softmax", "renormalize": False},
    "RenormalizeNaive": {"scoring_func": "softmax", "renormalize": True},
    "Sigmoid": {"scoring_func": "sigmoid", "renormalize": False},
    "SigmoidRenorm": {"scoring_func": "sigmoid", "renormalize": True},
    "MiniMax2": {"scoring_func": "sigmoid", "renormalize": True, "e_score_correction_bias": True},
    "DeepSeekV3": {
        "scoring_func": "sigmoid",
        "renormalize": True,
        "e_score_correction_bias": True,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
    },
    "DeepseekV4": {"scoring_func": "sqrtsoftplus", "renormalize": True},
    "Unspecified": {"scoring_func": "sqrtsoftplus", "renormalize": False},
}


class ModelFacts(NamedTuple):
    """What vLLM knows of the model: its name, resolved quantization method and the
    checkpoint's quantization config."""

    model: str | None = None
    quantization: str | None = None
    hf_quantization_config: Mapping[str, Any] | None = None


def hf_quantization_config(model_config: Any) -> dict[str, Any] | None:
    """The checkpoint's quantization config, looked up where vLLM's get_quant_config looks."""
    hf_config = getattr(model_config, "hf_config", None)
    found = getattr(hf_config, "quantization_config", None)
    if found is None:
        found = getattr(getattr(model_config, "hf_text_config", None), "quantization_config", None)
    if found is None:
        found = getattr(hf_config, "compression_config", None)
    if found is None:
        return None
    if not isinstance(found, Mapping) and hasattr(found, "to_dict"):
        found = found.to_dict()
    return dict(found) if isinstance(found, Mapping) else None


def facts_of(model_config: Any) -> ModelFacts:
    model = getattr(model_config, "model", None)
    quantization = getattr(model_config, "quantization", None)
    return ModelFacts(
        model=None if model is None else str(model),
        quantization=None if quantization is None else str(quantization),
        hf_quantization_config=hf_quantization_config(model_config),
    )


def current_vllm_config() -> Any:
    config_module = sys.modules.get("vllm.config")
    current = getattr(config_module, "get_current_vllm_config_or_none", None)
    return None if current is None else current()


def model_facts(remembered: ModelFacts | None) -> ModelFacts:
    """The model's facts from vLLM's current config, else the remembered ones."""
    vllm_config = current_vllm_config()
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is not None:
        return facts_of(model_config)
    return remembered or ModelFacts()


def _dtype(value: Any) -> str | None:
    return None if value is None else str(value).removeprefix("torch.")


def layer(config: Any, name: str) -> dict[str, Any]:
    """The layer's shape and routing from its FusedMoEConfig."""
    routing_name = getattr(config.routing_method, "name", str(config.routing_method))
    routing = dict(ROUTING_INPUTS.get(routing_name, ROUTING_INPUTS["Unspecified"]))
    router_dtype = _dtype(config.router_logits_dtype)
    if router_dtype is not None:
        routing["router_logits_dtype"] = router_dtype
    return {
        "name": name,
        "num_experts": int(config.num_logical_experts),
        "top_k": int(config.experts_per_token),
        "hidden_size": int(config.hidden_dim_unpadded or config.hidden_dim),
        "intermediate_size": int(config.intermediate_size),
        "activation": str(getattr(config.activation, "value", config.activation)),
        "has_bias": bool(config.has_bias),
        "dtype": _dtype(config.in_dtype),
        "routing": routing,
    }


def parallel(config: Any) -> dict[str, Any]:
    """The parallel layout: vLLM's ParallelConfig where one is current, else what the
    layer's FusedMoEParallelConfig says of it."""
    par = getattr(current_vllm_config(), "parallel_config", None)
    moe = config.moe_parallel_config
    if par is not None:
        return {
            "tensor_parallel_size": int(par.tensor_parallel_size),
            "data_parallel_size": int(par.data_parallel_size),
            "enable_expert_parallel": bool(par.enable_expert_parallel),
            "all2all_backend": str(par.all2all_backend),
            "enable_eplb": bool(par.enable_eplb),
        }
    world = int(moe.ep_size if moe.use_ep else moe.tp_size)
    return {
        "tensor_parallel_size": max(1, world // max(1, int(moe.dp_size))),
        "data_parallel_size": int(moe.dp_size),
        "enable_expert_parallel": bool(moe.use_ep),
        "all2all_backend": str(moe.all2all_backend),
        "enable_eplb": bool(moe.enable_eplb),
    }


def _device(platform: Any) -> str:
    for kind in ("cuda", "rocm", "xpu", "cpu"):
        if getattr(platform, f"is_{kind}")():
            return kind
    return str(getattr(platform, "device_type", "unknown"))


def _packages(platform: Any) -> list[str]:
    """The optional kernel packages vLLM's own probes find (as the decision reads them)."""
    found = []
    if importlib.import_module("vllm.utils.import_utils").has_humming():
        found.append("humming")
    if importlib.import_module("vllm.utils.flashinfer").has_flashinfer():
        found.append("flashinfer")
    if getattr(platform, "is_zen_cpu", lambda: False)():
        found.append("zentorch")  # vLLM picks its Zen CPU platform where zentorch is
    if platform.is_cpu() and importlib.import_module("vllm.triton_utils").HAS_TRITON:
        found.append("triton")  # on a CPU: triton-cpu, as the CPU platform's check reads it
    return sorted(found)


def platform(iw: types.ModuleType) -> dict[str, Any]:
    """The platform as the decision saw it: int_wna16's `current_platform`."""
    current = iw.current_platform
    device = _device(current)
    found: dict[str, Any] = {"device": device}
    if device in ("cuda", "rocm"):
        capability = current.get_device_capability()
        if capability is not None:
            found["capability"] = f"{capability.major}.{capability.minor}"
    if device == "rocm":
        arch = getattr(sys.modules.get("vllm.platforms.rocm"), "_GCN_ARCH", None)
        if arch:
            found["arch"] = str(arch).split(":")[0]
    if device == "cpu":
        import torch
        from vllm.platforms.interface import CpuArchEnum

        found["amx"] = bool(torch.cpu._is_amx_tile_supported())
        found["x86"] = current.get_cpu_architecture() == CpuArchEnum.X86
    found["packages"] = _packages(current)
    found["env"] = {k: os.environ[k] for k in DECISION_ENV_FLAGS if k in os.environ}
    return found


def deployment(
    iw: types.ModuleType, config: Any, layer_name: str, facts: ModelFacts
) -> dict[str, Any]:
    """The whole spec of one decision."""
    return {
        "hf_quantization_config": dict(facts.hf_quantization_config or {}),
        "quantization": facts.quantization,
        "layer": layer(config, layer_name),
        "parallel": parallel(config),
        "platform": platform(iw),
        "moe_backend": str(config.moe_backend),
        "lora": bool(config.is_lora_enabled),
    }
