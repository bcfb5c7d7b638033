"""Checkpoint readers: GPTQ, AWQ, compressed-tensors pack-quantized and vLLM's MoeWNA16.

Each reader unpacks into the canonical form (`service.formats.canonical`) and nothing else;
each has its inverse (`pack_*`, `write_checkpoint`, `write_stacked`) so tests and benches can
build synthetic checkpoints from our own quantizer (`service.formats.synthetic.quantize`).

Conventions, checked against vLLM 0.33.0's own unpackers (`quant_utils.pack_rows/pack_cols/
awq_pack`, the int4 emulation unpackers in `fused_moe/oracle/int_wna16.py`, MoeWNA16's loader,
compressed-tensors' `pack_to_int32`) by the exactness tests:

===================  =====================  ========================  ===============
layout               weight (per expert)    zero points               scales
===================  =====================  ========================  ===============
gptq                 int32 [K/pf, N], K     int32 [G, N/pf], N,       [G, N]
                     packed LSB-first       stored zero-1 (v1)
awq                  int32 [K, N/pf], N     int32 [G, N/pf], same     [G, N]
                     packed, nibble order   order, real zero
                     [0,2,4,6,1,3,5,7]
compressed-tensors   int32 [N, K/pf]        int32 [N/pf, G], real     [N, G]
moe_wna16            uint8 [N, K/p8]        uint8 [N/p8, G], real     [N, G]
===================  =====================  ========================  ===============

pf = 32 / bits, p8 = 8 / bits; the lowest code sits in the lowest bits.
"""

from __future__ import annotations

import dataclasses

import torch

from service.formats.canonical import QuantizedExperts
from service.formats.readers.checkpoint import (
    NAMINGS,
    pack_projection,
    read_checkpoint,
    read_stacked,
    write_checkpoint,
    write_stacked,
)
from service.formats.readers.layouts import (
    AWQ,
    COMPRESSED_TENSORS,
    GPTQ,
    LAYOUTS,
    MOE_WNA16,
    SourceLayout,
    SourceQuantization,
)

__all__ = [
    "AWQ",
    "COMPRESSED_TENSORS",
    "GPTQ",
    "LAYOUTS",
    "MOE_WNA16",
    "NAMINGS",
    "SourceLayout",
    "SourceQuantization",
    "pack_awq",
    "pack_compressed_tensors",
    "pack_gptq",
    "pack_moe_wna16",
    "read_checkpoint",
    "read_stacked",
    "write_checkpoint",
    "write_stacked",
]


def _quant_of(experts: QuantizedExperts, *, desc_act: bool = False) -> SourceQuantization:
    return SourceQuantization(
        bits=experts.bits,
        group_size=experts.group_size,
        symmetric=experts.symmetric,
        desc_act=desc_act or experts.g_idx is not None,
    )


def pack_gptq(experts: QuantizedExperts, *, v2: bool = False) -> dict[str, torch.Tensor]:
    """One expert's projection -> GPTQ ``qweight``, ``qzeros``, ``scales``, ``g_idx`` (, ``bias``).

    Zero points are stored minus one (GPTQ v1) unless `v2`; symmetric weights get the
    midpoint, as AutoGPTQ writes them, and g_idx is always written.
    """
    quant = dataclasses.replace(_quant_of(experts), gptq_v2=v2)
    return pack_projection(GPTQ, experts, quant)


def pack_awq(experts: QuantizedExperts) -> dict[str, torch.Tensor]:
    """One expert's projection -> AWQ ``qweight``, ``qzeros`` (asymmetric only), ``scales``."""
    return pack_projection(AWQ, experts, _quant_of(experts))


def pack_compressed_tensors(experts: QuantizedExperts) -> dict[str, torch.Tensor]:
    """One expert's projection -> ``weight_packed``, ``weight_scale``, ``weight_zero_point``
    (asymmetric only), ``weight_g_idx`` (act-order only), ``weight_shape``."""
    return pack_projection(COMPRESSED_TENSORS, experts, _quant_of(experts))


def pack_moe_wna16(experts: QuantizedExperts) -> dict[str, torch.Tensor]:
    """One expert's projection -> vLLM MoeWNA16 ``qweight`` (uint8, N-first), ``scales``,
    ``qzeros`` (asymmetric only)."""
    return pack_projection(MOE_WNA16, experts, _quant_of(experts))
