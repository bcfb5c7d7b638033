"""The readers and writers on a CUDA device give the CPU's bits.

The parity suite (`test_exactness.py`) holds the CPU path to vLLM 0.33.0 bit for bit; vLLM
cannot run on the GPU machine, so this closes the loop there: every layout, bit width, group
size, symmetry, act-order and bias, read and converted on the GPU, must equal the CPU result.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from service.formats.canonical import QuantizedExperts, QuantizedMoELayer
from service.formats.errors import ConversionUnsupported
from service.formats.readers import LAYOUTS, SourceQuantization, write_checkpoint, write_stacked
from service.formats.registry import convert, read_layer
from service.formats.synthetic.quantize import random_layer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

COMBOS = [
    c
    for c in itertools.product(
        sorted(LAYOUTS), (4, 8), (32, 128, -1), (True, False), (False, True), (False, True)
    )
    if not (c[4] and "g_idx" not in LAYOUTS[c[0]].names)
]


def _to(experts: QuantizedExperts, device: str) -> QuantizedExperts:
    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    return replace(
        experts,
        codes=experts.codes.to(device),
        scales=experts.scales.to(device),
        zeros=move(experts.zeros),
        g_idx=move(experts.g_idx),
        bias=move(experts.bias),
    )


@pytest.mark.parametrize("case", COMBOS, ids=["-".join(map(str, c)) for c in COMBOS])
def test_gpu_bits_equal_cpu_bits(case: tuple[str, int, int, bool, bool, bool]) -> None:
    layout, bits, group, sym, act, bias = case
    layer = random_layer(
        3,
        256,
        128,
        bits=bits,
        group_size=group,
        symmetric=sym,
        generator=torch.Generator().manual_seed(COMBOS.index(case)),
        act_order=act,
        bias=bias,
    )
    quant = SourceQuantization(bits, group, sym, desc_act=act)
    cuda = QuantizedMoELayer(w13=_to(layer.w13, "cuda"), w2=_to(layer.w2, "cuda"))
    spec = LAYOUTS[layout]
    for cpu_t, gpu_t in (
        (write_checkpoint(spec, layer, quant), write_checkpoint(spec, cuda, quant)),
        (write_stacked(spec, layer, quant), write_stacked(spec, cuda, quant)),
    ):
        assert cpu_t.keys() == gpu_t.keys()
        for name, tensor in cpu_t.items():
            assert gpu_t[name].is_cuda and torch.equal(gpu_t[name].cpu(), tensor), name
    checkpoint = write_checkpoint(spec, layer, quant)
    on_gpu = read_layer(layout, {k: v.cuda() for k, v in checkpoint.items()}, quant, num_experts=3)
    assert on_gpu.w13.codes.is_cuda
    for backend in ("TRITON", "EMULATION"):
        try:
            cpu_out = convert(layer, backend, source=layout)
        except ConversionUnsupported:
            with pytest.raises(ConversionUnsupported):
                convert(on_gpu, backend, source=layout)
            continue
        gpu_out = convert(on_gpu, backend, source=layout)
        assert cpu_out.descriptor == gpu_out.descriptor
        for name, tensor in cpu_out.tensors.items():
            got = gpu_out.tensors[name]
            assert got.is_cuda and torch.equal(got.cpu(), tensor), (backend, name)
