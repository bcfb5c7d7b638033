"""HUMMING: the layout humming-kernels' MoE GEMM reads, produced by humming's own transform.

Humming's kernel layout (tiles interleaved for its MMA fragments, integer codes preprocessed
for its int -> float conversion, scales permuted) is humming's business and changes between
its releases, so we do not reimplement it: like vLLM 0.33 (`convert_to_humming_moe_kernel_format`
in quantization/utils/humming/moe.py), we hand humming tensors in its own *checkpoint* schema
and let it transform them on the GPU. Two steps:

1. `to_humming_schema` (ours, pure torch, CPU or GPU): canonical codes -> humming's
   ``quant_method: humming`` schema, per projection::

       weight       int32 [E, N, K*bits/32]  codes packed along K, lowest code in the lowest bits
       weight_scale [E, N, G]                in the activation dtype (vLLM casts to params_dtype)
       zero_point   int32 [E, N*bits/32, G]  real zero points packed along N (asymmetric only)
       bias         [E, N]                   in the activation dtype (optional)

   with ``b_dtype = uint{bits}`` (no zero point: the midpoint 2**(bits-1) is subtracted, as
   GPTQ's symmetric codes mean), ``weight_scale_group_size`` = group size (0: channelwise).
   That is compressed-tensors' pack-quantized packing with N-first weights.
2. `transform` (humming's code, CUDA only): the same calls vLLM makes: the schema's
   `convert_humming` (which may re-encode symmetric codes as sign-magnitude when none is 0,
   a data-dependent choice, hence the recorded config), then
   `prepare_and_transform_humming_tensors` with vLLM's padding (N to 256, K to 128).

Output tensors, by vLLM's parameter names: ``w13_weight``, ``w13_weight_scale``,
``w13_zero_point``, ``w13_bias`` and the ``w2_`` ones, plus ``w13_humming_config`` /
``w2_humming_config``: humming's `LayerConfig` as UTF-8 JSON bytes (uint8). The kernel needs
that config (shapes, padding, dtypes, the final weight type) and it depends on the data, so
it travels with the tensors; `service.kernels.humming` reads it back.

Act-order (g_idx) cannot be written: humming's GPTQ schema asserts ``not desc_act`` and vLLM
0.33 rejects desc_act checkpoints.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from typing import Any

import torch

from service.formats import bits as packing
from service.formats.canonical import QuantizedExperts, QuantizedMoELayer
from service.formats.errors import ConversionUnsupported
from service.formats.writers import ConversionOptions, ConvertedLayer, finish, weight_type

BACKEND = "HUMMING"
PAD_N = 256
PAD_K = 128
"""vLLM's `_prepare_and_transform_sublayer` pads N to a multiple of 256 and K to 128."""
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
CONFIG_SUFFIX = "_humming_config"


@dataclass(frozen=True)
class HummingSchema:
    """One projection in humming's own checkpoint schema (before its transform)."""

    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]
    shape_n: int
    shape_k: int


def activation_dtype(options: ConversionOptions) -> torch.dtype:
    """The dtype humming's kernels are built for (vLLM: the model's params_dtype)."""
    dtype = options.activation_dtype or torch.bfloat16
    if dtype not in ACTIVATION_DTYPES:
        raise ConversionUnsupported(
            BACKEND, f"humming's WNA16 path runs bfloat16 or float16 activations, not {dtype}"
        )
    return dtype


def check_supported(layer: QuantizedMoELayer) -> None:
    for name, experts in (("w13", layer.w13), ("w2", layer.w2)):
        if experts.g_idx is not None:
            raise ConversionUnsupported(
                BACKEND,
                f"{name} has act-order (g_idx): humming's GPTQ schema asserts not desc_act, "
                "and vLLM 0.33 rejects desc_act checkpoints",
            )
        if experts.n % (32 // experts.bits) and experts.zeros is not None:
            raise ConversionUnsupported(
                BACKEND, f"{name}: zero points need N % {32 // experts.bits} == 0"
            )
        if experts.k * experts.bits % 32:
            raise ConversionUnsupported(BACKEND, f"{name}: K={experts.k} does not fill int32 words")


def to_humming_schema(experts: QuantizedExperts, dtype: torch.dtype) -> HummingSchema:
    """Canonical projection -> humming's ``quant_method: humming`` tensors and schema config."""
    tensors: dict[str, torch.Tensor] = {
        "weight": packing.pack(experts.codes, experts.bits, 2, torch.int32),
        "weight_scale": experts.scales.to(dtype).contiguous(),
    }
    if experts.zeros is not None:
        tensors["zero_point"] = packing.pack(experts.zeros, experts.bits, 1, torch.int32)
    if experts.bias is not None:
        tensors["bias"] = experts.bias.to(dtype).contiguous()
    config = {
        "quant_method": "humming",
        "b_dtype": f"uint{experts.bits}",
        "bs_dtype": str(dtype).removeprefix("torch."),
        "weight_scale_group_size": 0 if experts.group_size == -1 else experts.group_size,
        "has_zero_point": experts.zeros is not None,
    }
    return HummingSchema(tensors=tensors, config=config, shape_n=experts.n, shape_k=experts.k)


def transform(
    schema: HummingSchema,
    *,
    dtype: torch.dtype,
    device: torch.device,
    num_experts: int,
    gated_halves: int = 1,
) -> tuple[dict[str, torch.Tensor], str]:
    """Humming's own transform of one projection on `device`: (kernel tensors, config JSON).

    `gated_halves` is 2 for w13 of a gated layer: vLLM then tells humming the N axis is two
    stacked shards (gate, up), which matters for schemas that carry per-shard scales.
    """
    schemas = importlib.import_module("humming.schema")
    prepare_and_transform = importlib.import_module(
        "humming.transform"
    ).prepare_and_transform_humming_tensors

    weight_schema = schemas.BaseWeightSchema.from_config(dict(schema.config))
    input_schema = schemas.HummingInputSchema()
    tensors = {name: t.to(device) for name, t in schema.tensors.items()}
    shard = schema.shape_n // gated_halves
    weight_schema, tensors = weight_schema.convert_humming(
        tensors=tensors,
        shape_n_stacks=[shard] * gated_halves,
        shape_k_stacks=[schema.shape_k],
        param_dtype=dtype,
        num_experts=num_experts,
        device=device,
    )
    config, out = prepare_and_transform(
        tensors=tensors,
        shape_n=schema.shape_n,
        shape_k=schema.shape_k,
        pad_n_to_multiple=PAD_N,
        pad_k_to_multiple=PAD_K,
        input_schema=input_schema,
        weight_schema=weight_schema,
        has_bias="bias" in schema.tensors,
        num_experts=num_experts,
        torch_dtype=dtype,
        device=device,
    )
    return dict(out), str(config.to_str())


def config_tensor(config_json: str) -> torch.Tensor:
    """A JSON string as a uint8 tensor, so it travels with the weights."""
    return torch.frombuffer(bytearray(config_json.encode()), dtype=torch.uint8).clone()


def config_from_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(bytes(tensor.cpu().tolist()).decode())
    return data


def _device(layer: QuantizedMoELayer, options: ConversionOptions) -> torch.device:
    if options.device is not None:
        device = torch.device(options.device)
    elif layer.w13.codes.is_cuda:
        device = layer.w13.codes.device
    else:
        device = torch.device("cuda")
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ConversionUnsupported(
            BACKEND, "needs humming-kernels' own transform on a CUDA worker (no CUDA GPU here)"
        )
    return device


def write_humming(
    layer: QuantizedMoELayer, *, source: str, options: ConversionOptions
) -> ConvertedLayer:
    check_supported(layer)
    device = _device(layer, options)
    try:
        importlib.import_module("humming")
    except ImportError as exc:
        raise ConversionUnsupported(
            BACKEND, f"humming-kernels is not installed on this worker ({exc})"
        ) from None
    dtype = activation_dtype(options)
    gated = layer.w13.n == 2 * layer.w2.k
    out: dict[str, torch.Tensor | None] = {}
    for name, experts, halves in (("w13", layer.w13, 2 if gated else 1), ("w2", layer.w2, 1)):
        schema = to_humming_schema(experts, dtype)
        tensors, config = transform(
            schema, dtype=dtype, device=device, num_experts=experts.num_experts, gated_halves=halves
        )
        for key in ("weight", "weight_scale", "zero_point", "bias"):
            out[f"{name}_{key}"] = tensors.get(key)
        out[name + CONFIG_SUFFIX] = config_tensor(config).to(device)
    return finish(
        out,
        backend=BACKEND,
        source=source,
        layer=layer,
        weight_type_name=weight_type(layer.w13),
        options=options,
    )
