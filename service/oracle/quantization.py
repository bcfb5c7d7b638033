"""From a checkpoint's `quantization_config` to the MoE quant method vLLM builds.

vLLM first resolves which quantization method serves the model (the HF `quant_method`, the
`--quantization` flag and each method's override hook), parses the config, gates it on the
device's compute capability, and then asks the config for the MoE layer's method. That
method computes the weight `QuantKey`, `may_have_zp`, `may_have_bias` and
`allow_tile_padding` and calls the backend oracle. This module reproduces that path for the
integrations that reach the WNA16 oracle: AutoGPTQ, AutoAWQ, MoeWNA16 and compressed-tensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from service.oracle.errors import ErrorInfo, InvalidSpecError, SelectionError
from service.oracle.moe_config import MoEConfig
from service.oracle.platform import PlatformProfile
from service.oracle.quant_key import (
    ASYMMETRIC_TYPES,
    K_INT4_STATIC,
    K_INT4_STATIC_32,
    K_INT8_STATIC,
    PER_CHANNEL,
    PER_TOKEN,
    SYMMETRIC_TYPES,
    QuantKey,
)
from service.oracle.spec import DeploymentSpec

UNQUANTIZED_METHOD = "UnquantizedFusedMoEMethod"


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


QuantConfig = GptqConfig | AwqConfig | MoeWNA16Config | WeightArgs


def _vllm_error(stage: str, type_: str, message: str, **kwargs: Any) -> SelectionError:
    return SelectionError(ErrorInfo(stage, type_, message), **kwargs)


class _Keys:
    """`QuantizationConfig.get_from_keys` with vLLM's error text, plus type checks."""

    def __init__(self, config: Mapping[str, Any], quantization: str | None) -> None:
        self.config = config
        self.quantization = quantization

    def get(self, *keys: str) -> Any:
        for key in keys:
            if key in self.config:
                return self.config[key]
        raise _vllm_error(
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


# --- method resolution (ModelConfig._verify_quantization) -----------------------------------

SUPPORTED_HF_METHODS = ("gptq", "awq", "compressed-tensors")
_GPTQ_USER_FLAGS = (None, "gptq", "gptq_marlin", "auto_gptq", "marlin")
_AWQ_USER_FLAGS = (None, "awq", "awq_marlin", "auto_awq", "marlin")
#: `supported_quantization` of the platforms that restrict it (others allow every method).
_PLATFORM_QUANTIZATIONS: Mapping[str, frozenset[str]] = {
    "rocm": frozenset(
        {"awq", "auto_awq", "awq_marlin", "gptq", "auto_gptq", "compressed-tensors", "inc"}
    ),
    "xpu": frozenset({"awq", "gptq", "moe_wna16", "auto_awq", "auto_gptq", "compressed-tensors"}),
}
#: Minimum compute capability of each config class (`get_min_capability`).
_MIN_CAPABILITY = {"auto_gptq": 60, "auto_awq": 75, "moe_wna16": 70, "compressed-tensors": 70}
#: Which config class a resolved method name builds.
_CONFIG_CLASS = {
    "auto_gptq": "auto_gptq",
    "gptq": "auto_gptq",
    "gptq_marlin": "auto_gptq",
    "auto_awq": "auto_awq",
    "awq": "auto_awq",
    "awq_marlin": "auto_awq",
    "moe_wna16": "moe_wna16",
    "compressed-tensors": "compressed-tensors",
}


def _gptq_desc_act_error(desc_act: Any, group_size: Any, dynamic: Mapping[str, Any]) -> str | None:
    """vLLM's `normalize_and_validate_gptq_desc_act`: the error text, or None if fine."""
    base = desc_act
    if desc_act and group_size == -1:
        desc_act = False
    if desc_act:
        return (
            "GPTQ group activation ordering (desc_act=True) is no longer supported. Use a "
            "checkpoint with static activation ordering or desc_act=False."
        )
    for pattern, overrides in dynamic.items():
        if pattern.startswith("-:") or not isinstance(overrides, Mapping):
            continue
        if overrides.get("desc_act", base) and overrides.get("group_size", group_size) != -1:
            return (
                "GPTQ group activation ordering (desc_act=True) is no longer supported, but "
                f"is enabled by dynamic rule {pattern!r}. Use a checkpoint with static "
                "activation ordering or desc_act=False."
            )
    return None


def _moe_wna16_compatible(config: Mapping[str, Any], platform: PlatformProfile) -> bool:
    quant_method = str(config.get("quant_method", "")).lower()
    bits = config.get("bits")
    act_order_ok = (
        _gptq_desc_act_error(
            config.get("desc_act", False), config.get("group_size"), config.get("dynamic") or {}
        )
        is None
    )
    gptq_ok = quant_method == "gptq" and act_order_ok and bits in (4, 8)
    awq_ok = quant_method == "awq" and bits == 4 and platform.capability_int >= 75
    return gptq_ok or awq_ok


def resolve_method(spec: DeploymentSpec) -> str:
    """The quantization method name vLLM settles on (`ModelConfig._verify_quantization`)."""
    config = spec.hf_quantization_config
    raw = config.get("quant_method")
    if not isinstance(raw, str):
        raise InvalidSpecError.single(
            "hf_quantization_config.quant_method",
            f"required; one of {list(SUPPORTED_HF_METHODS)}",
        )
    hf_method = raw.lower()
    if hf_method not in SUPPORTED_HF_METHODS:
        raise InvalidSpecError.single(
            "hf_quantization_config.quant_method",
            f"{raw!r} is not a weight-only int (WNA16) method; one of {list(SUPPORTED_HF_METHODS)}",
        )
    user = spec.quantization
    platform = spec.platform
    resolved: str | None = None
    if hf_method == "gptq" and user in _GPTQ_USER_FLAGS:
        resolved = "auto_gptq"
    elif hf_method == "awq" and user in _AWQ_USER_FLAGS and platform.device != "cpu":
        resolved = "auto_awq"
    elif user == "moe_wna16" and _moe_wna16_compatible(config, platform):
        resolved = "moe_wna16"
    if resolved is None:
        # No override claimed it: the checkpoint's own method name stands, and must agree
        # with the flag.
        if user is not None and user != raw:
            raise _vllm_error(
                "quantization",
                "ValueError",
                f"Quantization method specified in the model config ({raw}) does not match "
                f"the quantization method specified in the `quantization` argument ({user}).",
            )
        resolved = raw
    allowed = _PLATFORM_QUANTIZATIONS.get(platform.device)
    if allowed is not None and resolved not in allowed:
        raise _vllm_error(
            "quantization",
            "ValueError",
            f"{resolved} quantization is currently not supported in {platform.device}.",
        )
    return resolved


# --- config parsing (each class's from_config and __init__) ---------------------------------


def _parse_gptq(config: Mapping[str, Any], name: str) -> GptqConfig:
    keys = _Keys(config, name)
    dynamic = keys.get_or(("dynamic",), {}) or {}
    if not isinstance(dynamic, Mapping):
        raise InvalidSpecError.single(
            "hf_quantization_config.dynamic", "must map module regexes to overrides"
        )
    bits = keys.int_("bits")
    group_size = keys.int_("group_size")
    desc_act = keys.bool_("desc_act")
    sym = keys.bool_("sym")
    error = _gptq_desc_act_error(desc_act, group_size, dynamic)
    if error:
        raise _vllm_error("quantization", "ValueError", error, quantization=name)
    if desc_act and group_size == -1:
        desc_act = False
    if (bits, sym) not in ((4, True), (8, True)):
        raise _vllm_error(
            "quantization",
            "ValueError",
            f"Unsupported quantization config: bits={bits}, sym={sym}",
            quantization=name,
        )
    return GptqConfig(bits, group_size, desc_act, sym, dict(dynamic), dict(config))


def _parse_awq(config: Mapping[str, Any], name: str) -> AwqConfig:
    keys = _Keys(config, name)
    bits = keys.int_("w_bit", "bits")
    group_size = keys.int_("q_group_size", "group_size")
    zero_point = keys.bool_("zero_point")
    skip = keys.get_or(("modules_to_not_convert",), None) or []
    if bits != 4:
        raise _vllm_error(
            "quantization",
            "ValueError",
            f"Unsupported num_bits = {bits}. Supported: 4. For 8-bit AWQ, use Marlin backend "
            "by setting backend='awq:marlin' or backend='marlin'.",
            quantization=name,
        )
    return AwqConfig(bits, group_size, zero_point, tuple(skip), {**config, "quant_method": "awq"})


def _parse_moe_wna16(
    config: Mapping[str, Any], platform: PlatformProfile, name: str, stage: str = "quantization"
) -> MoeWNA16Config:
    """`MoeWNA16Config.from_config`; `stage` says whether vLLM reaches it while parsing the
    model's config or as the fallback inside another method's `get_quant_method`."""
    keys = _Keys(config, name)
    method = keys.get("quant_method")
    bits = keys.int_("bits")
    group_size = keys.int_("group_size")
    if method == "gptq":
        has_zp = not keys.bool_("sym")
        skip: list[str] = []
    elif method in ("awq", "awq_marlin"):
        has_zp = keys.bool_("zero_point")
        skip = keys.get_or(("modules_to_not_convert",), None) or []
    else:
        raise _vllm_error(
            stage, "ValueError", "moe_wna16 only support gptq and awq.", quantization=name
        )
    if method == "gptq":
        error = _gptq_desc_act_error(
            config.get("desc_act", False), group_size, config.get("dynamic") or {}
        )
        if error:
            raise _vllm_error(stage, "ValueError", error, quantization=name)
    elif platform.capability_int < 75:
        raise _vllm_error(
            stage,
            "ValueError",
            "The quantization method moe_wna16 + awq is not supported for the current GPU. "
            f"Minimum capability: 75. Current capability: {platform.capability_int}.",
            quantization=name,
        )
    return MoeWNA16Config(str(method), bits, group_size, has_zp, tuple(skip))


_CT_STRATEGIES = ("tensor", "channel", "group", "block", "token", "tensor_group")
_CT_ACTORDERS = ("group", "weight", "dynamic", "static")


def _parse_weight_args(obj: Mapping[str, Any], path: str) -> WeightArgs:
    if not isinstance(obj, Mapping):
        raise InvalidSpecError.single(path, "must be a QuantizationArgs object")
    num_bits = obj.get("num_bits", 8)
    if isinstance(num_bits, bool) or not isinstance(num_bits, int) or not 1 <= num_bits <= 32:
        raise InvalidSpecError.single(f"{path}.num_bits", f"must be an integer, got {num_bits!r}")
    type_ = obj.get("type", "int")
    if type_ != "int":
        raise InvalidSpecError.single(
            f"{path}.type", f"only integer weights are WNA16 ('int'), got {type_!r}"
        )
    group_size = obj.get("group_size")
    strategy = obj.get("strategy")
    if strategy is None:
        if group_size is not None and group_size > 0:
            strategy = "group"
        elif group_size == -1:
            strategy = "channel"
        else:
            strategy = "tensor"
    if strategy not in _CT_STRATEGIES:
        raise InvalidSpecError.single(
            f"{path}.strategy", f"must be one of {list(_CT_STRATEGIES)}, got {strategy!r}"
        )
    if strategy == "group" and (not isinstance(group_size, int) or group_size <= 0):
        raise InvalidSpecError.single(
            f"{path}.group_size", "the group strategy needs a positive group_size"
        )
    if strategy != "group" and group_size is not None and group_size > 0:
        raise InvalidSpecError.single(
            f"{path}.group_size", f"a group_size needs strategy 'group', got {strategy!r}"
        )
    actorder = obj.get("actorder")
    if actorder is True:
        actorder = "group"
    elif actorder is False:
        actorder = None
    if actorder is not None and actorder not in _CT_ACTORDERS:
        raise InvalidSpecError.single(
            f"{path}.actorder", f"must be null or one of {list(_CT_ACTORDERS)}, got {actorder!r}"
        )
    if actorder is not None and strategy != "group":
        raise InvalidSpecError.single(
            f"{path}.actorder", "activation ordering needs strategy 'group'"
        )
    symmetric = obj.get("symmetric", True)
    dynamic = obj.get("dynamic", False)
    if not isinstance(symmetric, bool) or not isinstance(dynamic, bool):
        raise InvalidSpecError.single(path, "symmetric and dynamic must be true or false")
    return WeightArgs(
        num_bits,
        type_,
        strategy,
        None if strategy == "channel" else group_size,
        symmetric,
        actorder,
        dynamic,
    )


@dataclass(frozen=True, slots=True)
class _CtScheme:
    weights: WeightArgs | None
    has_input_quant: bool
    format: str | None


def _regex_or_equal(value: str, target: str, *, contains: bool = False) -> bool:
    """compressed-tensors matching: 're:' regexes (re.match), else equality or containment."""
    if target.startswith("re:"):
        return re.match(target[3:], value) is not None
    if contains:
        return target.lower() in value.lower()
    return target == value


def _ct_scheme_for(
    config: Mapping[str, Any],
    schemes: Mapping[str, _CtScheme],
    name: str,
    *,
    module_class: str = "RoutedExperts",
) -> _CtScheme | None:
    """`CompressedTensorsConfig.get_scheme_dict` for one projection of the MoE layer."""
    ignore = config.get("ignore") or []
    if any(_regex_or_equal(name, pattern) for pattern in ignore):
        return None
    for target, scheme in schemes.items():
        if _regex_or_equal(name, target):
            return scheme
    for target, scheme in schemes.items():
        if _regex_or_equal(module_class, target, contains=True):
            return scheme
    return None


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
    """A MoE method that does not go through the WNA16 oracle (unquantized, FlyDSL)."""

    quantization: str
    moe_method: str


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


def _marlin_input_dtype_check(platform: PlatformProfile, name: str) -> None:
    """`get_marlin_input_dtype`: fp8 Marlin activations only on SM89 and SM12x."""
    value = platform.env_flag("VLLM_MARLIN_INPUT_DTYPE")
    if value is None or value.lower() != "fp8":
        return
    cap = platform.capability_int
    if platform.device == "cuda" and (cap == 89 or cap // 10 == 12):
        return
    raise _vllm_error(
        "moe_method",
        "ValueError",
        "Marlin W4A8-FP8 only support SM89 or SM12x device (It is slower than Marlin W4A16 "
        "on other devices). You can consider using W4A8-INT8 instead(set "
        "VLLM_MARLIN_INPUT_DTYPE=int8).",
        quantization=name,
    )


def _moe_wna16_method(config: MoeWNA16Config, name: str, layer_name: str) -> MoEMethodPlan:
    if any(module in layer_name for module in config.modules_to_not_convert):
        return OtherMethod(name, UNQUANTIZED_METHOD)
    if config.bits == 4:
        key = K_INT4_STATIC_32 if config.group_size == 32 else K_INT4_STATIC
    elif config.bits == 8:
        key = K_INT8_STATIC
    else:
        raise _vllm_error(
            "moe_method",
            "ValueError",
            "MoeWNA16Method only supports int4 and int8 now.",
            quantization=name,
        )
    return OracleCall(name, "MoeWNA16Method", key, config, config.has_zp, False, False)


def _dynamic_override(dynamic: Mapping[str, Any], layer: str, key: str | None = None) -> Any:
    """GPTQModel `dynamic` rules: False for a negative match, else the first positive match."""
    for pattern, overrides in dynamic.items():
        if pattern.startswith("-:"):
            if re.match(pattern.removeprefix("-:"), layer):
                return False
        elif re.match(pattern.removeprefix("+:"), layer):
            return overrides if key is None else overrides.get(key)
    return None


def _gptq_method(
    config: GptqConfig, name: str, spec: DeploymentSpec, moe: MoEConfig
) -> MoEMethodPlan:
    layer = spec.layer.name
    if not marlin_supports(moe, config.group_size, True, spec.platform):
        fallback = _parse_moe_wna16(config.full_config, spec.platform, name, "moe_method")
        return _moe_wna16_method(fallback, name, layer)
    if _dynamic_override(config.dynamic, layer) is False:
        # get_quant_method sets the Marlin input dtype on whatever method it built.
        _marlin_input_dtype_check(spec.platform, name)
        return OtherMethod(name, UNQUANTIZED_METHOD)
    bits, group_size, desc_act, sym = config.bits, config.group_size, config.desc_act, config.sym
    if _dynamic_override(config.dynamic, layer) is not None:
        overrides = _dynamic_override(config.dynamic, layer)
        bits = overrides.get("bits", bits) if isinstance(overrides.get("bits"), int) else bits
        group_size = (
            overrides["group_size"] if isinstance(overrides.get("group_size"), int) else group_size
        )
        desc_act = (
            overrides["desc_act"] if isinstance(overrides.get("desc_act"), bool) else desc_act
        )
        sym = overrides["sym"] if isinstance(overrides.get("sym"), bool) else sym
        if desc_act and group_size == -1:
            desc_act = False
        if (bits, sym) not in ((4, True), (8, True)):
            raise _vllm_error(
                "moe_method",
                "ValueError",
                f"Unsupported quantization config: bits={bits}, sym={sym}",
                quantization=name,
            )
    effective = GptqConfig(bits, group_size, desc_act, sym, config.dynamic, config.full_config)
    key = K_INT4_STATIC if bits == 4 else K_INT8_STATIC

    def after(_backend: str) -> None:
        _marlin_input_dtype_check(spec.platform, name)

    return OracleCall(name, "AutoGPTQMoEMethod", key, effective, not sym, True, True, after)


def _awq_method(
    config: AwqConfig, name: str, spec: DeploymentSpec, moe: MoEConfig
) -> MoEMethodPlan:
    layer = spec.layer.name
    if any(module in layer for module in config.modules_to_not_convert):
        return OtherMethod(name, UNQUANTIZED_METHOD)
    if not marlin_supports(moe, config.group_size, True, spec.platform):
        fallback = _parse_moe_wna16(config.full_config, spec.platform, name, "moe_method")
        return _moe_wna16_method(fallback, name, layer)
    return OracleCall(
        name, "AutoAWQMoEMethod", K_INT4_STATIC, config, config.zero_point, True, True
    )


def _ct_method(
    spec: DeploymentSpec, name: str, scheme_map: Mapping[str, _CtScheme]
) -> MoEMethodPlan:
    config = spec.hf_quantization_config
    layer = spec.layer.name
    schemes = [
        _ct_scheme_for(config, scheme_map, f"{layer}.0.{proj}")
        for proj in ("gate_proj", "up_proj", "down_proj")
    ]
    if any(s != schemes[0] for s in schemes):
        raise _vllm_error(
            "moe_method",
            "ValueError",
            "All MoE projections need to have same quantization scheme but found multiple",
            quantization=name,
        )
    scheme = schemes[0]
    if scheme is None or scheme.weights is None:
        return OtherMethod(name, UNQUANTIZED_METHOD)
    weights = scheme.weights
    if weights.strategy not in ("channel", "group") or scheme.has_input_quant or weights.dynamic:
        raise InvalidSpecError.single(
            "hf_quantization_config.config_groups",
            "the MoE layer's scheme is not weight-only int with group or channel scales "
            "(WNA16); other compressed-tensors schemes do not use the WNA16 oracle",
        )
    if weights.num_bits not in SYMMETRIC_TYPES or scheme.format != "pack-quantized":
        raise _vllm_error(
            "moe_method",
            "ValueError",
            "For Fused MoE layers, only format: pack-quantized and bits: "
            f"{list(SYMMETRIC_TYPES)} is supported but got format: pack-quantized and bits: "
            f"{weights.num_bits}",
            quantization=name,
        )
    platform = spec.platform
    group_size = -1 if weights.group_size is None else weights.group_size
    if (
        platform.device == "rocm"
        and platform.arch == "gfx950"
        and spec.moe_backend == "flydsl"
        and weights.strategy == "group"
        and weights.num_bits == 4
        and group_size == 32
        and not spec.lora
    ):
        return OtherMethod(name, "CompressedTensorsW4A16FlydslMoEMethod")
    bits = weights.num_bits
    dtype = SYMMETRIC_TYPES[bits] if weights.symmetric else ASYMMETRIC_TYPES[bits]
    if bits == 4:
        shape = (1, 32) if group_size == 32 else PER_TOKEN
    elif bits == 8:
        shape = PER_TOKEN
    else:
        shape = PER_CHANNEL if group_size == -1 else (1, group_size)
    key = QuantKey(dtype, shape, weights.symmetric)

    def after(backend: str) -> None:
        if backend in ("MARLIN", "BATCHED_MARLIN"):
            _marlin_input_dtype_check(platform, name)
        elif weights.strategy != "group":
            raise _vllm_error("moe_method", "AssertionError", "", quantization=name)

    return OracleCall(
        name,
        "CompressedTensorsWNA16MoEMethod",
        key,
        weights,
        not weights.symmetric,
        False,
        True,
        after,
        eplb_backends=frozenset({"TRITON"}),
    )


def _ct_scheme_map(config: Mapping[str, Any], name: str) -> dict[str, _CtScheme]:
    """`CompressedTensorsConfig.from_config`: the target -> scheme map, parsed once.

    Group and dynamic act-order are refused here, as vLLM refuses them while parsing; a
    `Linear` target also stands for the fused `RoutedExperts` module, as in vLLM.
    """
    groups = config.get("config_groups") or {}
    if not isinstance(groups, Mapping):
        raise InvalidSpecError.single(
            "hf_quantization_config.config_groups", "must map group names to schemes"
        )
    top_format = config.get("format")
    schemes: dict[str, _CtScheme] = {}
    for group_name, group in groups.items():
        path = f"hf_quantization_config.config_groups.{group_name}"
        if not isinstance(group, Mapping) or not isinstance(group.get("targets"), list):
            raise InvalidSpecError.single(path, "needs a 'targets' list and 'weights'")
        targets = group["targets"]
        if len(targets) == 1 and str(targets[0]).endswith("Attention"):
            continue
        weights = group.get("weights")
        args = _parse_weight_args(weights, f"{path}.weights") if weights is not None else None
        if args is not None and args.actorder in ("group", "dynamic"):
            raise _vllm_error(
                "quantization",
                "ValueError",
                "Compressed-tensors group/dynamic activation ordering "
                f"(actorder={args.actorder!r}) is no longer supported. Use a checkpoint with "
                "static/weight activation ordering or without activation ordering.",
                quantization=name,
            )
        scheme = _CtScheme(
            args, group.get("input_activations") is not None, group.get("format") or top_format
        )
        for target in targets:
            schemes[target] = scheme
    if "Linear" in schemes and "RoutedExperts" not in schemes:
        schemes["RoutedExperts"] = schemes["Linear"]
    return schemes


def build_moe_method(spec: DeploymentSpec, moe: MoEConfig) -> MoEMethodPlan:
    """Resolve, parse, gate and build: the MoE quant method vLLM constructs for the layer."""
    name = resolve_method(spec)
    config = spec.hf_quantization_config
    platform = spec.platform
    config_class = _CONFIG_CLASS[name]
    parsed: QuantConfig | None = None
    scheme_map: dict[str, _CtScheme] = {}
    if config_class == "auto_gptq":
        parsed = _parse_gptq(config, name)
    elif config_class == "auto_awq":
        parsed = _parse_awq(config, name)
    elif config_class == "moe_wna16":
        parsed = _parse_moe_wna16(config, platform, name)
    else:
        scheme_map = _ct_scheme_map(config, name)
    minimum = _MIN_CAPABILITY[config_class]
    gated = platform.capability is not None and platform.device in ("cuda", "rocm")
    if gated and platform.capability_int < minimum:
        raise _vllm_error(
            "capability",
            "ValueError",
            f"The quantization method {name} is not supported for the current GPU. "
            f"Minimum capability: {minimum}. Current capability: {platform.capability_int}.",
            quantization=name,
        )
    if not moe.is_act_and_mul and platform.device not in ("cuda", "rocm", "xpu"):
        raise _vllm_error(
            "moe_method",
            "NotImplementedError",
            "is_act_and_mul=False is supported only for CUDA, XPU and ROCm for now",
            quantization=name,
        )
    if isinstance(parsed, GptqConfig):
        return _gptq_method(parsed, name, spec, moe)
    if isinstance(parsed, AwqConfig):
        return _awq_method(parsed, name, spec, moe)
    if isinstance(parsed, MoeWNA16Config):
        return _moe_wna16_method(parsed, name, spec.layer.name)
    return _ct_method(spec, name, scheme_map)
