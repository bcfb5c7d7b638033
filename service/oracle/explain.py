"""Explanations beside vLLM's reasons, in a user's terms, where the two differ.

vLLM's reason texts stay exactly as vLLM gives them; some of them mislead a user who reads
them as a statement about the machine or the checkpoint: a kernel package that is not
installed reads "kernel does not support current device cuda", and an integration that can
load expert biases rules a backend out for "expert bias" on a model that has none. Each row
of `EXPLANATIONS` says, for a backend and a reason code, when vLLM's text needs a gloss and
what the gloss is. Backends vLLM never tried get theirs from `not_reached`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from service.oracle.platform import PACKAGE_DISTRIBUTIONS, PlatformProfile
from service.oracle.quant_method import AwqConfig, GptqConfig, QuarkConfig
from service.oracle.rulesets.base import RuleContext

_INTEGRATIONS = {GptqConfig: "AutoGPTQ", AwqConfig: "AutoAWQ"}


def _where(p: PlatformProfile) -> str:
    """The platform in a few words: "cuda 9.0", "rocm gfx942", "cpu without AMX"."""
    if p.device == "cpu":
        return "an x86 cpu with AMX" if (p.x86 and p.amx) else "a cpu without AMX"
    if p.capability is None:
        return p.device
    major, minor = p.capability
    return f"{p.device} {major}.{minor}" + (f" ({p.arch})" if p.arch else "")


def _missing(package: str) -> str:
    return (
        f"the {package} package is not installed (pip install "
        f"{PACKAGE_DISTRIBUTIONS[package]}); vLLM reports a kernel package it cannot import "
        "as an unsupported device"
    )


def _humming_device(ctx: RuleContext) -> str:
    p = ctx.platform
    if p.device == "cuda" and p.capability_int >= 75 and not p.has_package("humming"):
        return _missing("humming")
    return f"Humming kernels need an NVIDIA GPU of compute capability 7.5 or newer, not {_where(p)}"


def _flashinfer_device(ctx: RuleContext) -> str:
    p = ctx.platform
    wanting = []
    if not (p.device == "cuda" and p.capability_int // 10 == 10):
        wanting.append(f"a Blackwell SM10x GPU (this is {_where(p)})")
    if not ctx.env_bool("VLLM_USE_FLASHINFER_MOE_INT4"):
        wanting.append("VLLM_USE_FLASHINFER_MOE_INT4=1")
    if not p.has_package("flashinfer"):
        wanting.append(
            f"the flashinfer package (pip install {PACKAGE_DISTRIBUTIONS['flashinfer']})"
        )
    return "FlashInfer's TRT-LLM MxInt4 MoE needs " + " and ".join(wanting)


def _zen_device(ctx: RuleContext) -> str:
    if ctx.platform.device == "cpu":
        return _missing("zentorch")
    return f"the zentorch MoE kernel runs on AMD Zen CPUs only, not {_where(ctx.platform)}"


def _integration_bias(ctx: RuleContext) -> str:
    integration = _INTEGRATIONS.get(type(ctx.quant_config), "this integration")
    return (
        f"vLLM's {integration} integration declares may_have_bias=True for every checkpoint "
        "(it can load expert biases), so this is a property of the integration, not of the "
        "model: a checkpoint without expert biases is turned down the same way"
    )


def _zero_points_or_bias(ctx: RuleContext) -> str:
    parts = []
    if ctx.may_have_zp:
        parts.append("the checkpoint is asymmetric (it stores zero points)")
    if ctx.may_have_bias:
        parts.append(_integration_bias(ctx))
    return "; ".join(parts)


def _marlin_layer(ctx: RuleContext) -> str:
    p, moe = ctx.platform, ctx.moe
    if isinstance(ctx.quant_config, QuarkConfig):
        return (
            "vLLM's Marlin MoE path takes AutoGPTQ, AutoAWQ and compressed-tensors "
            "checkpoints only, so it turns every Quark checkpoint down, whatever the shape"
        )
    if p.device == "rocm":
        return "Marlin kernels do not run on ROCm"
    group = ctx.quant_config.group_size
    return (
        "Marlin needs the hidden size to be a multiple of 128 (here "
        f"{moe.hidden_dim}), the intermediate size per partition "
        f"({moe.intermediate_size_per_partition}) to be a multiple of the group size, and "
        f"a group size of -1, 32, 64 or 128 (here {group})"
    )


def _moe_wna16_layout(ctx: RuleContext) -> str:
    if ctx.quantization == "moe_wna16":
        return (
            "--quantization moe_wna16 loads the layer in MoeWNA16's own weight layout, which "
            "this backend does not take; without the flag vLLM keeps the checkpoint's own "
            "integration"
        )
    marlin = _marlin_layer(ctx)
    return (
        f"the checkpoint is not MoeWNA16: vLLM's {ctx.quantization} integration handed this "
        f"layer to MoeWNA16Method because Marlin cannot take it ({marlin}), and it is "
        "MoeWNA16's layout this backend turns down"
    )


def _quark_group_size(ctx: RuleContext) -> str:
    assert isinstance(ctx.quant_config, QuarkConfig)
    return (
        "vLLM reads the group size from the QuarkConfig object, which has none (Quark keeps "
        "it per layer; this layer's is "
        f"{ctx.quant_config.weight_group_size}), so ZEN_CPU turns every symmetric Quark "
        "checkpoint down"
    )


def _is_quark(ctx: RuleContext) -> bool:
    return isinstance(ctx.quant_config, QuarkConfig)


def _device(text: str) -> Callable[[RuleContext], str]:
    return lambda ctx: f"{text}, not {_where(ctx.platform)}"


def _always(ctx: RuleContext) -> bool:
    return True


def _bias_from_integration(ctx: RuleContext) -> bool:
    return type(ctx.quant_config) in _INTEGRATIONS


@dataclass(frozen=True, slots=True)
class Explanation:
    """Where vLLM's reason `code` for one of `backends` needs a gloss, and the gloss."""

    backends: frozenset[str]
    code: str
    applies: Callable[[RuleContext], bool]
    text: Callable[[RuleContext], str]


def _row(
    backends: str,
    code: str,
    text: Callable[[RuleContext], str],
    applies: Callable[[RuleContext], bool] = _always,
) -> Explanation:
    return Explanation(frozenset(backends.split()), code, applies, text)


EXPLANATIONS: tuple[Explanation, ...] = (
    _row("HUMMING", "DEVICE", _humming_device),
    _row("FLASHINFER_TRTLLM", "DEVICE", _flashinfer_device),
    _row("ZEN_CPU", "DEVICE", _zen_device),
    _row(
        "MARLIN BATCHED_MARLIN",
        "DEVICE",
        _device("Marlin kernels need an NVIDIA GPU of compute capability 7.5 or newer"),
    ),
    _row("CPU", "DEVICE", _device("the CPU int4 MoE kernel needs an x86 CPU with Intel AMX")),
    _row("TRITON", "DEVICE", _device("the Triton WNA16 kernel needs a CUDA, ROCm or XPU GPU")),
    _row("EMULATION", "DEVICE", _device("the emulation kernels need a CUDA or ROCm GPU")),
    _row("XPU", "DEVICE", _device("the XPU kernel needs an Intel XPU")),
    _row("RDNA3", "DEVICE", _device("the RDNA3 kernel needs an AMD RDNA3 GPU (gfx1100)")),
    _row("TRITON RDNA3", "EXPERT_BIAS", _integration_bias, _bias_from_integration),
    _row("FLASHINFER_TRTLLM", "ZERO_POINTS_OR_BIAS", _zero_points_or_bias),
    _row("MARLIN BATCHED_MARLIN", "MARLIN_LAYER_UNSUPPORTED", _marlin_layer),
    _row("MARLIN BATCHED_MARLIN EMULATION", "MOE_WNA16_LAYOUT", _moe_wna16_layout),
    _row("ZEN_CPU", "GROUP_QUANT_REQUIRED", _quark_group_size, _is_quark),
)

_BY_KEY: dict[tuple[str, str], tuple[Explanation, ...]] = {}
for _explanation in EXPLANATIONS:
    for _backend in _explanation.backends:
        key = (_backend, _explanation.code)
        _BY_KEY[key] = (*_BY_KEY.get(key, ()), _explanation)


def explain_rejection(backend: str, code: str, ctx: RuleContext) -> str:
    """The gloss on vLLM's reason `code` for `backend`, or "" where vLLM's text says it."""
    for explanation in _BY_KEY.get((backend, code), ()):
        if explanation.applies(ctx):
            return explanation.text(ctx)
    return ""


def not_reached(winner: str | None, forced: str | None, moe_backend: str) -> str:
    """Why vLLM never tried a backend: an earlier one won, another was forced, or vLLM
    refused the --moe-backend name before trying any."""
    if forced is not None:
        return f"not tried: --moe-backend {moe_backend} forces {forced}"
    if winner is not None:
        return f"not tried: {winner} comes earlier in vLLM's priority order and was selected"
    return f"not tried: vLLM refused --moe-backend {moe_backend!r} before trying any backend"
