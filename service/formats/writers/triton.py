"""TRITON: the layout vLLM's Triton WNA16 MoE kernel (`fused_moe_kernel_gptq_awq`) reads.

Per projection, N-first and byte-packed along K:

- ``*_qweight`` uint8 [E, N, K*bits/8]: int4 element (n, k) is ``[n, k//2] >> 4*(k%2) & 0xF``;
  int8 is ``[n, k]``;
- ``*_scales`` [E, N, G] in the source's scale dtype, group of k = k // group_size;
- ``*_qzeros`` (asymmetric only) uint8, int4 [E, N/2, G] with zp(n) in bits 4*(n%2) of
  ``[n//2, g]``, int8 [E, N, G]; symmetric weights have none (the kernel subtracts 8 / 128);
- ``*_bias`` [E, N] passed through (vLLM's Triton experts ignore it).

This is exactly vLLM's MoeWNA16 parameter layout, which is why vLLM's TRITON conversion of
MoeWNA16 is a no-op, and equal to its `w.transpose(1, 2).view(uint8)` of K-first GPTQ words.
The kernel computes the group as k // group_size, so act-order (g_idx) weights cannot be
written here.
"""

from __future__ import annotations

import torch

from service.formats import bits as packing
from service.formats.canonical import QuantizedExperts, QuantizedMoELayer
from service.formats.errors import ConversionUnsupported
from service.formats.writers import ConversionOptions, ConvertedLayer, finish, weight_type

BACKEND = "TRITON"


def _projection(experts: QuantizedExperts) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = packing.pack(experts.codes, experts.bits, 2, torch.uint8)
    zeros = None
    if experts.zeros is not None:
        zeros = packing.pack(experts.zeros, experts.bits, 1, torch.uint8)
    return weight, zeros


def write_triton(
    layer: QuantizedMoELayer, *, source: str, options: ConversionOptions
) -> ConvertedLayer:
    for name, experts in (("w13", layer.w13), ("w2", layer.w2)):
        if experts.g_idx is not None:
            raise ConversionUnsupported(
                BACKEND,
                f"{name} has act-order (g_idx): the Triton WNA16 kernel takes the group of "
                "input channel k as k // group_size",
            )
        if experts.bits == 4 and experts.n % 2:
            raise ConversionUnsupported(BACKEND, f"{name}: int4 zero points need an even N")
    w13, z13 = _projection(layer.w13)
    w2, z2 = _projection(layer.w2)
    return finish(
        {
            "w13_qweight": w13,
            "w2_qweight": w2,
            "w13_scales": layer.w13.scales.contiguous(),
            "w2_scales": layer.w2.scales.contiguous(),
            "w13_qzeros": z13,
            "w2_qzeros": z2,
            "w13_bias": layer.w13.bias,
            "w2_bias": layer.w2.bias,
        },
        backend=BACKEND,
        source=source,
        layer=layer,
        weight_type_name=weight_type(layer.w13),
        options=options,
    )
