"""XPU: what vLLM's XPU WNA16 MoE experts (`xpu_fused_moe(is_int4=True)`) are handed.

The kernel reads symmetric int4 weights N-first and byte-packed along K, as TRITON's:
``*_qweight`` uint8 [E, N, K/2] (element (n, k) is ``[n, k//2] >> 4*(k%2) & 0xF``) and
``*_scales`` [E, N, G] in the source's scale dtype, plus ``*_bias`` [E, N] passed through.
vLLM's `_process_weights_xpu` does no repacking: it views the words the integration hands
over as bytes, so what it writes depends on the source layout and the release
(`ConversionRules.xpu_transposes`, read from `options.ruleset`) and on the integration
that loads the checkpoint (`options.integration`: ``moe_wna16`` hands MoeWNA16's tensors
whatever the checkpoint's layout):

- GPTQ and compressed-tensors: the kernel's layout in every release (0.30 and older
  transpose the K-first words they are handed; 0.31 and later are handed them N-first);
- MoeWNA16: its stored N-first bytes, the kernel's layout, from 0.31; 0.30 transposes
  them, which writes ``*_qweight`` [E, K/2, N] and ``*_scales`` [E, G, N];
- AutoAWQ: its K-first int32 words (eight N channels each, in AWQ's interleaved order)
  viewed as bytes, [E, K, N/2] with scales [E, G, N]; 0.30 transposes the words first,
  which writes [E, N/8, 4K] bytes and scales [E, N, G]. Neither is the kernel's layout.

We write the release's bytes, as it would load them, also where they are not the kernel's
layout (the selection hazards `XPU_AWQ_LAYOUT` and `XPU_MOE_WNA16_TRANSPOSED` say so).
vLLM writes no zero points and its XPU experts take int4 symmetric weights only, so
asymmetric and 8-bit layers are refused, and so is act-order (the group of input channel k
is k // group_size).
"""

from __future__ import annotations

import torch

from service.formats import bits as packing
from service.formats.canonical import QuantizedExperts, QuantizedMoELayer
from service.formats.errors import ConversionUnsupported
from service.formats.writers import ConversionOptions, ConvertedLayer, finish, weight_type
from service.oracle.rulesets import get_ruleset

BACKEND = "XPU"
#: The integration (and stacked layout) whose N-first bytes XPU is handed as they are.
MOE_WNA16 = "moe_wna16"


def _awq_words(experts: QuantizedExperts) -> torch.Tensor:
    """AutoAWQ's qweight: int32 [E, K, N/8], each word eight N channels in AWQ's order."""
    k_first = experts.codes.transpose(1, 2)
    return packing.pack(k_first, 4, 2, torch.int32, order=packing.AWQ_ORDER_4BIT)


def _handed_over(experts: QuantizedExperts, source: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight bytes, scales) as the integration hands them to `_process_weights_xpu` in
    the releases that do not transpose them."""
    if source == "awq":
        return _awq_words(experts).view(torch.uint8), experts.scales.transpose(1, 2)
    return packing.pack(experts.codes, 4, 2, torch.uint8), experts.scales


def _projection(
    experts: QuantizedExperts, name: str, source: str, transposes: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if experts.bits != 4 or not experts.symmetric:
        raise ConversionUnsupported(
            BACKEND, f"{name}: the XPU WNA16 experts take symmetric int4 weights only"
        )
    if experts.g_idx is not None:
        raise ConversionUnsupported(
            BACKEND,
            f"{name} has act-order (g_idx): the XPU WNA16 kernel takes the group of input "
            "channel k as k // group_size",
        )
    if experts.n % 8:
        raise ConversionUnsupported(BACKEND, f"{name}: N={experts.n} is not a multiple of 8")
    weight, scales = _handed_over(experts, source)
    if transposes and source in ("awq", MOE_WNA16):
        # 0.30 and older transpose whatever they are handed: the int32 words (AWQ), the
        # bytes (MoeWNA16). GPTQ's and compressed-tensors' come out as 0.31+ writes them.
        if source == "awq":
            weight = weight.view(torch.int32).transpose(1, 2).contiguous().view(torch.uint8)
        else:
            weight = weight.transpose(1, 2)
        scales = scales.transpose(1, 2)
    return weight.contiguous(), scales.contiguous()


def write_xpu(
    layer: QuantizedMoELayer, *, source: str, options: ConversionOptions
) -> ConvertedLayer:
    transposes = get_ruleset(options.ruleset).conversions.xpu_transposes
    handed = MOE_WNA16 if options.integration == MOE_WNA16 else source
    w13, s13 = _projection(layer.w13, "w13", handed, transposes)
    w2, s2 = _projection(layer.w2, "w2", handed, transposes)
    return finish(
        {
            "w13_qweight": w13,
            "w2_qweight": w2,
            "w13_scales": s13,
            "w2_scales": s2,
            "w13_bias": layer.w13.bias,
            "w2_bias": layer.w2.bias,
        },
        backend=BACKEND,
        source=source,
        layer=layer,
        weight_type_name=weight_type(layer.w13),
        options=options,
    )
