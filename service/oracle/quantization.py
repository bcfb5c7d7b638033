"""From a checkpoint's `quantization_config` to the MoE quant method vLLM builds.

vLLM first resolves which quantization method serves the model (the HF `quant_method`, the
`--quantization` flag and each method's override hook), parses the config, gates it on the
device's compute capability, and then asks the config for the MoE layer's method. That
method computes the weight `QuantKey`, `may_have_zp`, `may_have_bias` and
`allow_tile_padding` and calls the backend oracle. This module reproduces that path for the
integrations that reach the WNA16 oracle: AutoGPTQ, AutoAWQ, MoeWNA16, compressed-tensors
and AMD Quark.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from service.oracle.compressed_tensors import CtScheme, ct_moe_method, parse_scheme_map
from service.oracle.errors import InvalidSpecError
from service.oracle.moe_config import MoEConfig
from service.oracle.parallel_config import eplb_refusal
from service.oracle.platform import PlatformProfile
from service.oracle.quant_key import (
    K_INT4_STATIC,
    K_INT4_STATIC_32,
    K_INT8_STATIC,
)
from service.oracle.quant_method import (
    AwqConfig,
    ConfigKeys,
    GptqConfig,
    IntegrationRules,
    MoEMethodPlan,
    MoeWNA16Config,
    OracleCall,
    QuantConfig,
    left_unquantized,
    marlin_input_dtype_check,
    marlin_supports,
    vllm_error,
)
from service.oracle.quark import parse_quark, quark_moe_method
from service.oracle.spec import DeploymentSpec
from service.oracle.startup import StartupRules, platform_refusal

# --- method resolution (ModelConfig._verify_quantization) -----------------------------------

SUPPORTED_HF_METHODS = ("gptq", "awq", "compressed-tensors", "quark")
_GPTQ_USER_FLAGS = (None, "gptq", "gptq_marlin", "auto_gptq", "marlin")
_AWQ_USER_FLAGS = (None, "awq", "awq_marlin", "auto_awq", "marlin")
#: Minimum compute capability of each config class (`get_min_capability`).
_MIN_CAPABILITY = {
    "auto_gptq": 60,
    "auto_awq": 75,
    "moe_wna16": 70,
    "compressed-tensors": 70,
    "quark": 70,
}
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
    "quark": "quark",
}
#: Every resolved method name (a decision's `quantization`: the vLLM integration).
INTEGRATIONS = tuple(_CONFIG_CLASS)


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


def _moe_wna16_compatible(
    config: Mapping[str, Any], platform: PlatformProfile, rules: IntegrationRules
) -> bool:
    """`MoeWNA16Config.is_moe_wna16_compatible`: where act-order is still supported it
    reads the raw `desc_act` (so a channel-wise `desc_act` checkpoint is incompatible);
    later releases ask whether the desc_act validation would pass."""
    quant_method = str(config.get("quant_method", "")).lower()
    bits = config.get("bits")
    if rules.act_order_supported:
        act_order_ok = not config.get("desc_act")
    else:
        act_order_ok = (
            _gptq_desc_act_error(
                config.get("desc_act", False),
                config.get("group_size"),
                config.get("dynamic") or {},
            )
            is None
        )
    gptq_ok = quant_method == "gptq" and act_order_ok and bits in (4, 8)
    awq_ok = quant_method == "awq" and bits == 4 and platform.capability_int >= 75
    return gptq_ok or awq_ok


def resolve_method(spec: DeploymentSpec, rules: IntegrationRules) -> str:
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
    elif user == "moe_wna16" and _moe_wna16_compatible(config, platform, rules):
        resolved = "moe_wna16"
    if resolved is None:
        # No override claimed it: the checkpoint's own method name stands, and must agree
        # with the flag.
        if user is not None and user != raw:
            raise vllm_error(
                "quantization",
                "ValueError",
                f"Quantization method specified in the model config ({raw}) does not match "
                f"the quantization method specified in the `quantization` argument ({user}).",
            )
        resolved = raw
    allowed = rules.platform_quantizations.get(platform.device)
    if allowed is not None and resolved not in allowed:
        raise vllm_error(
            "quantization",
            "ValueError",
            f"{resolved} quantization is currently not supported in {platform.device}.",
        )
    return resolved


# --- config parsing (each class's from_config and __init__) ---------------------------------


def _parse_gptq(config: Mapping[str, Any], name: str, rules: IntegrationRules) -> GptqConfig:
    keys = ConfigKeys(config, name)
    dynamic = keys.get_or(("dynamic",), {}) or {}
    if not isinstance(dynamic, Mapping):
        raise InvalidSpecError.single(
            "hf_quantization_config.dynamic", "must map module regexes to overrides"
        )
    bits = keys.int_("bits")
    group_size = keys.int_("group_size")
    desc_act = keys.bool_("desc_act")
    sym = keys.bool_("sym")
    error = (
        None if rules.act_order_supported else _gptq_desc_act_error(desc_act, group_size, dynamic)
    )
    if error:
        raise vllm_error("quantization", "ValueError", error, quantization=name)
    if desc_act and group_size == -1:
        desc_act = False
    if (bits, sym) not in ((4, True), (8, True)):
        raise vllm_error(
            "quantization",
            "ValueError",
            f"Unsupported quantization config: bits={bits}, sym={sym}",
            quantization=name,
        )
    return GptqConfig(bits, group_size, desc_act, sym, dict(dynamic), dict(config))


def _parse_awq(config: Mapping[str, Any], name: str) -> AwqConfig:
    keys = ConfigKeys(config, name)
    bits = keys.int_("w_bit", "bits")
    group_size = keys.int_("q_group_size", "group_size")
    zero_point = keys.bool_("zero_point")
    skip = keys.get_or(("modules_to_not_convert",), None) or []
    if bits != 4:
        raise vllm_error(
            "quantization",
            "ValueError",
            f"Unsupported num_bits = {bits}. Supported: 4. For 8-bit AWQ, use Marlin backend "
            "by setting backend='awq:marlin' or backend='marlin'.",
            quantization=name,
        )
    return AwqConfig(bits, group_size, zero_point, tuple(skip), {**config, "quant_method": "awq"})


def _parse_moe_wna16(
    config: Mapping[str, Any],
    platform: PlatformProfile,
    name: str,
    rules: IntegrationRules,
    stage: str = "quantization",
) -> MoeWNA16Config:
    """`MoeWNA16Config.from_config`; `stage` says whether vLLM reaches it while parsing the
    model's config or as the fallback inside another method's `get_quant_method`. Where
    act-order is still supported it does not look at `desc_act` at all."""
    keys = ConfigKeys(config, name)
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
        raise vllm_error(
            stage, "ValueError", "moe_wna16 only support gptq and awq.", quantization=name
        )
    if method == "gptq":
        error = (
            None
            if rules.act_order_supported
            else _gptq_desc_act_error(
                config.get("desc_act", False), group_size, config.get("dynamic") or {}
            )
        )
        if error:
            raise vllm_error(stage, "ValueError", error, quantization=name)
    elif platform.capability_int < 75:
        raise vllm_error(
            stage,
            "ValueError",
            "The quantization method moe_wna16 + awq is not supported for the current GPU. "
            f"Minimum capability: 75. Current capability: {platform.capability_int}.",
            quantization=name,
        )
    return MoeWNA16Config(str(method), bits, group_size, has_zp, tuple(skip))


def _moe_wna16_method(
    config: MoeWNA16Config, name: str, layer_name: str, rules: IntegrationRules
) -> MoEMethodPlan:
    """`MoeWNA16Config.get_quant_method` and `MoeWNA16Method`'s constructor (where 8-bit
    weights must be channel-wise, it asserts so before the oracle runs)."""
    if any(module in layer_name for module in config.modules_to_not_convert):
        return left_unquantized(name, layer_name, "it matches modules_to_not_convert")
    if config.bits == 4:
        key = K_INT4_STATIC_32 if config.group_size == 32 else K_INT4_STATIC
    elif config.bits == 8:
        if rules.int8_channelwise_only and config.group_size != -1:
            raise vllm_error("moe_method", "AssertionError", "", quantization=name)
        key = K_INT8_STATIC
    else:
        raise vllm_error(
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
    config: GptqConfig, name: str, spec: DeploymentSpec, moe: MoEConfig, rules: IntegrationRules
) -> MoEMethodPlan:
    """`AutoGPTQConfig.get_quant_method` and `AutoGPTQMoEMethod`: act-order (only where a
    release still accepts it; `desc_act` is False otherwise) keeps Marlin's strict tile
    shape, in the layer check and in the oracle call alike."""
    layer = spec.layer.name
    if not marlin_supports(moe, config.group_size, not config.desc_act, spec.platform):
        fallback = _parse_moe_wna16(config.full_config, spec.platform, name, rules, "moe_method")
        return _moe_wna16_method(fallback, name, layer, rules)
    if _dynamic_override(config.dynamic, layer) is False:
        # get_quant_method sets the Marlin input dtype on whatever method it built.
        marlin_input_dtype_check(spec.platform, name)
        return left_unquantized(name, layer, "a negative '-:' dynamic rule matches it")
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
        if desc_act and group_size == -1 and not rules.act_order_supported:
            desc_act = False
        if (bits, sym) not in ((4, True), (8, True)):
            raise vllm_error(
                "moe_method",
                "ValueError",
                f"Unsupported quantization config: bits={bits}, sym={sym}",
                quantization=name,
            )
    effective = GptqConfig(bits, group_size, desc_act, sym, config.dynamic, config.full_config)
    key = K_INT4_STATIC if bits == 4 else K_INT8_STATIC

    def after(_backend: str) -> None:
        marlin_input_dtype_check(spec.platform, name)

    return OracleCall(name, "AutoGPTQMoEMethod", key, effective, not sym, True, not desc_act, after)


def _awq_method(
    config: AwqConfig, name: str, spec: DeploymentSpec, moe: MoEConfig, rules: IntegrationRules
) -> MoEMethodPlan:
    layer = spec.layer.name
    if any(module in layer for module in config.modules_to_not_convert):
        return left_unquantized(name, layer, "it matches modules_to_not_convert")
    if not marlin_supports(moe, config.group_size, True, spec.platform):
        fallback = _parse_moe_wna16(config.full_config, spec.platform, name, rules, "moe_method")
        return _moe_wna16_method(fallback, name, layer, rules)
    return OracleCall(
        name, "AutoAWQMoEMethod", K_INT4_STATIC, config, config.zero_point, True, True
    )


def build_moe_method(
    spec: DeploymentSpec,
    moe: MoEConfig,
    rules: IntegrationRules,
    startup: StartupRules | None = None,
) -> MoEMethodPlan:
    """Resolve, parse, gate and build: the MoE quant method vLLM constructs for the layer,
    as the release whose integration behaviour `rules` holds builds it, its engine config
    checked on the way (`startup`: the platform's refusals; none when not given)."""
    name = resolve_method(spec, rules)
    config = spec.hf_quantization_config
    platform = spec.platform
    config_class = _CONFIG_CLASS[name]
    parsed: QuantConfig | None = None
    scheme_map: dict[str, CtScheme] = {}
    quark: tuple[str | None, Mapping[str, Any]] | None = None
    if config_class == "auto_gptq":
        parsed = _parse_gptq(config, name, rules)
    elif config_class == "auto_awq":
        parsed = _parse_awq(config, name)
    elif config_class == "moe_wna16":
        parsed = _parse_moe_wna16(config, platform, name, rules)
    elif config_class == "quark":
        quark = parse_quark(config)
    else:
        scheme_map = parse_scheme_map(config, name, rules)
    minimum = _MIN_CAPABILITY[config_class]
    gated = platform.capability is not None and platform.device in ("cuda", "rocm")
    if gated and platform.capability_int < minimum:
        raise vllm_error(
            "capability",
            "ValueError",
            f"The quantization method {name} is not supported for the current GPU. "
            f"Minimum capability: {minimum}. Current capability: {platform.capability_int}.",
            quantization=name,
        )
    # The engine config (its ParallelConfig) is validated next, before the layer is built.
    refusal = eplb_refusal(spec.parallel, platform.device, rules.eplb_devices, name)
    if refusal is not None:
        raise refusal
    # The VllmConfig's construction: the platform's check_and_update_config.
    refused = platform_refusal(startup or StartupRules(), platform, name)
    if refused is not None:
        raise refused
    if not moe.is_act_and_mul and platform.device not in ("cuda", "rocm", "xpu"):
        raise vllm_error(
            "moe_method",
            "NotImplementedError",
            "is_act_and_mul=False is supported only for CUDA, XPU and ROCm for now",
            quantization=name,
        )
    if isinstance(parsed, GptqConfig):
        return _gptq_method(parsed, name, spec, moe, rules)
    if isinstance(parsed, AwqConfig):
        return _awq_method(parsed, name, spec, moe, rules)
    if isinstance(parsed, MoeWNA16Config):
        return _moe_wna16_method(parsed, name, spec.layer.name, rules)
    if quark is not None:
        return quark_moe_method(spec, *quark, rules)
    return ct_moe_method(spec, name, scheme_map, rules)
