"""EMULATION against an fp64 token-by-token loop, and the interface's bad-input errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from service.kernels.activation import ACTIVATIONS, ActivationSpec
from service.kernels.emulation import EmulationExperts
from service.kernels.errors import KernelInputError
from service.kernels.interface import LayerSpec
from tests.kernels.helpers import (
    loop_reference,
    pack_triton,
    random_layer,
    random_routing,
    rel_err,
    triton_spec,
)

#: float32 accumulation against float64 on these tiny shapes (K <= 96).
TOL = 1e-5

VARIANTS = [
    # bits, group, zero points, act-order, bias
    (4, 32, False, False, False),
    (4, 16, True, False, True),
    (4, -1, True, False, False),
    (8, 32, True, False, False),
    (8, -1, False, False, True),
    (4, 32, False, True, False),
    (8, 16, True, True, True),
]


def _emulation(layer) -> EmulationExperts:  # type: ignore[no-untyped-def]
    backend = EmulationExperts()
    backend.prepare(layer, LayerSpec.from_canonical(layer))
    return backend


@pytest.mark.parametrize(("bits", "group", "zp", "act_order", "bias"), VARIANTS)
def test_variants_match_fp64_loop(
    bits: int, group: int, zp: bool, act_order: bool, bias: bool
) -> None:
    layer = random_layer(
        bits * 100 + group, 6, 64, 96, bits=bits, group_size=group, zero_points=zp,
        act_order=act_order, bias=bias,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(9, 64, generator=gen).to(torch.bfloat16)
    ids, weights = random_routing(gen, 9, 6, 3)
    got = _emulation(layer).forward_fp32(x, ids, weights, "silu")
    assert got.dtype == torch.float32
    assert rel_err(got, loop_reference(layer, x, ids, weights, "silu")) < TOL


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activations_match_fp64_loop(name: str) -> None:
    gated = ACTIVATIONS[name].gated
    layer = random_layer(11, 4, 32, 48, bits=4, group_size=16, zero_points=True, gated=gated)
    params = {"limit": 1.5, "alpha": 1.3, "beta": 0.5} if name == "swigluoai_uninterleave" else {}
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 32, generator=gen) * 3).to(torch.float16)
    ids, weights = random_routing(gen, 6, 4, 2)
    got = _emulation(layer).forward_fp32(x, ids, weights, ActivationSpec(name, **params))
    want = loop_reference(layer, x, ids, weights, name, **params)
    assert rel_err(got, want) < TOL


def test_triton_layout_reads_back_the_same_layer() -> None:
    for bits, zp in ((4, True), (8, True), (4, False)):
        layer = random_layer(3, 3, 32, 64, bits=bits, group_size=32, zero_points=zp, bias=True)
        packed = EmulationExperts()
        packed.prepare(pack_triton(layer), triton_spec(layer))
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(4, 32, generator=gen).to(torch.bfloat16)
        ids, weights = random_routing(gen, 4, 3, 2)
        a = packed.forward_fp32(x, ids, weights)
        b = _emulation(layer).forward_fp32(x, ids, weights)
        assert torch.equal(a, b)


def test_forward_casts_and_fills_out() -> None:
    layer = random_layer(1, 4, 32, 32)
    backend = _emulation(layer)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 32, generator=gen).to(torch.float16)
    ids, weights = random_routing(gen, 3, 4, 2)
    out = torch.full_like(x, float("nan"))
    got = backend.forward(x, ids, weights, out=out)
    assert got is out and got.dtype == torch.float16 and not got.isnan().any()
    assert torch.equal(got, backend.forward_fp32(x, ids, weights).to(torch.float16))
    assert backend.forward(x[:0], ids[:0], weights[:0]).shape == (0, 32)


# --- bad input ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def backend() -> EmulationExperts:
    return _emulation(random_layer(2, 4, 32, 32))


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 32, generator=gen).to(torch.bfloat16)
    ids, weights = random_routing(gen, 3, 4, 2)
    return x, ids, weights


def _poke(name: str) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], str, dict]:  # type: ignore[type-arg]
    x, ids, w = _inputs()
    nan_x = x.clone()
    nan_x[1, 3] = float("nan")
    inf_w = w.clone()
    inf_w[0, 0] = float("inf")
    bad_ids = ids.clone()
    bad_ids[2, 1] = 4
    return {
        "hidden_mismatch": ((torch.randn(3, 48).bfloat16(), ids, w), "hidden_states", {}),
        "hidden_fp32": ((x.float(), ids, w), "hidden_states", {}),
        "hidden_3d": ((x[None], ids, w), "hidden_states", {}),
        "ids_float": ((x, ids.float(), w), "topk_ids", {}),
        "ids_rows": ((x, ids[:2], w), "topk_ids", {}),
        "weights_bf16": ((x, ids, w.bfloat16()), "topk_weights", {}),
        "weights_shape": ((x, ids, w[:, :1]), "topk_weights", {}),
        "nan_hidden": ((nan_x, ids, w), "hidden_states", {"validate": True}),
        "inf_weights": ((x, ids, inf_w), "topk_weights", {"validate": True}),
        "id_range": ((x, bad_ids, w), "topk_ids", {"validate": True}),
        "non_gated_act": ((x, ids, w), "activation", {"activation": "silu_no_mul"}),
        "unknown_act": ((x, ids, w), "activation", {"activation": "situ"}),
        "out_dtype": ((x, ids, w), "out", {"out": torch.empty(3, 32)}),
    }[name]


@pytest.mark.parametrize(
    "case",
    [
        "hidden_mismatch", "hidden_fp32", "hidden_3d", "ids_float", "ids_rows", "weights_bf16",
        "weights_shape", "nan_hidden", "inf_weights", "id_range", "non_gated_act", "unknown_act",
        "out_dtype",
    ],
)  # fmt: skip
def test_bad_input_is_a_domain_error(backend: EmulationExperts, case: str) -> None:
    args, field, kwargs = _poke(case)
    with pytest.raises(KernelInputError) as info:
        backend.forward(*args, **kwargs)
    assert info.value.field == field
    # The backend is unharmed: a good call still works.
    x, ids, w = _inputs()
    assert backend.forward(x, ids, w).isfinite().all()


def test_nan_without_validation_is_not_checked(backend: EmulationExperts) -> None:
    x, ids, w = _inputs()
    x[0, 0] = float("nan")
    assert backend.forward(x, ids, w).isnan().any()


def test_descriptor_must_match_tensors() -> None:
    layer = random_layer(4, 4, 32, 32)
    spec = LayerSpec.from_canonical(layer)
    with pytest.raises(KernelInputError) as info:
        EmulationExperts().prepare(layer, LayerSpec(**{**_fields(spec), "hidden_size": 64}))
    assert info.value.field == "hidden_size"
    with pytest.raises(KernelInputError):
        EmulationExperts().prepare(layer, LayerSpec(**{**_fields(spec), "layout": "HUMMING"}))
    with pytest.raises(KernelInputError, match="no layer"):
        EmulationExperts().forward(*_inputs())


def _fields(spec: LayerSpec) -> dict[str, object]:
    return {name: getattr(spec, name) for name in LayerSpec.__dataclass_fields__}


@pytest.mark.parametrize(("layout", "inter"), [("MARLIN", 96), ("BATCHED_MARLIN", 128)])
def test_reads_the_marlin_layout_exactly(layout: str, inter: int) -> None:
    """EMULATION on a MARLIN layer (via the reference reader) computes exactly what it
    computes on the canonical layer the MARLIN tensors were written from."""
    from service.formats.writers import ConversionOptions
    from service.formats.writers.marlin import write_marlin

    gen = torch.Generator().manual_seed(21)
    layer = random_layer(
        4, 6, 128, inter, bits=4, group_size=32, zero_points=True, bias=True,
        scale_dtype=torch.bfloat16,
    )  # fmt: skip
    converted = write_marlin(layer, source="gptq", options=ConversionOptions())
    on_marlin = EmulationExperts()
    on_marlin.prepare(converted.tensors, LayerSpec.from_canonical(layer, layout=layout))
    on_canonical = EmulationExperts()
    on_canonical.prepare(layer, LayerSpec.from_canonical(layer))
    x = torch.randn((5, 128), generator=gen).to(torch.bfloat16)
    ids, weights = random_routing(gen, 5, 6, 2)
    assert torch.equal(
        on_marlin.forward_fp32(x, ids, weights), on_canonical.forward_fp32(x, ids, weights)
    )
    wrong = dataclasses.replace(
        LayerSpec.from_canonical(layer, layout=layout), intermediate_size=64
    )  # the tensors hold Marlin's padding of 96 or 128, not of 64
    with pytest.raises(KernelInputError, match="MARLIN tensors"):
        EmulationExperts().prepare(converted.tensors, wrong)
