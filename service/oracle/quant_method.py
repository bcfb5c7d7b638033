"""What vLLM's quantization configs hold, and what a MoE quant method hands to the oracle.

The parsed config of each integration (AutoGPTQ, AutoAWQ, MoeWNA16, compressed-tensors'
weight arguments), the call a MoE method makes to `select_wna16_moe_backend` (`OracleCall`)
or the method that never reaches it (`OtherMethod`), and the checks several integrations
share (Marlin's shape support, its fp8-activation gate, vLLM's config-key lookup). Kept
apart from the integrations themselves so each integration module imports only these.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from service.oracle.errors import ErrorInfo, InvalidSpecError, SelectionError
from service.oracle.moe_config import MoEConfig
from service.oracle.platform import PlatformProfile
from service.oracle.quant_key import (
    QuantKey,
)

UNQUANTIZED_METHOD = "UnquantizedFusedMoEMethod"
#: The method vLLM 0.29 and older build for 4-bit compressed-tensors layers on gfx1100.
CT_RDNA3_METHOD = "CompressedTensorsWNA16RDNA3MoEMethod"

#: `supported_quantization` of the platforms that restrict it (others allow every method),
#: narrowed to the WNA16 method names, as vLLM 0.30 and later list them.
PLATFORM_QUANTIZATIONS: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "rocm": frozenset(
            {
                "awq",
                "auto_awq",
                "awq_marlin",
                "gptq",
                "auto_gptq",
                "compressed-tensors",
                "inc",
                "quark",
            }
        ),
        "xpu": frozenset(
            {"awq", "gptq", "moe_wna16", "auto_awq", "auto_gptq", "compressed-tensors"}
        ),
    }
)


# --- what releases' integrations do differently ---------------------------------------------


@dataclass(frozen=True, slots=True)
class IntegrationRules:
    """The integration behaviour that differs between vLLM releases, as data; the defaults
    are the newest release's. A ruleset carries one (`Ruleset.integrations`)."""

    #: Which WNA16 quantization methods each restricting platform lists.
    platform_quantizations: Mapping[str, frozenset[str]] = field(
        default_factory=lambda: PLATFORM_QUANTIZATIONS
    )
    #: Whether activation ordering (GPTQ `desc_act`, compressed-tensors `actorder` group or
    #: dynamic) is still supported. False (0.30 and later): refused while parsing the
    #: config, so the oracle never sees it. True (0.29 and older): kept as the checkpoint
    #: says and wired through: GPTQ and compressed-tensors pass
    #: `allow_tile_padding = not act-order` to Marlin's checks and to the oracle, a GPTQModel
    #: `dynamic` rule may switch `desc_act` on for a channel-wise layer (it is not reset),
    #: and MoeWNA16's compatibility check reads the raw `desc_act`.
    act_order_supported: bool = False
    #: The MoE method compressed-tensors builds for 4-bit schemes on ROCm gfx1100 ahead of
    #: the WNA16 method, outside the oracle's choice (0.29 and older); None: no such method
    #: (0.30 and later, where RDNA3 is an oracle backend). It inherits the WNA16 method's
    #: constructor, so the oracle still runs and the method's asserts still apply.
    ct_rocm_gfx1100_method: str | None = None
    #: The devices `ParallelConfig` allows expert-parallel load balancing on, in the order
    #: its refusal names them (XPU from 0.31).
    eplb_devices: tuple[str, ...] = ("cuda", "rocm", "xpu")
    #: compressed-tensors' `WNA16_ZP_SUPPORTED_TYPES_MAP` keys: the bit widths an asymmetric
    #: checkpoint has a zero-point type for. `CompressedTensorsWNA16MoEMethod` indexes the
    #: map with the checkpoint's bits, so another width raises `KeyError(bits)` there.
    ct_zero_point_bits: frozenset[int] = frozenset(range(2, 9))
    #: Whether the 8-bit WNA16 MoE methods take channel-wise scales only (0.28 and older):
    #: compressed-tensors' and MoeWNA16's constructors `assert group_size == -1` for 8-bit
    #: weights before they call the oracle. compressed-tensors compares the scheme's group
    #: size as the checkpoint gives it, so a per-channel scheme without one (None) fails too.
    int8_channelwise_only: bool = False
    #: The weight widths compressed-tensors' WNA16 MoE method builds a weight key for; it
    #: refuses any other width before the oracle runs (0.28 and older: 4 and 8). None: every
    #: width of the scalar-type table (0.29 and later).
    ct_moe_bits: frozenset[int] | None = None
    #: Whether compressed-tensors' non-Marlin path also asserts a symmetric scheme after the
    #: oracle chose (0.28 and older), so an asymmetric checkpoint runs on Marlin only.
    ct_non_marlin_symmetric_only: bool = False
    #: Whether compressed-tensors' MoE format/bits refusal hands `ValueError` its message in
    #: pieces (0.28 and older), so the error reads as the tuple of those pieces.
    ct_format_error_in_pieces: bool = False
    #: Whether Quark has its int4 weight-only MoE method, `QuarkW4A16Int4MoEMethod` (0.31
    #: and later); without it (0.30 and older) Quark's MoE method refuses such a layer with
    #: RuntimeError("Unsupported FusedMoe scheme") before any oracle runs.
    quark_w4a16_moe: bool = True
    #: Whether Quark's `_find_matched_config` walks `layer_quant_config` unguarded and asks
    #: `layer_type_quant_config` only when no pattern matched (0.28 and older); later
    #: releases read the type table first and take a missing `layer_quant_config` as empty.
    quark_legacy_config_lookup: bool = False
    #: Whether Quark's MoE method unwraps a one-entry `weight` / `input_tensors` list before
    #: asking its scheme predicates (0.30 and later); 0.29 and older hand them the list, and a
    #: list weight of any length but two reaches a predicate that calls `.get` on it:
    #: AttributeError("'list' object has no attribute 'get'").
    quark_unwraps_single_configs: bool = True


# --- parsed quantization configs (what vLLM's config classes hold) -------------------------


@dataclass(frozen=True, slots=True)
class GptqConfig:
    """vLLM's `AutoGPTQConfig` (GPTQ and GPTQModel checkpoints)."""

    bits: int
    group_size: int
    desc_act: bool
    sym: bool
    dynamic: Mapping[str, Any]
    full_config: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class AwqConfig:
    """vLLM's `AutoAWQConfig`."""

    bits: int
    group_size: int
    zero_point: bool
    modules_to_not_convert: tuple[str, ...]
    full_config: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class MoeWNA16Config:
    """vLLM's `MoeWNA16Config` (reached by `--quantization moe_wna16` or as a fallback)."""

    linear_quant_method: str
    bits: int
    group_size: int
    has_zp: bool
    modules_to_not_convert: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class WeightArgs:
    """compressed-tensors' `QuantizationArgs` for the weights of a config group."""

    num_bits: int
    type: str
    strategy: str
    group_size: int | None
    symmetric: bool
    actorder: str | None
    dynamic: bool


@dataclass(frozen=True, slots=True)
class QuarkConfig:
    """vLLM's `QuarkConfig` as `QuarkW4A16Int4MoEMethod` hands it to the oracle, with the
    routed-experts layer's int4 weight scheme beside it (what the method itself reads).

    vLLM's class has no `group_size` attribute: the oracle's rules that read one
    (`getattr(quant_config, "group_size", None)`) see None, whatever the scheme's group
    size (`weight_group_size`) is."""

    pack_method: str
    weight_dtype: str
    weight_group_size: int
    symmetric: bool

    @property
    def group_size(self) -> None:
        return None


QuantConfig = GptqConfig | AwqConfig | MoeWNA16Config | WeightArgs | QuarkConfig


def vllm_error(stage: str, type_: str, message: str, **kwargs: Any) -> SelectionError:
    return SelectionError(ErrorInfo(stage, type_, message), **kwargs)


class ConfigKeys:
    """`QuantizationConfig.get_from_keys` with vLLM's error text, plus type checks."""

    def __init__(self, config: Mapping[str, Any], quantization: str | None) -> None:
        self.config = config
        self.quantization = quantization

    def get(self, *keys: str) -> Any:
        for key in keys:
            if key in self.config:
                return self.config[key]
        raise vllm_error(
            "quantization",
            "ValueError",
            f"Cannot find any of {list(keys)} in the model's quantization config.",
            quantization=self.quantization,
        )

    def get_or(self, keys: tuple[str, ...], default: Any) -> Any:
        for key in keys:
            if key in self.config:
                return self.config[key]
        return default

    def int_(self, *keys: str) -> int:
        value = self.get(*keys)
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidSpecError.single(
                f"hf_quantization_config.{keys[0]}", f"must be an integer, got {value!r}"
            )
        return value

    def bool_(self, *keys: str, default: bool | None = None) -> bool:
        value = self.get(*keys) if default is None else self.get_or(keys, default)
        if not isinstance(value, bool):
            raise InvalidSpecError.single(
                f"hf_quantization_config.{keys[0]}", f"must be true or false, got {value!r}"
            )
        return value


# --- the MoE method each integration builds ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class OracleCall:
    """What a MoE quant method passes to `select_wna16_moe_backend`, plus its own checks.

    `after_selection` runs what the method's constructor (or `get_quant_method`) does after
    the oracle returned, and may raise vLLM's error for the chosen backend.
    """

    quantization: str
    moe_method: str
    weight_key: QuantKey
    quant_config: QuantConfig
    may_have_zp: bool
    may_have_bias: bool
    allow_tile_padding: bool
    after_selection: Callable[[str], None] = field(default=lambda backend: None)
    #: Backends with which the method implements EPLB (`supports_eplb`); none by default.
    eplb_backends: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class OtherMethod:
    """A MoE method that does not go through the WNA16 oracle (unquantized, FlyDSL);
    `why` says in a user's terms what happened to the layer."""

    quantization: str
    moe_method: str
    why: str = ""


def left_unquantized(quantization: str, layer: str, rule: str) -> OtherMethod:
    """The layer is left unquantized by `rule` (a skip list, an ignore list, a negative
    dynamic rule): vLLM builds its unquantized MoE method, which uses no WNA16 backend."""
    return OtherMethod(
        quantization,
        UNQUANTIZED_METHOD,
        f"the layer {layer} is not quantized ({rule}): vLLM builds {UNQUANTIZED_METHOD}, "
        "which runs the unquantized MoE kernels and uses no WNA16 backend",
    )


MoEMethodPlan = OracleCall | OtherMethod


def marlin_supports(
    moe: MoEConfig, group_size: int, allow_tile_padding: bool, platform: PlatformProfile
) -> bool:
    """vLLM's `check_moe_marlin_supports_config`."""
    if platform.device == "rocm":
        return False
    hidden, inter = moe.hidden_dim, moe.intermediate_size_per_partition
    if allow_tile_padding:
        shape_ok = hidden % 128 == 0 and (group_size <= 0 or inter % group_size == 0)
    else:
        shape_ok = hidden % 128 == 0 and inter % max(64, group_size) == 0
    return shape_ok and group_size in (-1, 32, 64, 128)


def marlin_input_dtype_check(platform: PlatformProfile, name: str) -> None:
    """`get_marlin_input_dtype`: fp8 Marlin activations only on SM89 and SM12x."""
    value = platform.env_flag("VLLM_MARLIN_INPUT_DTYPE")
    if value is None or value.lower() != "fp8":
        return
    cap = platform.capability_int
    if platform.device == "cuda" and (cap == 89 or cap // 10 == 12):
        return
    raise vllm_error(
        "moe_method",
        "ValueError",
        "Marlin W4A8-FP8 only support SM89 or SM12x device (It is slower than Marlin W4A16 "
        "on other devices). You can consider using W4A8-INT8 instead(set "
        "VLLM_MARLIN_INPUT_DTYPE=int8).",
        quantization=name,
    )
