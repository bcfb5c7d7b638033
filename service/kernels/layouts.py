"""Reading kernel layouts back into the canonical form, for backends that dequantize.

The formats package writes canonical -> kernel layout; the EMULATION backend must also run
a layer that arrives already in a kernel layout (the TRITON one: it is what vLLM's Triton
WNA16 experts and ours read), so this module undoes that packing. It is the inverse of the
TRITON writer, and the tests hold the two against each other.

TRITON layout (vLLM's MoeWNA16 / `convert_to_wna16_moe_kernel_format` TRITON output), for
w13 (N = 2I or I, K = H) and w2 (N = H, K = I):

* `{w}_qweight` uint8 [E, N, K/p8], N-first: int4 code (n, k) is byte [n, k // 2] shifted
  right by 4·(k % 2), low nibble first; int8 code (n, k) is byte [n, k].
* `{w}_scales` [E, N, G], G = K / group_size (1 channelwise).
* `{w}_qzeros` (optional): int4 uint8 [E, N/2, G], zero point of row n in the byte
  [n // 2, g] shifted right by 4·(n % 2); int8 uint8 [E, N, G]. Absent: the symmetric
  midpoint 8 / 128.
* `{w}_bias` (optional) [E, N].
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from service.formats.canonical import QuantizedExperts, QuantizedMoELayer
from service.formats.errors import FormatError
from service.kernels.errors import KernelInputError

PROJECTIONS = ("w13", "w2")


def unpack_int4_along_last(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., X] holding two codes per byte (low nibble first) -> uint8 [..., 2X]."""
    low = packed & 0xF
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _unpack_int4_zeros(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [E, N/2, G] (row n in nibble n % 2 of byte n // 2) -> uint8 [E, N, G]."""
    e, half, groups = packed.shape
    low = packed & 0xF
    high = packed >> 4
    return torch.stack((low, high), dim=2).reshape(e, 2 * half, groups)


def triton_to_canonical(
    tensors: Mapping[str, torch.Tensor], *, bits: int, group_size: int
) -> QuantizedMoELayer:
    """The canonical layer held by TRITON-layout tensors (see the module docstring)."""
    projections = []
    for name in PROJECTIONS:
        qweight = _required(tensors, f"{name}_qweight")
        scales = _required(tensors, f"{name}_scales")
        if qweight.dtype != torch.uint8 or qweight.dim() != 3:
            raise KernelInputError(
                f"{name}_qweight",
                f"must be uint8 [E, N, K/{8 // bits}], got {qweight.dtype} {list(qweight.shape)}",
            )
        codes = unpack_int4_along_last(qweight) if bits == 4 else qweight
        zeros = tensors.get(f"{name}_qzeros")
        if zeros is not None and bits == 4:
            if zeros.dtype != torch.uint8 or zeros.dim() != 3:
                raise KernelInputError(f"{name}_qzeros", "must be uint8 [E, N/2, G]")
            zeros = _unpack_int4_zeros(zeros)
        try:
            projections.append(
                QuantizedExperts(
                    codes=codes.contiguous(),
                    scales=scales,
                    bits=bits,
                    group_size=group_size,
                    zeros=None if zeros is None else zeros.contiguous(),
                    bias=tensors.get(f"{name}_bias"),
                )
            )
        except FormatError as exc:
            raise KernelInputError(f"{name}_{exc.field}", str(exc)) from exc
    try:
        return QuantizedMoELayer(w13=projections[0], w2=projections[1])
    except FormatError as exc:
        raise KernelInputError(exc.field, str(exc)) from exc


def _required(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    tensor = tensors.get(name)
    if tensor is None:
        raise KernelInputError(name, f"missing (have {sorted(tensors)})")
    return tensor
