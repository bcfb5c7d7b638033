"""Test helpers: random quantized layers, the TRITON layout, and an fp64 loop reference.

`pack_triton` is the real TRITON writer (`service/formats/writers/triton.py`);
`pack_triton_by_hand` is an independent packer written from the fact sheet's layout
description (section 8.3/9), used before the writer landed and now held against it.
"""

from __future__ import annotations

import math

import torch

from service.formats.canonical import QuantizedExperts, QuantizedMoELayer
from service.kernels.interface import LayerSpec

#: Where the Triton kernels run in these tests: the GPU when there is one, else the CPU
#: under TRITON_INTERPRET=1 (conftest.py switches it on).
KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_experts(
    gen: torch.Generator,
    e: int,
    n: int,
    k: int,
    *,
    bits: int,
    group_size: int,
    zero_points: bool,
    bias: bool = False,
    act_order: bool = False,
    scale_dtype: torch.dtype = torch.float16,
    device: str | torch.device = "cpu",
) -> QuantizedExperts:
    """Random codes, scales and zero points (never all zero); weights of about 1/sqrt(K)."""
    levels = 1 << bits
    groups = 1 if group_size == -1 else k // group_size
    codes = torch.randint(0, levels, (e, n, k), generator=gen, dtype=torch.int32)
    scale = 2.0 / (levels * math.sqrt(k))
    scales = (torch.rand((e, n, groups), generator=gen) + 0.5) * scale
    zeros = None
    if zero_points:
        zeros = torch.randint(1, levels - 1, (e, n, groups), generator=gen).to(torch.uint8)
    g_idx = None
    if act_order:
        size = k if group_size == -1 else group_size
        g_idx = torch.stack(
            [(torch.randperm(k, generator=gen) // size).to(torch.int32) for _ in range(e)]
        )
    b = torch.randn((e, n), generator=gen) * 0.1 if bias else None
    return QuantizedExperts(
        codes=codes.to(torch.uint8).to(device),
        scales=scales.to(scale_dtype).to(device),
        bits=bits,
        group_size=group_size,
        zeros=None if zeros is None else zeros.to(device),
        g_idx=None if g_idx is None else g_idx.to(device),
        bias=None if b is None else b.to(scale_dtype).to(device),
    )


def random_layer(
    seed: int,
    e: int,
    h: int,
    i: int,
    *,
    bits: int = 4,
    group_size: int = 32,
    zero_points: bool = False,
    bias: bool = False,
    gated: bool = True,
    act_order: bool = False,
    scale_dtype: torch.dtype = torch.float16,
    device: str | torch.device = "cpu",
) -> QuantizedMoELayer:
    gen = torch.Generator().manual_seed(seed)
    common = dict(
        bits=bits,
        group_size=group_size,
        zero_points=zero_points,
        bias=bias,
        act_order=act_order,
        scale_dtype=scale_dtype,
        device=device,
    )
    w13 = random_experts(gen, e, 2 * i if gated else i, h, **common)  # type: ignore[arg-type]
    w2 = random_experts(gen, e, h, i, **common)  # type: ignore[arg-type]
    return QuantizedMoELayer(w13=w13, w2=w2)


def pack_triton(layer: QuantizedMoELayer) -> dict[str, torch.Tensor]:
    """The TRITON-layout tensors, from the formats package's TRITON writer."""
    from service.formats.writers import DEFAULT_OPTIONS
    from service.formats.writers.triton import write_triton

    return write_triton(layer, source="moe_wna16", options=DEFAULT_OPTIONS).tensors


def pack_triton_by_hand(layer: QuantizedMoELayer) -> dict[str, torch.Tensor]:
    """The TRITON layout (vLLM MoeWNA16): N-first uint8, int4 low nibble = even k."""
    out: dict[str, torch.Tensor] = {}
    for name, q in (("w13", layer.w13), ("w2", layer.w2)):
        codes = q.codes
        if q.bits == 4:
            codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
        out[f"{name}_qweight"] = codes.contiguous()
        out[f"{name}_scales"] = q.scales.contiguous()
        if q.zeros is not None:
            zeros = q.zeros
            if q.bits == 4:
                zeros = zeros[:, 0::2, :] | (zeros[:, 1::2, :] << 4)
            out[f"{name}_qzeros"] = zeros.contiguous()
        if q.bias is not None:
            out[f"{name}_bias"] = q.bias.contiguous()
    return out


def triton_spec(layer: QuantizedMoELayer) -> LayerSpec:
    return LayerSpec.from_canonical(layer, layout="TRITON")


def random_routing(
    gen: torch.Generator, m: int, e: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token, positive weights that do not sum to one."""
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(m)]).to(torch.int32)
    weights = torch.rand((m, k), generator=gen) + 0.1
    return ids, weights


# --- an fp64 loop reference, independent of service.kernels ------------------------------------


def _dequant64(q: QuantizedExperts, e: int) -> torch.Tensor:
    k = q.codes.shape[2]
    if q.g_idx is not None:
        groups = q.g_idx[e].long()
    else:
        size = k if q.group_size == -1 else q.group_size
        groups = torch.arange(k) // size
    codes = q.codes[e].double()
    scales = q.scales[e].double()[:, groups]
    mid = 1 << (q.bits - 1)
    zeros = q.zeros[e].double()[:, groups] if q.zeros is not None else torch.full_like(codes, mid)
    return (codes - zeros) * scales


def _sig(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _clip(x: torch.Tensor, limit: float) -> torch.Tensor:
    return torch.minimum(
        torch.maximum(x, torch.tensor(-limit, dtype=x.dtype)), torch.tensor(limit, dtype=x.dtype)
    )


def act64(
    name: str, h: torch.Tensor, limit: float | None = None, alpha: float = 1.0, beta: float = 0.0
) -> torch.Tensor:
    """vLLM's activation formulas written out again, in float64, on one row."""
    if name.endswith("_no_mul"):
        base = name.removesuffix("_no_mul")
        return {
            "silu": lambda x: x * _sig(x),
            "gelu": _gelu,
            "gelu_tanh": _gelu_tanh,
            "relu2": lambda x: torch.clamp(x, min=0) ** 2,
        }[base](h)
    if name == "swigluoai":
        g, u = h[0::2], h[1::2]
        g = torch.clamp(g, max=7.0)
        u = _clip(u, 7.0)
        return g * _sig(1.702 * g) * (u + 1.0)
    d = h.shape[-1] // 2
    g, u = h[:d], h[d:]
    if name == "silu" and limit is None:
        return g * _sig(g) * u
    if name in ("silu", "swigluoai_uninterleave"):
        assert limit is not None
        g = torch.clamp(g, max=limit)
        u = _clip(u, limit)
        return g * _sig(alpha * g) * (u + beta)
    if name == "gelu":
        return _gelu(g) * u
    if name == "gelu_tanh":
        return _gelu_tanh(g) * u
    if name == "swiglustep":
        return torch.clamp(g * _sig(g), max=7.0) * _clip(u, 7.0)
    raise AssertionError(name)


def loop_reference(
    layer: QuantizedMoELayer,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    activation: str,
    **act_kwargs: float,
) -> torch.Tensor:
    """float64 [M, H]: token by token, expert by expert, no batching at all."""
    m, k = ids.shape
    out = torch.zeros(m, layer.hidden_size, dtype=torch.float64)
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for t in range(m):
        for j in range(k):
            e = int(ids[t, j])
            if e not in cache:
                cache[e] = (_dequant64(layer.w13, e), _dequant64(layer.w2, e))
            w13, w2 = cache[e]
            h = w13 @ x[t].double()
            if layer.w13.bias is not None:
                h = h + layer.w13.bias[e].double()
            y = w2 @ act64(activation, h, **act_kwargs)
            if layer.w2.bias is not None:
                y = y + layer.w2.bias[e].double()
            out[t] += float(weights[t, j]) * y
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double().cpu(), ref.double().cpu()
    return float(torch.linalg.norm(out64 - ref64) / torch.linalg.norm(ref64))
