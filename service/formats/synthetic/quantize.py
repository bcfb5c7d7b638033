"""Our own min-max quantizer: random or given float weights -> canonical quantized experts.

Tests and benchmarks build synthetic checkpoints from it (then `readers.write_checkpoint`
packs them into GPTQ, AWQ...), so no model is ever downloaded. It is deterministic for a
given `torch.Generator` and makes only choices every layout can store:

* symmetric: scale = max|w| / (2**(bits-1) - 1), code = round(w / scale) + midpoint, so the
  codes use 1 .. 2**bits - 1 around the midpoint 8 (int4) / 128 (int8);
* asymmetric: scale = (max - min) / (2**bits - 1), zero = round(-min / scale) clamped to
  1 .. 2**bits - 1 (never 0: GPTQ v1 stores zero-1 and cannot hold it);
* act-order: a random permutation of the input channels, `g_idx[perm[i]] = i // group_size`,
  as GPTQ's desc_act produces; scales are computed over each group's actual members.

Scales are rounded to `scale_dtype` before the codes are computed, so dequantizing the
result reproduces the weights to within half a step.
"""

from __future__ import annotations

import torch

from service.formats.canonical import QuantizedExperts, QuantizedMoELayer

_TINY = 1e-8


def quantize(
    weights: torch.Tensor,
    *,
    bits: int,
    group_size: int,
    symmetric: bool,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    scale_dtype: torch.dtype = torch.float16,
) -> QuantizedExperts:
    """Float [E, N, K] weights -> QuantizedExperts; `g_idx` int32 [E, K] for act-order."""
    e, n, k = weights.shape
    size = k if group_size == -1 else group_size
    groups = k // size
    w = weights.to(torch.float32)
    index = (
        (torch.arange(k, device=w.device) // size).expand(e, k)
        if g_idx is None
        else g_idx.to(device=w.device, dtype=torch.int64)
    )
    gather = index.unsqueeze(1).expand(e, n, k)
    shape = (e, n, groups)

    def reduce(values: torch.Tensor, how: str) -> torch.Tensor:
        fill = float("-inf") if how == "amax" else float("inf")
        initial = torch.full(shape, fill, device=w.device)
        return initial.scatter_reduce(2, gather, values, how, include_self=True)

    maxq = (1 << bits) - 1
    midpoint = 1 << (bits - 1)
    if symmetric:
        scales = (reduce(w.abs(), "amax") / (midpoint - 1)).clamp_min(_TINY).to(scale_dtype)
        zeros = None
        zero_full = torch.full_like(w, float(midpoint))
    else:
        low = reduce(w, "amin").clamp_max(0.0)
        high = reduce(w, "amax").clamp_min(0.0)
        scales = ((high - low) / maxq).clamp_min(_TINY).to(scale_dtype)
        zero_f = torch.round(-low / scales.to(torch.float32)).clamp(1, maxq)
        zeros = zero_f.to(torch.uint8)
        zero_full = torch.gather(zero_f, 2, gather)
    scale_full = torch.gather(scales.to(torch.float32), 2, gather)
    if g_idx is not None and bool((index == torch.arange(k, device=w.device) // size).all()):
        g_idx = None  # the plain order (e.g. one group): readers would drop it too
    codes = torch.round(w / scale_full + zero_full).clamp(0, maxq).to(torch.uint8)
    return QuantizedExperts(
        codes=codes,
        scales=scales,
        bits=bits,
        group_size=group_size,
        zeros=zeros,
        g_idx=None if g_idx is None else index.to(torch.int32).contiguous(),
        bias=bias,
    )


def act_order_g_idx(
    num_experts: int, k: int, group_size: int, generator: torch.Generator
) -> torch.Tensor:
    """int32 [E, K]: GPTQ desc_act group indices for a random channel order per expert."""
    size = k if group_size == -1 else group_size
    rows = []
    for _ in range(num_experts):
        perm = torch.randperm(k, generator=generator)
        g = torch.empty(k, dtype=torch.int64)
        g[perm] = torch.arange(k) // size
        rows.append(g)
    return torch.stack(rows).to(torch.int32)


def random_experts(
    num_experts: int,
    n: int,
    k: int,
    *,
    bits: int,
    group_size: int,
    symmetric: bool,
    generator: torch.Generator,
    act_order: bool = False,
    bias: bool = False,
    scale_dtype: torch.dtype = torch.float16,
) -> QuantizedExperts:
    """Quantize random normal weights (std 0.02, like an initialised projection)."""
    weights = torch.randn(num_experts, n, k, generator=generator) * 0.02
    g_idx = act_order_g_idx(num_experts, k, group_size, generator) if act_order else None
    bias_t = None
    if bias:
        bias_t = (torch.randn(num_experts, n, generator=generator) * 0.1).to(scale_dtype)
    return quantize(
        weights,
        bits=bits,
        group_size=group_size,
        symmetric=symmetric,
        g_idx=g_idx,
        bias=bias_t,
        scale_dtype=scale_dtype,
    )


def random_layer(
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    *,
    bits: int,
    group_size: int,
    symmetric: bool,
    generator: torch.Generator,
    gated: bool = True,
    act_order: bool = False,
    bias: bool = False,
    scale_dtype: torch.dtype = torch.float16,
) -> QuantizedMoELayer:
    """A random MoE layer: w13 [E, (2 if gated else 1) * I, H] and w2 [E, H, I].

    With act-order, gate and up share one permutation (they see the same input, so GPTQ
    gives them the same order), as vLLM's single w13 g_idx requires.
    """
    n13 = (2 if gated else 1) * intermediate_size
    weights13 = torch.randn(num_experts, n13, hidden_size, generator=generator) * 0.02
    weights2 = torch.randn(num_experts, hidden_size, intermediate_size, generator=generator) * 0.02
    g13 = g2 = None
    if act_order:
        g13 = act_order_g_idx(num_experts, hidden_size, group_size, generator)
        g2 = act_order_g_idx(num_experts, intermediate_size, group_size, generator)
    b13 = b2 = None
    if bias:
        b13 = (torch.randn(num_experts, n13, generator=generator) * 0.1).to(scale_dtype)
        b2 = (torch.randn(num_experts, hidden_size, generator=generator) * 0.1).to(scale_dtype)
    w13, w2 = (
        quantize(
            w,
            bits=bits,
            group_size=group_size,
            symmetric=symmetric,
            g_idx=g,
            bias=b,
            scale_dtype=scale_dtype,
        )
        for w, g, b in ((weights13, g13, b13), (weights2, g2, b2))
    )
    return QuantizedMoELayer(w13=w13, w2=w2)
