"""The layout-neutral form of quantized MoE expert weights.

Checkpoint formats differ in packing (along K or N, nibble order, int32 or uint8 words), in
how zero points are stored (GPTQ v1 stores zero-1; AWQ and compressed-tensors store the real
value) and in where act-order lives. The canonical form removes all of that: one unpacked
integer code per weight, real zero points, explicit group indices. Readers only unpack,
writers only pack, and dequantization is defined once, here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.formats.errors import FormatError

SUPPORTED_BITS = (4, 8)


@dataclass(frozen=True)
class QuantizedExperts:
    """One projection of every expert: w13 (gate rows then up rows) or w2.

    Shapes use N for output features and K for input features:
    - `codes`  uint8 [E, N, K], each in 0 .. 2**bits - 1 (unpacked, no sign).
    - `scales` float16/bfloat16/float32 [E, N, G], G = K // group_size (1 if channelwise).
    - `zeros`  uint8 [E, N, G] real zero points, or None for symmetric weights, whose zero
      point is 2**(bits-1) (8 for int4, 128 for int8).
    - `g_idx`  int32 [E, K] group of each input channel (act-order), or None when the group
      of channel k is k // group_size.
    - `bias`   [E, N] or None.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    bits: int
    group_size: int
    zeros: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        validate(self)

    @property
    def num_experts(self) -> int:
        return int(self.codes.shape[0])

    @property
    def n(self) -> int:
        return int(self.codes.shape[1])

    @property
    def k(self) -> int:
        return int(self.codes.shape[2])

    @property
    def num_groups(self) -> int:
        return int(self.scales.shape[2])

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @property
    def effective_group_size(self) -> int:
        return self.k if self.group_size == -1 else self.group_size

    def group_index(self) -> torch.Tensor:
        """int64 [E, K]: the group of every input channel."""
        if self.g_idx is not None:
            return self.g_idx.to(torch.int64)
        groups = torch.arange(self.k, device=self.codes.device) // self.effective_group_size
        return groups.unsqueeze(0).expand(self.num_experts, -1)

    def zero_points(self) -> torch.Tensor:
        """uint8 [E, N, G]: real zero points (the symmetric midpoint when none are stored)."""
        if self.zeros is not None:
            return self.zeros
        midpoint = 1 << (self.bits - 1)
        return torch.full_like(self.scales, midpoint, dtype=torch.uint8)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[E, N, K] weights: (code - zero[group]) * scale[group], computed in float32."""
        index = self.group_index().unsqueeze(1).expand(-1, self.n, -1)
        scale = torch.gather(self.scales.to(torch.float32), 2, index)
        zero = torch.gather(self.zero_points().to(torch.float32), 2, index)
        return ((self.codes.to(torch.float32) - zero) * scale).to(dtype)


def validate(experts: QuantizedExperts) -> None:
    """Check dtypes, shapes and value ranges; raises `FormatError` naming the field."""
    codes, scales = experts.codes, experts.scales
    if experts.bits not in SUPPORTED_BITS:
        raise FormatError("bits", f"must be one of {SUPPORTED_BITS}, got {experts.bits}")
    if codes.dtype != torch.uint8 or codes.dim() != 3:
        raise FormatError(
            "codes", f"must be uint8 [E, N, K], got {codes.dtype} {list(codes.shape)}"
        )
    e, n, k = codes.shape
    group = experts.group_size
    if group != -1 and (group <= 0 or k % group):
        raise FormatError("group_size", f"{group} does not divide K={k} (use -1 for channelwise)")
    groups = 1 if group == -1 else k // group
    if scales.dim() != 3 or tuple(scales.shape) != (e, n, groups):
        raise FormatError("scales", f"must be [{e}, {n}, {groups}], got {list(scales.shape)}")
    if not scales.dtype.is_floating_point:
        raise FormatError("scales", f"must be a float tensor, got {scales.dtype}")
    if experts.zeros is not None and (
        experts.zeros.dtype != torch.uint8 or tuple(experts.zeros.shape) != (e, n, groups)
    ):
        raise FormatError("zeros", f"must be uint8 [{e}, {n}, {groups}]")
    if experts.g_idx is not None and (
        experts.g_idx.dtype != torch.int32 or tuple(experts.g_idx.shape) != (e, k)
    ):
        raise FormatError("g_idx", f"must be int32 [{e}, {k}]")
    if experts.bias is not None and tuple(experts.bias.shape) != (e, n):
        raise FormatError("bias", f"must be [{e}, {n}]")
    limit = 1 << experts.bits
    if codes.numel() and int(codes.max()) >= limit:
        raise FormatError("codes", f"values must be below {limit} for {experts.bits}-bit weights")


@dataclass(frozen=True)
class QuantizedMoELayer:
    """Both projections of a MoE layer. `w13` stacks gate (w1) rows over up (w3) rows,
    vLLM's order; for a non-gated activation it holds only the up rows."""

    w13: QuantizedExperts
    w2: QuantizedExperts

    def __post_init__(self) -> None:
        if self.w13.num_experts != self.w2.num_experts:
            raise FormatError("w2", "expert count differs from w13")
        if self.w13.k != self.w2.n:
            raise FormatError("w2", f"N={self.w2.n} must equal w13's K (hidden)={self.w13.k}")
        if self.w13.bits != self.w2.bits:
            raise FormatError("w2", "bit width differs from w13")

    @property
    def hidden_size(self) -> int:
        return self.w13.k

    @property
    def intermediate_size(self) -> int:
        return self.w2.k
