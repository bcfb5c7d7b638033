"""The quantizer behind every synthetic checkpoint: deterministic, in range, faithful."""

from __future__ import annotations

import pytest
import torch

from service.formats.synthetic.quantize import (
    act_order_g_idx,
    quantize,
    random_experts,
    random_layer,
)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 128, -1])
@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_is_faithful_and_in_range(bits: int, group_size: int, symmetric: bool) -> None:
    weights = torch.randn(2, 64, 256, generator=_gen()) * 0.02
    q = quantize(weights, bits=bits, group_size=group_size, symmetric=symmetric)
    maxq = (1 << bits) - 1
    assert int(q.codes.max()) <= maxq
    if symmetric:
        assert q.zeros is None
    else:
        assert q.zeros is not None
        assert int(q.zeros.min()) >= 1 and int(q.zeros.max()) <= maxq
    # Within half a quantization step (plus the fp16 rounding of the scale) everywhere.
    index = q.group_index().unsqueeze(1).expand(-1, q.n, -1)
    step = torch.gather(q.scales.float(), 2, index)
    error = (q.dequantize() - weights).abs()
    assert bool((error <= step * 0.5 + 1e-6 + weights.abs() * 2e-3).all())


def test_same_seed_same_layer_other_seed_other_layer() -> None:
    def make(seed: int) -> torch.Tensor:
        layer = random_layer(
            2, 128, 64, bits=4, group_size=32, symmetric=False, generator=_gen(seed)
        )
        return layer.w13.codes

    assert torch.equal(make(1), make(1))
    assert not torch.equal(make(1), make(2))


def test_act_order_groups_have_group_size_members() -> None:
    g_idx = act_order_g_idx(3, 256, 64, _gen())
    assert g_idx.dtype == torch.int32
    for row in g_idx:
        assert torch.equal(torch.bincount(row.long()), torch.full((4,), 64))
    q = random_experts(
        3, 32, 256, bits=4, group_size=64, symmetric=True, generator=_gen(), act_order=True
    )
    assert q.g_idx is not None


def test_act_order_with_one_group_is_dropped() -> None:
    q = random_experts(
        1, 32, 128, bits=4, group_size=-1, symmetric=True, generator=_gen(), act_order=True
    )
    assert q.g_idx is None


def test_bias_and_scale_dtype() -> None:
    layer = random_layer(
        2,
        128,
        64,
        bits=8,
        group_size=64,
        symmetric=True,
        generator=_gen(),
        bias=True,
        scale_dtype=torch.bfloat16,
    )
    assert layer.w13.bias is not None and layer.w13.bias.shape == (2, 128)
    assert layer.w2.bias is not None and layer.w2.bias.shape == (2, 128)
    assert layer.w13.scales.dtype == torch.bfloat16
