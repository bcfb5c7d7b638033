"""The activation table: every vLLM name our kernels accept, against fp64 formulas."""

from __future__ import annotations

import pytest
import torch

from service.kernels.activation import ACTIVATIONS, ActivationSpec, apply, resolve
from service.kernels.errors import KernelInputError
from tests.kernels.helpers import act64

CASES = [
    *((name, {}) for name in sorted(ACTIVATIONS) if name != "swigluoai_uninterleave"),
    ("silu", {"limit": 3.0}),
    ("swigluoai_uninterleave", {"limit": 5.0, "alpha": 1.702, "beta": 1.0}),
    ("swigluoai_uninterleave", {"limit": 2.5}),
]


@pytest.mark.parametrize(("name", "params"), CASES, ids=str)
def test_matches_fp64_formula(name: str, params: dict[str, float]) -> None:
    act = resolve(ActivationSpec(name, **params))  # type: ignore[arg-type]
    h = torch.randn(4, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 4
    got = apply(h, act)
    want = torch.stack([act64(name, row, **params) for row in h])
    assert got.shape == ((4, 12) if act.gated else (4, 24))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_triton_wna16_set_is_vllms() -> None:
    # vLLM 0.33 TritonWNA16Experts: apply_moe_activation_supported minus situ.
    from service.oracle.rulesets.vllm_0_33 import TRITON_WNA16_ACTIVATIONS

    assert set(ACTIVATIONS) == set(TRITON_WNA16_ACTIVATIONS)


def test_alias_and_fixed_constants() -> None:
    assert resolve("gelu_pytorch_tanh").name == "gelu_tanh"
    oai = resolve(ActivationSpec("swigluoai", limit=1.0, alpha=2.0, beta=0.0))
    assert (oai.limit, oai.alpha, oai.beta, oai.interleaved) == (7.0, 1.702, 1.0, True)


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        (ActivationSpec("situ"), "not supported"),
        (ActivationSpec("tanh"), "not supported"),
        (ActivationSpec("swigluoai_uninterleave"), "clamp limit"),
    ],
)
def test_bad_activation(spec: ActivationSpec, fragment: str) -> None:
    with pytest.raises(KernelInputError, match=fragment) as info:
        resolve(spec)
    assert info.value.field == "activation"
