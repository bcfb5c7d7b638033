"""The MoE activations, as one table every backend reads.

vLLM names eleven MoE activations (`MoEActivation`); its Triton WNA16 experts accept all but
`situ`. Each is either gated (w13 holds 2I rows: gate and up, the output has I columns) or
`_no_mul` (w13 holds I rows). The gated ones differ in where gate and up rows sit in w13 (the
first and second half, or alternating for gpt-oss's `swigluoai`) and in one formula; several
are the same clamped SwiGLU with other constants. Writing them as data (a formula code plus
constants) lets the emulation and the Triton kernel share one definition and one test.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.functional import gelu, relu, silu

from service.kernels.errors import KernelInputError

# Formula codes: the Triton kernel's ACT constexpr takes these values.
SILU_MUL = 0  # silu(gate) * up
SWIGLU_CLAMP = 1  # clamp; gate * sigmoid(alpha * gate) * (up + beta)
GELU_MUL = 2  # gelu(gate) * up (erf form)
GELU_TANH_MUL = 3  # gelu(gate) * up (tanh approximation)
SWIGLUSTEP = 4  # min(silu(gate), limit) * clamp(up)
SILU = 5
GELU = 6
GELU_TANH = 7
RELU2 = 8

#: The clamp vLLM's gpt-oss activations use when none is configured.
OAI_LIMIT = 7.0
OAI_ALPHA = 1.702


@dataclass(frozen=True, slots=True)
class ActivationKind:
    """One vLLM activation name: its formula, its w13 row layout and its fixed constants.

    `limit`/`alpha`/`beta` are the constants vLLM hard-codes for this name (None: taken from
    the layer's config, `ActivationSpec`). `interleaved` means gate row j is w13 row 2j and
    up row j is 2j+1; otherwise gate rows are [0, I) and up rows [I, 2I).
    """

    name: str
    code: int
    gated: bool
    interleaved: bool = False
    limit: float | None = None
    alpha: float | None = None
    beta: float | None = None
    needs_limit: bool = False


ACTIVATIONS: dict[str, ActivationKind] = {
    kind.name: kind
    for kind in (
        ActivationKind("silu", SILU_MUL, gated=True),
        ActivationKind("gelu", GELU_MUL, gated=True),
        ActivationKind("gelu_tanh", GELU_TANH_MUL, gated=True),
        # vLLM's swigluoai_and_mul op ignores the layer's config: always 1.702 / 7 / +1.
        ActivationKind(
            "swigluoai",
            SWIGLU_CLAMP,
            gated=True,
            interleaved=True,
            limit=OAI_LIMIT,
            alpha=OAI_ALPHA,
            beta=1.0,
        ),
        # Same math on the packed layout; limit, alpha and beta come from the layer's config
        # (vLLM asserts a clamp limit is configured).
        ActivationKind("swigluoai_uninterleave", SWIGLU_CLAMP, gated=True, needs_limit=True),
        ActivationKind("swiglustep", SWIGLUSTEP, gated=True, limit=OAI_LIMIT),
        ActivationKind("silu_no_mul", SILU, gated=False),
        ActivationKind("gelu_no_mul", GELU, gated=False),
        ActivationKind("gelu_tanh_no_mul", GELU_TANH, gated=False),
        ActivationKind("relu2_no_mul", RELU2, gated=False),
    )
}

#: vLLM's alias (HF configs say `gelu_pytorch_tanh`).
_ALIASES = {"gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True, slots=True)
class ActivationSpec:
    """An activation name plus the layer's SwiGLU settings (vLLM's `ApplyMoEActivationConfig`).

    `limit` is the clamp limit (`swiglu_limit` / `gemm1_clamp_limit`): with `silu` it turns
    on vLLM's clamped SwiGLU; `swigluoai_uninterleave` requires it. `alpha` and `beta` are
    the sigmoid scale and the up bias of `swigluoai_uninterleave`.
    """

    name: str
    limit: float | None = None
    alpha: float = 1.0
    beta: float = 0.0


@dataclass(frozen=True, slots=True)
class ResolvedActivation:
    """What a kernel needs: the formula code, the row layout and every constant, filled in."""

    name: str
    code: int
    gated: bool
    interleaved: bool
    limit: float
    alpha: float
    beta: float


def resolve(activation: str | ActivationSpec) -> ResolvedActivation:
    """Turn a name or spec into the formula and constants; unknown names are input errors."""
    spec = activation if isinstance(activation, ActivationSpec) else ActivationSpec(activation)
    name = _ALIASES.get(spec.name, spec.name)
    kind = ACTIVATIONS.get(name)
    if kind is None:
        raise KernelInputError(
            "activation", f"{spec.name!r} is not supported; use one of {sorted(ACTIVATIONS)}"
        )
    if kind.needs_limit and spec.limit is None:
        raise KernelInputError("activation", f"{name} needs a clamp limit (swiglu_limit)")
    code = kind.code
    if code == SILU_MUL and spec.limit is not None:
        code = SWIGLU_CLAMP  # vLLM's silu_and_mul_with_clamp(limit, alpha=1, beta=0)
    limit = kind.limit if kind.limit is not None else spec.limit
    return ResolvedActivation(
        name=name,
        code=code,
        gated=kind.gated,
        interleaved=kind.interleaved,
        limit=math.inf if limit is None else float(limit),
        alpha=kind.alpha if kind.alpha is not None else float(spec.alpha),
        beta=kind.beta if kind.beta is not None else float(spec.beta),
    )


def split_gate_up(h: torch.Tensor, act: ResolvedActivation) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of a gated GEMM1 output [..., 2I], in the activation's layout."""
    if act.interleaved:
        return h[..., 0::2], h[..., 1::2]
    half = h.shape[-1] // 2
    return h[..., :half], h[..., half:]


def apply(h: torch.Tensor, act: ResolvedActivation) -> torch.Tensor:
    """The activation on GEMM1's output, in the input's dtype (call it with float32)."""
    if not act.gated:
        return _UNGATED[act.code](h)
    gate, up = split_gate_up(h, act)
    if act.code == SILU_MUL:
        return silu(gate) * up
    if act.code == SWIGLU_CLAMP:
        gate = gate.clamp(max=act.limit)
        up = up.clamp(min=-act.limit, max=act.limit)
        return gate * torch.sigmoid(act.alpha * gate) * (up + act.beta)
    if act.code == GELU_MUL:
        return gelu(gate) * up
    if act.code == GELU_TANH_MUL:
        return gelu(gate, approximate="tanh") * up
    if act.code == SWIGLUSTEP:
        return silu(gate).clamp(max=act.limit) * up.clamp(min=-act.limit, max=act.limit)
    raise AssertionError(f"unknown gated activation code {act.code}")


_UNGATED: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    SILU: silu,
    GELU: gelu,
    GELU_TANH: lambda h: gelu(h, approximate="tanh"),
    RELU2: lambda h: torch.square(relu(h)),
}
