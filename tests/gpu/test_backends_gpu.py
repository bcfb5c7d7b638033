"""GPU backends at small shapes: each against the float32 reference, poisoned buffers.

Marked `gpu` and skipped without CUDA (`make test` runs `-m "not gpu"`); the H200 run
(`scripts/gpu_test.sh`) runs them before the full-size table in `bench/gpu_suite.py`, which
holds the data generation, the reference and the poisoning these tests share.

Humming compiles each kernel on first use (seconds each), so the HUMMING cases stay few and
reuse one shape.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench import gpu_suite as suite
from service.formats.writers import ConversionOptions
from service.kernels.errors import KernelInputError, KernelUnavailableError
from service.kernels.interface import LayerSpec
from service.kernels.routing import topk_route

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SMALL = suite.Shape("small", experts=8, top_k=2, hidden=512, intermediate=256)
# Marlin pads I to lcm(64, group): 160 -> 192 with group 32 exercises the padded shards.
PADDED = suite.Shape("padded", experts=4, top_k=2, hidden=256, intermediate=160)


def _check(
    backend_name: str, shape: suite.Shape, variant: suite.Variant, tokens: tuple[int, ...]
) -> list[float]:
    device = torch.device("cuda")
    layer = suite.random_layer(shape, variant, seed=7, device=device)
    reference = suite.Reference(layer)
    try:
        backend, _ = suite.build_backend(backend_name, layer, device)
    except suite.KernelUnavailable as exc:
        pytest.skip(f"{backend_name} unavailable here: {exc}")
    gen = torch.Generator(device=device)
    gen.manual_seed(11)
    errors = []
    for m in tokens:
        x = torch.randn((m, shape.hidden), generator=gen, device=device).to(torch.bfloat16)
        logits = torch.randn((m, shape.experts), generator=gen, device=device)
        weights, ids = topk_route(logits, shape.top_k)
        ref = reference(x, ids, weights, "silu")
        suite.poison(device, 64 << 20)
        out = torch.full_like(x, float("nan"))
        assert backend.forward(x, ids, weights, "silu", out=out) is out
        assert bool(torch.isfinite(out).all()), f"{backend_name} M={m}: unwritten (NaN) output"
        rel = float((out.float() - ref).norm() / ref.norm())
        assert rel < suite.TOLERANCE, f"{backend_name} M={m}: relative error {rel:.3e}"
        errors.append(rel)
    return errors


MARLIN_CASES = [
    ("int4-g128-sym", SMALL),
    ("int4-g128-zp", SMALL),
    ("int8-ch-sym", SMALL),
    ("int4-ch-sym", SMALL),
    ("int4-g128-sym-bias", SMALL),
    ("int4-g32-zp", PADDED),
]


@pytest.mark.parametrize(
    ("variant", "shape"), MARLIN_CASES, ids=[c[0] + "-" + c[1].name for c in MARLIN_CASES]
)
def test_marlin_matches_reference(variant: str, shape: suite.Shape) -> None:
    _check("MARLIN", shape, suite.VARIANTS[variant], tokens=(1, 16, 200))


@pytest.mark.parametrize("variant", ["int4-g128-zp", "int8-ch-sym", "int4-g128-sym-bias"])
def test_humming_matches_reference(variant: str) -> None:
    _check("HUMMING", SMALL, suite.VARIANTS[variant], tokens=(16, 200))


def test_humming_sign_magnitude_path() -> None:
    """Symmetric codes that never use 0 (a real quantizer's) make humming re-encode the
    weights as sign-magnitude, as vLLM's conversion does: still the same numbers."""
    device = torch.device("cuda")
    variant = suite.VARIANTS["int4-g128-sym"]
    layer = suite.random_layer(SMALL, variant, seed=3, device=device)
    lifted = dataclasses.replace(
        layer,
        w13=dataclasses.replace(layer.w13, codes=layer.w13.codes.clamp(min=1)),
        w2=dataclasses.replace(layer.w2, codes=layer.w2.codes.clamp(min=1)),
    )
    from service.formats.writers.humming import config_from_tensor, write_humming

    converted = write_humming(lifted, source="gptq", options=ConversionOptions(device=device))
    b_dtype = config_from_tensor(converted.tensors["w13_humming_config"])["b_dtype"]
    assert b_dtype != "uint4", "expected humming's sign-magnitude re-encoding"
    spec = LayerSpec.from_canonical(lifted, layout="HUMMING")
    backend = suite.backend_class("HUMMING")()
    backend.prepare(converted.tensors, spec)
    reference = suite.Reference(lifted)
    x = torch.randn((16, SMALL.hidden), device=device).to(torch.bfloat16)
    weights, ids = topk_route(torch.randn((16, SMALL.experts), device=device), SMALL.top_k)
    ref = reference(x, ids, weights, "silu")
    out = backend.forward(x, ids, weights, "silu")
    assert float((out.float() - ref).norm() / ref.norm()) < suite.TOLERANCE


def test_humming_rejects_other_dtype() -> None:
    device = torch.device("cuda")
    layer = suite.random_layer(SMALL, suite.VARIANTS["int4-g128-zp"], seed=5, device=device)
    try:
        backend, _ = suite.build_backend("HUMMING", layer, device)
    except suite.KernelUnavailable as exc:
        pytest.skip(str(exc))
    x = torch.randn((4, SMALL.hidden), device=device, dtype=torch.float16)
    weights, ids = topk_route(torch.randn((4, SMALL.experts), device=device), SMALL.top_k)
    with pytest.raises(KernelInputError, match=r"converted for torch\.bfloat16"):
        backend.forward(x, ids, weights, "silu")


def test_marlin_op_registered_and_refuses_act_order() -> None:
    from service.kernels import marlin

    op = marlin.load_op()
    assert callable(op)
    assert hasattr(torch.ops._moe_C, "moe_wna16_marlin_gemm")
    spec = LayerSpec(
        num_experts=2,
        hidden_size=256,
        intermediate_size=128,
        bits=4,
        group_size=128,
        act_order=True,
        layout="MARLIN",
    )
    with pytest.raises(KernelUnavailableError, match="act-order"):
        marlin.MarlinExperts().prepare({}, spec)


def test_marlin_fp16_activations() -> None:
    """Scales are cast per activation dtype: the same layer runs fp16 and bf16 inputs."""
    device = torch.device("cuda")
    layer = suite.random_layer(SMALL, suite.VARIANTS["int4-g128-sym"], seed=9, device=device)
    try:
        backend, _ = suite.build_backend("MARLIN", layer, device)
    except suite.KernelUnavailable as exc:
        pytest.skip(str(exc))
    reference = suite.Reference(layer)
    x = torch.randn((32, SMALL.hidden), device=device)
    weights, ids = topk_route(torch.randn((32, SMALL.experts), device=device), SMALL.top_k)
    for dtype in (torch.float16, torch.bfloat16):
        ref = reference(x.to(dtype), ids, weights, "silu")
        out = backend.forward(x.to(dtype), ids, weights, "silu")
        assert out.dtype == dtype
        assert float((out.float() - ref).norm() / ref.norm()) < suite.TOLERANCE
