"""The reference MARLIN reader (service/formats/inverse/marlin.py) as the exact inverse of
our MARLIN and BATCHED_MARLIN writers: canonical -> writer -> reader == canonical, bit for
bit, over bits, group sizes, zero points, bias, gated and not, padded intermediate sizes and
the sorted act-order form. The reader is built from vLLM's reference tables, the writer from
a digit permutation, so the round trip holds one against the other."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from service.formats.canonical import QuantizedMoELayer
from service.formats.errors import FormatError
from service.formats.inverse import marlin as reader
from service.formats.synthetic.quantize import random_layer
from service.formats.writers import ConversionOptions
from service.formats.writers.marlin import marlin_tensors, write_batched_marlin, write_marlin

E, H = 3, 256


def _layer(
    bits: int, group: int, sym: bool, *, inter: int, gated: bool = True, bias: bool = False,
    act: bool = False, seed: int = 0, scale_dtype: torch.dtype = torch.float16,
) -> QuantizedMoELayer:  # fmt: skip
    return random_layer(
        E, H, inter, bits=bits, group_size=group, symmetric=sym,
        generator=torch.Generator().manual_seed(seed), gated=gated, act_order=act, bias=bias,
        scale_dtype=scale_dtype,
    )  # fmt: skip


def _assert_same(a: QuantizedMoELayer, b: QuantizedMoELayer) -> None:
    for name in ("w13", "w2"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x.bits, x.group_size) == (y.bits, y.group_size), name
        for part in ("codes", "scales", "zeros", "g_idx", "bias"):
            p, q = getattr(x, part), getattr(y, part)
            assert (p is None) == (q is None), f"{name}.{part}"
            if p is not None:
                assert p.dtype == q.dtype, f"{name}.{part} dtype"
                assert p.shape == q.shape and torch.equal(p, q), f"{name}.{part}"


VARIANTS = [
    (bits, group, sym, inter, gated, bias)
    for bits, group, sym in itertools.product((4, 8), (-1, 32, 64, 128), (True, False))
    for inter, gated, bias in (
        (128, True, True),
        (256, True, False),
        # Marlin pads I to lcm(64, group): 96 -> 128 for channelwise and group 32 (a multiple
        # of 64 or 128 is never padded).
        (96 if group in (-1, 32) else 384, True, False),
        (192 if group != 128 else 128, False, True),  # non-gated (the _no_mul activations)
    )
]


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_writer_then_reader_is_the_identity(
    variant: tuple[int, int, bool, int, bool, bool],
) -> None:
    bits, group, sym, inter, gated, bias = variant
    layer = _layer(bits, group, sym, inter=inter, gated=gated, bias=bias, seed=bits + inter)
    converted = write_marlin(layer, source="gptq", options=ConversionOptions())
    _assert_same(reader.read_marlin(converted, intermediate_size=inter), layer)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_batched_marlin_and_scale_dtypes(scale_dtype: torch.dtype) -> None:
    layer = _layer(4, 64, False, inter=128, bias=True, scale_dtype=scale_dtype)
    converted = write_batched_marlin(layer, source="awq", options=ConversionOptions())
    assert converted.descriptor.backend == "BATCHED_MARLIN"
    _assert_same(reader.read_marlin(converted, intermediate_size=128), layer)


def test_sorted_act_order_form_is_unsorted() -> None:
    layer = _layer(4, 32, True, inter=128, act=True, bias=True)
    converted = write_marlin(
        layer, source="gptq", options=ConversionOptions(extra={"act_order": "sort"})
    )
    assert "w13_g_idx_sort_indices" in converted.tensors
    _assert_same(reader.read_marlin(converted, intermediate_size=128), layer)


def test_weight_reader_against_vllms_tables_by_hand() -> None:
    """One tile by hand: position p of the first 1024-value run holds tiled value perm[p];
    lane 0's first eight values come from rows 0, 1, 8, 9 of columns 0 and 8."""
    perm = reader.weight_perm(4)
    assert perm.numel() == 1024 and sorted(perm.tolist()) == list(range(1024))
    # Lane 0 before the interleave: [0, 16, 128, 144, 8, 24, 136, 152]; interleave 0,2,4,6,1,3,5,7.
    assert perm[:8].tolist() == [0, 128, 8, 136, 16, 144, 24, 152]
    grouped, single = reader.scale_perms()
    assert grouped[:9].tolist() == [0, 8, 16, 24, 32, 40, 48, 56, 1]
    assert single[:8].tolist() == [0, 1, 8, 9, 16, 17, 24, 25]


def test_reader_refuses_what_it_cannot_read_exactly() -> None:
    layer = _layer(4, 32, True, inter=128)
    int8 = {
        k: v for k, v in marlin_tensors(layer, activation_dtype=torch.int8).items() if v is not None
    }
    with pytest.raises(FormatError, match="int8 activations"):
        reader.read_marlin(int8, bits=4, group_size=32, intermediate_size=128)
    converted = write_marlin(layer, source="gptq", options=ConversionOptions())
    with pytest.raises(FormatError, match="Marlin's padding"):
        reader.read_marlin(converted, intermediate_size=64)
    tensors = dict(converted.tensors)
    del tensors["w2_qweight"]
    with pytest.raises(FormatError, match="w2_qweight"):
        reader.read_marlin(tensors, bits=4, group_size=32, intermediate_size=128)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", [(4, 128, False), (8, -1, True), (4, 32, True)], ids=str)
def test_reader_on_the_gpu(variant: tuple[int, int, bool]) -> None:
    """The reader is torch only: on a CUDA worker's tensors it gives the same layer."""
    bits, group, sym = variant
    layer = _layer(bits, group, sym, inter=96 if group == 32 else 128, bias=True)
    converted = write_marlin(layer, source="gptq", options=ConversionOptions(device="cuda"))
    back = reader.read_marlin(converted, intermediate_size=layer.intermediate_size)
    assert back.w13.codes.is_cuda
    on_cpu = QuantizedMoELayer(
        w13=dataclasses.replace(back.w13, **{p: _cpu(getattr(back.w13, p)) for p in _PARTS}),
        w2=dataclasses.replace(back.w2, **{p: _cpu(getattr(back.w2, p)) for p in _PARTS}),
    )
    _assert_same(on_cpu, layer)


_PARTS = ("codes", "scales", "zeros", "g_idx", "bias")


def _cpu(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.cpu()
