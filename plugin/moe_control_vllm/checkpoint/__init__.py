"""Serving checkpoints converted by ``moe-control convert``: the ``moe_control`` method.

`register()` adds the quantization method to vLLM (vLLM's out-of-tree registration,
``register_quantization_config``). The plugin's entry point calls it in every vLLM process;
a converted checkpoint's config.json names the method, so ``vllm serve <converted dir>``
needs no flag. Nothing is imported from vLLM or torch until it is called.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Register the ``moe_control`` quantization method with vLLM (idempotent)."""
    from vllm.model_executor.layers.quantization import register_quantization_config

    from moe_control_vllm.checkpoint.config import MoeControlConfig
    from moe_control_vllm.checkpoint.manifest import QUANT_METHOD

    register_quantization_config(QUANT_METHOD)(MoeControlConfig)
