"""Synthetic quantized MoE checkpoints on disk, for tests, benchmarks and demos.

Nothing is ever downloaded: expert weights come from our own quantizer
(`service.formats.synthetic.quantize`) and are packed by our own GPTQ/AWQ/compressed-tensors packers
(`readers.write_checkpoint`), then laid out like a Hugging Face model directory (config.json,
sharded safetensors and their index, a tokenizer file) with Mixtral's
(`block_sparse_moe.experts.N.w1/w2/w3`) or Qwen/DeepSeek's (`mlp.experts.N.gate_proj/...`)
names, plus the attention, norm, router and embedding tensors a real model has, so the
copy path is exercised too.

`fast=True` draws the integer codes and scales directly instead of quantizing float
weights: at Mixtral-8x7B size the quantizer's float work dominates and the codes' statistics
do not matter to a format conversion.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from service.formats.canonical import QuantizedExperts, QuantizedMoELayer
from service.formats.io.safetensors import SafetensorsWriter, plan_of, tensor_bytes
from service.formats.readers import LAYOUTS, SourceQuantization, write_checkpoint
from service.formats.synthetic.quantize import act_order_g_idx, random_layer

#: family -> (model_type, experts block name, Mixtral or HF projection naming)
FAMILIES: dict[str, tuple[str, str, str]] = {
    "mixtral": ("mixtral", "block_sparse_moe", "mixtral"),
    "qwen3_moe": ("qwen3_moe", "mlp", "hf"),
    "qwen2_moe": ("qwen2_moe", "mlp", "hf"),
    "deepseek_v3": ("deepseek_v3", "mlp", "hf"),
}


@dataclass(frozen=True)
class SyntheticSpec:
    family: str = "mixtral"
    layout: str = "gptq"
    num_layers: int = 2
    num_experts: int = 4
    top_k: int = 2
    hidden_size: int = 128
    intermediate_size: int = 256
    bits: int = 4
    group_size: int = 64
    symmetric: bool = True
    desc_act: bool = False
    vocab_size: int = 64
    shards: int = 2
    seed: int = 0
    fast: bool = False
    dtype: torch.dtype = torch.float16

    def quantization_config(self) -> dict[str, Any]:
        if self.layout == "gptq":
            return {
                "quant_method": "gptq",
                "bits": self.bits,
                "group_size": self.group_size,
                "sym": self.symmetric,
                "desc_act": self.desc_act,
            }
        if self.layout == "awq":
            return {
                "quant_method": "awq",
                "bits": self.bits,
                "group_size": self.group_size,
                "zero_point": not self.symmetric,
                "version": "gemm",
            }
        if self.layout == "compressed-tensors":
            weights = {
                "num_bits": self.bits,
                "type": "int",
                "symmetric": self.symmetric,
                "strategy": "channel" if self.group_size == -1 else "group",
                "group_size": None if self.group_size == -1 else self.group_size,
                "actorder": "group" if self.desc_act else None,
                "dynamic": False,
            }
            return {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
                "ignore": ["lm_head"],
            }
        raise ValueError(f"no synthetic checkpoints in layout {self.layout!r}")

    def config(self) -> dict[str, Any]:
        model_type, _, _ = FAMILIES[self.family]
        config: dict[str, Any] = {
            "architectures": [f"{model_type}ForCausalLM"],
            "model_type": model_type,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "torch_dtype": "float16" if self.dtype == torch.float16 else "bfloat16",
            "quantization_config": self.quantization_config(),
        }
        if self.family == "mixtral":
            config |= {
                "num_local_experts": self.num_experts,
                "num_experts_per_tok": self.top_k,
                "intermediate_size": self.intermediate_size,
            }
        else:
            config |= {
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.top_k,
                "moe_intermediate_size": self.intermediate_size,
                "intermediate_size": self.intermediate_size * 4,
            }
        return config


def _fast_experts(
    spec: SyntheticSpec, n: int, k: int, generator: torch.Generator
) -> QuantizedExperts:
    e, bits = spec.num_experts, spec.bits
    groups = 1 if spec.group_size == -1 else k // spec.group_size
    codes = torch.randint(0, 1 << bits, (e, n, k), dtype=torch.uint8, generator=generator)
    scales = (torch.rand(e, n, groups, generator=generator) * 0.01 + 0.001).to(spec.dtype)
    zeros = None
    if not spec.symmetric:
        zeros = torch.randint(1, 1 << bits, (e, n, groups), dtype=torch.uint8, generator=generator)
    g_idx = (
        act_order_g_idx(e, k, spec.group_size, generator)
        if spec.desc_act and spec.group_size != -1
        else None
    )
    return QuantizedExperts(codes, scales, bits, spec.group_size, zeros, g_idx)


def synthetic_layer(spec: SyntheticSpec, generator: torch.Generator) -> QuantizedMoELayer:
    if spec.fast:
        return QuantizedMoELayer(
            w13=_fast_experts(spec, 2 * spec.intermediate_size, spec.hidden_size, generator),
            w2=_fast_experts(spec, spec.hidden_size, spec.intermediate_size, generator),
        )
    return random_layer(
        spec.num_experts,
        spec.hidden_size,
        spec.intermediate_size,
        bits=spec.bits,
        group_size=spec.group_size,
        symmetric=spec.symmetric,
        generator=generator,
        act_order=spec.desc_act and spec.group_size != -1,
        scale_dtype=spec.dtype,
    )


def _dense_quantized(prefix: str, n: int, k: int, generator: torch.Generator) -> dict[str, Any]:
    """A GPTQ-packed dense projection (attention), copied unchanged by a conversion."""
    groups = max(1, k // 64)
    return {
        f"{prefix}.qweight": torch.randint(
            -(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, generator=generator
        ),
        f"{prefix}.qzeros": torch.full((groups, n // 8), 0x77777777, dtype=torch.int32),
        f"{prefix}.scales": torch.rand(groups, n, generator=generator).to(torch.float16),
    }


def to_device(layer: QuantizedMoELayer, device: str | torch.device) -> QuantizedMoELayer:
    """The same layer with every tensor on `device`."""

    def move(experts: QuantizedExperts) -> QuantizedExperts:
        return dataclasses.replace(
            experts,
            **{
                name: getattr(experts, name).to(device)
                for name in ("codes", "scales", "zeros", "g_idx", "bias")
                if getattr(experts, name) is not None
            },
        )

    return QuantizedMoELayer(w13=move(layer.w13), w2=move(layer.w2))


def layer_tensors(
    spec: SyntheticSpec, index: int, generator: torch.Generator, device: str = "cpu"
) -> tuple[dict[str, torch.Tensor], QuantizedMoELayer]:
    """Every tensor of decoder layer `index` (checkpoint names) and its MoE layer; the
    packing runs on `device` (a GPU packs a Mixtral-size layer in a fraction of a second)."""
    _, block, naming = FAMILIES[spec.family]
    base = f"model.layers.{index}"
    h = spec.hidden_size
    tensors: dict[str, torch.Tensor] = {}
    for proj in ("q_proj", "o_proj"):
        tensors |= _dense_quantized(f"{base}.self_attn.{proj}", h, h, generator)
    tensors[f"{base}.input_layernorm.weight"] = torch.ones(h, dtype=spec.dtype)
    tensors[f"{base}.post_attention_layernorm.weight"] = torch.ones(h, dtype=spec.dtype)
    tensors[f"{base}.{block}.gate.weight"] = torch.randn(
        spec.num_experts, h, generator=generator
    ).to(spec.dtype)
    layer = synthetic_layer(spec, generator)
    quant = SourceQuantization(
        bits=spec.bits,
        group_size=spec.group_size,
        symmetric=spec.symmetric,
        desc_act=spec.desc_act and spec.group_size != -1,
    )
    packed = to_device(layer, device) if device != "cpu" else layer
    experts = write_checkpoint(LAYOUTS[spec.layout], packed, quant, naming=naming)
    module = f"{base}.{block}.experts"
    tensors |= {f"{module}.{key}": tensor.cpu() for key, tensor in experts.items()}
    return tensors, layer


def write_synthetic_checkpoint(
    directory: Path, spec: SyntheticSpec, *, device: str = "cpu", keep_layers: bool = True
) -> dict[int, QuantizedMoELayer]:
    """Write a model directory; returns each decoder layer's canonical MoE layer (what a
    correct conversion must reproduce), or nothing without `keep_layers` (at Mixtral size
    the canonical codes of eight layers take 11 GB)."""
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(spec.seed)
    shards = max(1, min(spec.shards, spec.num_layers))
    names = [
        f"model-{i + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        for i in range(shards)
    ]
    weight_map: dict[str, str] = {}
    layers: dict[int, QuantizedMoELayer] = {}
    total = 0
    per_shard = -(-spec.num_layers // shards)
    for shard, name in enumerate(names):
        tensors: dict[str, torch.Tensor] = {}
        if shard == 0:
            tensors["model.embed_tokens.weight"] = torch.randn(
                spec.vocab_size, spec.hidden_size, generator=generator
            ).to(spec.dtype)
        for index in range(shard * per_shard, min(spec.num_layers, (shard + 1) * per_shard)):
            layer_dict, layer = layer_tensors(spec, index, generator, device)
            tensors |= layer_dict
            if keep_layers:
                layers[index] = layer
            del layer
        if shard == shards - 1:
            tensors["model.norm.weight"] = torch.ones(spec.hidden_size, dtype=spec.dtype)
            tensors["lm_head.weight"] = torch.randn(
                spec.vocab_size, spec.hidden_size, generator=generator
            ).to(spec.dtype)
        _save(directory / name, tensors)
        for tensor_name, tensor in tensors.items():
            weight_map[tensor_name] = name
            total += tensor.numel() * tensor.element_size()
        del tensors
    if shards > 1:
        index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
    (directory / "config.json").write_text(json.dumps(spec.config(), indent=2))
    (directory / "tokenizer.json").write_text(json.dumps({"model": {"type": "synthetic"}}))
    return layers


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    plans = [plan_of(name, tensor) for name, tensor in tensors.items()]
    with SafetensorsWriter(path, plans, {"format": "pt"}) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor_bytes(tensor))
        writer.commit()
