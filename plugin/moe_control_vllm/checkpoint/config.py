"""The ``moe_control`` quantization method: vLLM's config object for a converted checkpoint.

Built by vLLM from config.json's ``quantization_config`` (`ServingConfig`). It wraps the
source checkpoint's own vLLM config, built from the source quantization config the
converter recorded: linear, embedding and every other non-MoE layer get the source's method
unchanged (their tensors were copied as they were). A MoE layer gets the source's MoE method
with the converted backend forced (vLLM's oracle still checks that this platform can run
it) and its weights step replaced (`experts.adopt`). The manifest is read once vLLM hands
the config the model directory (`maybe_update_config`).

A converted checkpoint holds whole experts in the kernel layout, so it is served with one
tensor-parallel rank per MoE layer and no expert parallelism; anything else is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from vllm.model_executor.layers.quantization import get_quantization_config
from vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)

from moe_control_vllm.checkpoint import experts, slots
from moe_control_vllm.checkpoint.manifest import (
    QUANT_METHOD,
    ConvertedCheckpointError,
    Manifest,
    ServingConfig,
)

__all__ = ["MoeControlConfig"]


class MoeControlConfig(QuantizationConfig):  # type: ignore[misc]  # (vLLM's, untyped here)
    """A checkpoint whose MoE layers moe-control converted into a kernel layout."""

    def __init__(self, serving: ServingConfig) -> None:
        super().__init__()
        if serving.backend not in slots.FORCED_BACKEND:
            raise ConvertedCheckpointError(
                f"converted for {serving.backend}; this plugin serves "
                f"{', '.join(sorted(slots.FORCED_BACKEND))} checkpoints"
            )
        self.serving = serving
        source_cls = get_quantization_config(serving.source_method)
        self.source = source_cls.from_config(dict(serving.source_quantization_config))
        self.manifest: Manifest | None = None
        # vLLM asks the instance; the source's kernels set the bar.
        self.get_min_capability = self.source.get_min_capability  # type: ignore[method-assign]

    @classmethod
    def get_name(cls) -> Any:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return list(self.source.get_supported_act_dtypes())

    @classmethod
    def get_min_capability(cls) -> int:
        """The lowest bar of vLLM's WNA16 configs (an instance answers its source's)."""
        return 70

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MoeControlConfig:
        return cls(ServingConfig.from_quantization_config(config))

    def maybe_update_config(
        self, model_name: str, hf_config: Any = None, revision: str | None = None
    ) -> None:
        """vLLM hands over the model: read (and check) its manifest."""
        self.source.maybe_update_config(model_name, hf_config=hf_config, revision=revision)
        directory = Path(model_name)
        if not directory.is_dir():
            raise ConvertedCheckpointError(
                f"{model_name!r} is not a local directory: serve a converted checkpoint "
                "from the directory moe-control wrote"
            )
        self.manifest = Manifest.load(directory, self.serving)

    def apply_vllm_mapper(self, hf_to_vllm_mapper: Any) -> None:
        self.source.apply_vllm_mapper(hf_to_vllm_mapper)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from vllm.model_executor.layers.fused_moe import RoutedExperts

        # Models fill the mapping in after the config is built; the source needs it to
        # resolve fused linear layers (qkv_proj, gate_up_proj) to their shards' method.
        self.source.packed_modules_mapping = self.packed_modules_mapping
        if not isinstance(layer, RoutedExperts):
            return self.source.get_quant_method(layer, prefix)
        return self._experts_method(layer, prefix)

    def _experts_method(self, layer: Any, prefix: str) -> QuantizeMethodBase:
        if self.manifest is None:
            raise ConvertedCheckpointError(
                "the manifest is not read yet (vLLM did not call maybe_update_config)"
            )
        converted = self.manifest.layer_for(prefix)
        moe = layer.moe_config
        parallel = moe.moe_parallel_config
        if parallel.tp_size != 1 or parallel.use_ep:
            raise ConvertedCheckpointError(
                f"{prefix}: a converted checkpoint holds whole experts in the kernel layout; "
                f"serve it without tensor or expert parallelism over its experts "
                f"(here tp_size={parallel.tp_size}, expert parallel={parallel.use_ep})"
            )
        backend = self.serving.backend
        forced = slots.FORCED_BACKEND[backend]
        if moe.moe_backend not in ("auto", forced):
            raise ConvertedCheckpointError(
                f"--moe-backend {moe.moe_backend}: this checkpoint was converted for {backend} "
                f"(leave it auto, or {forced})"
            )
        # The layer's own config: this layer runs the converted backend, and the method
        # built from it below asks vLLM's oracle for exactly that backend.
        moe.moe_backend = forced
        method = self.source.get_quant_method(layer, prefix)
        return experts.adopt(method, converted, backend, prefix)
