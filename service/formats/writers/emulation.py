"""EMULATION: dense 16-bit weights, what vLLM's int4 emulation experts multiply with.

Outputs ``w13_weight`` [E, N13, H] and ``w2_weight`` [E, H, I] in `options.dense_dtype`
(bfloat16, as vLLM 0.33 hard-codes), plus the biases. Each element is
``(code - zero[g]) * scale[g]`` computed exactly in float32 (a <= 8-bit integer times a
16-bit scale fits its 24-bit mantissa) and rounded once: `QuantizedExperts.dequantize`.

Where we depart from vLLM 0.33 (`_process_weights_emulation_gptq/_awq`), on purpose:

- GPTQ zero points: vLLM subtracts the stored v1 value (zero - 1, e.g. 7 for symmetric
  int4) instead of the real one; we subtract the real zero point.
- Scales: vLLM rounds the scale to bfloat16 before multiplying (two roundings); for bf16
  scales that is the same, for fp16 scales it can differ by one bf16 ulp. We round once.
- Bias: vLLM drops it (returns None); we keep it.
- int8 and act-order: vLLM only unpacks int4 and ignores g_idx; the canonical form handles
  both, so we write them.
"""

from __future__ import annotations

import torch

from service.formats.canonical import QuantizedExperts, QuantizedMoELayer
from service.formats.writers import ConversionOptions, ConvertedLayer, dtype_name, finish

BACKEND = "EMULATION"


def dense(experts: QuantizedExperts, dtype: torch.dtype) -> torch.Tensor:
    """`experts.dequantize(dtype)`, bit for bit, without its gathers when groups are plain.

    Contiguous groups let scales and zero points broadcast over [E, N, G, group] views: the
    same float32 subtract, multiply and single rounding, several times faster.
    """
    if experts.g_idx is not None:
        return experts.dequantize(dtype).contiguous()
    e, n, k = experts.codes.shape
    groups = experts.num_groups
    codes = experts.codes.reshape(e, n, groups, k // groups).to(torch.float32)
    zeros = experts.zero_points().to(torch.float32).unsqueeze(-1)
    scales = experts.scales.to(torch.float32).unsqueeze(-1)
    return ((codes - zeros) * scales).to(dtype).reshape(e, n, k)


def write_emulation(
    layer: QuantizedMoELayer, *, source: str, options: ConversionOptions
) -> ConvertedLayer:
    dtype = options.dense_dtype
    return finish(
        {
            "w13_weight": dense(layer.w13, dtype),
            "w2_weight": dense(layer.w2, dtype),
            "w13_bias": layer.w13.bias,
            "w2_bias": layer.w2.bias,
        },
        backend=BACKEND,
        source=source,
        layer=layer,
        weight_type_name=dtype_name(dtype),
        options=options,
    )
