"""compressed-tensors: the scheme map vLLM parses and the WNA16 MoE method it builds.

`CompressedTensorsConfig.from_config` turns `config_groups` into a target -> scheme map
(refusing group and dynamic activation ordering while parsing); the MoE layer's projections
then look up their scheme, and a weight-only int scheme with group or channel scales builds
`CompressedTensorsWNA16MoEMethod`, which calls the WNA16 oracle.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.oracle.errors import InvalidSpecError
from service.oracle.quant_key import (
    ASYMMETRIC_TYPES,
    PER_CHANNEL,
    PER_TOKEN,
    SYMMETRIC_TYPES,
    QuantKey,
)
from service.oracle.quant_method import (
    IntegrationRules,
    MoEMethodPlan,
    OracleCall,
    OtherMethod,
    WeightArgs,
    left_unquantized,
    marlin_input_dtype_check,
    vllm_error,
)
from service.oracle.spec import DeploymentSpec

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
        group_size,
        symmetric,
        actorder,
        dynamic,
    )


@dataclass(frozen=True, slots=True)
class CtScheme:
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
    schemes: Mapping[str, CtScheme],
    name: str,
    *,
    module_class: str = "RoutedExperts",
) -> CtScheme | None:
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


def _rocm_gfx1100_method(
    spec: DeploymentSpec, weights: WeightArgs, rules: IntegrationRules
) -> str | None:
    """The method a release builds for 4-bit schemes on gfx1100 ahead of the WNA16 one
    (`rocm_moe_rdna.is_supported`: 4 bits, `on_gfx1100()`, the HIP op built), if any."""
    platform = spec.platform
    if rules.ct_rocm_gfx1100_method is None or platform.device != "rocm":
        return None
    if weights.num_bits != 4 or "gfx1100" not in (platform.arch or ""):
        return None
    return rules.ct_rocm_gfx1100_method


def _format_error(num_bits: int, rules: IntegrationRules) -> str:
    """vLLM's refusal of a scheme that is not pack-quantized with a supported width (it
    names pack-quantized as the format it got, whatever the format was)."""
    pieces = (
        "For Fused MoE layers, only format: ",
        "pack-quantized ",
        f" and bits: {list(SYMMETRIC_TYPES)} is supported ",
        f"but got format: pack-quantized  and bits: {num_bits}",
    )
    if rules.ct_format_error_in_pieces:
        return str(pieces)
    return (
        "For Fused MoE layers, only format: pack-quantized and bits: "
        f"{list(SYMMETRIC_TYPES)} is supported but got format: pack-quantized and bits: "
        f"{num_bits}"
    )


def _check_legacy_widths(weights: WeightArgs, rules: IntegrationRules, name: str) -> None:
    """The width checks of releases whose WNA16 MoE method knew int4 and int8 only: 8-bit
    weights must be channel-wise (the group size as the scheme gives it must be -1), and
    other widths are refused; both before the oracle runs."""
    if weights.num_bits == 8 and rules.int8_channelwise_only and weights.group_size != -1:
        raise vllm_error("moe_method", "AssertionError", "", quantization=name)
    if rules.ct_moe_bits is not None and weights.num_bits not in rules.ct_moe_bits:
        raise vllm_error(
            "moe_method",
            "ValueError",
            "CompressedTensorsWNA16MoEMethod only supports int4 and int8 now.",
            quantization=name,
        )


def ct_moe_method(
    spec: DeploymentSpec,
    name: str,
    scheme_map: Mapping[str, CtScheme],
    rules: IntegrationRules,
) -> MoEMethodPlan:
    """`CompressedTensorsMoEMethod.get_moe_method` for the layer, and what the WNA16 method's
    constructor does up to and after its oracle call; `rules` holds what the release does
    differently. Act-order (group or dynamic, only where a release still accepts it) keeps
    Marlin's strict tile shape; the non-Marlin kernels assert channel-wise scales and group
    act-order away after the oracle chose them.
    """
    config = spec.hf_quantization_config
    layer = spec.layer.name
    schemes = [
        _ct_scheme_for(config, scheme_map, f"{layer}.0.{proj}")
        for proj in ("gate_proj", "up_proj", "down_proj")
    ]
    if any(s != schemes[0] for s in schemes):
        raise vllm_error(
            "moe_method",
            "ValueError",
            "All MoE projections need to have same quantization scheme but found multiple",
            quantization=name,
        )
    scheme = schemes[0]
    if scheme is None or scheme.weights is None:
        return left_unquantized(
            name, layer, "the ignore list or no config group with weights covers it"
        )
    weights = scheme.weights
    if weights.strategy not in ("channel", "group") or scheme.has_input_quant or weights.dynamic:
        raise InvalidSpecError.single(
            "hf_quantization_config.config_groups",
            "the MoE layer's scheme is not weight-only int with group or channel scales "
            "(WNA16); other compressed-tensors schemes do not use the WNA16 oracle",
        )
    if weights.num_bits not in SYMMETRIC_TYPES or scheme.format != "pack-quantized":
        raise vllm_error(
            "moe_method",
            "ValueError",
            _format_error(weights.num_bits, rules),
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
        return OtherMethod(
            name,
            "CompressedTensorsW4A16FlydslMoEMethod",
            "--moe-backend flydsl on gfx950 builds the FlyDSL W4A16 MoE method, which does "
            "not go through the WNA16 backend selection",
        )
    bits = weights.num_bits
    if not weights.symmetric and bits not in rules.ct_zero_point_bits:
        # The constructor looks the zero-point type up by bit width, unguarded.
        raise vllm_error("moe_method", "KeyError", str(bits), quantization=name)
    dtype = SYMMETRIC_TYPES[bits] if weights.symmetric else ASYMMETRIC_TYPES[bits]
    _check_legacy_widths(weights, rules, name)
    if bits == 4:
        shape = (1, 32) if group_size == 32 else PER_TOKEN
    elif bits == 8:
        shape = PER_TOKEN
    else:
        shape = PER_CHANNEL if group_size == -1 else (1, group_size)
    key = QuantKey(dtype, shape, weights.symmetric)
    # vLLM asks this before the FlyDSL check above, which only gfx950 passes.
    gfx1100_method = _rocm_gfx1100_method(spec, weights, rules)
    is_actorder = weights.strategy == "group" and weights.actorder in ("group", "dynamic")

    def after(backend: str) -> None:
        if backend in ("MARLIN", "BATCHED_MARLIN"):
            marlin_input_dtype_check(platform, name)
        elif weights.strategy != "group" or weights.actorder == "group":
            raise vllm_error("moe_method", "AssertionError", "", quantization=name)
        elif rules.ct_non_marlin_symmetric_only and not weights.symmetric:
            raise vllm_error(
                "moe_method",
                "AssertionError",
                "Only symmetric quantization is supported for MoE",
                quantization=name,
            )

    return OracleCall(
        name,
        gfx1100_method or "CompressedTensorsWNA16MoEMethod",
        key,
        weights,
        not weights.symmetric,
        False,
        not is_actorder,
        after,
        eplb_backends=frozenset({"TRITON"}),
    )


def parse_scheme_map(
    config: Mapping[str, Any], name: str, rules: IntegrationRules
) -> dict[str, CtScheme]:
    """`CompressedTensorsConfig.from_config`: the target -> scheme map, parsed once.

    Group and dynamic act-order are refused here, as vLLM refuses them while parsing
    (releases that still support act-order keep them); a `Linear` target also stands for
    the fused `RoutedExperts` module, as in vLLM.
    """
    groups = config.get("config_groups") or {}
    if not isinstance(groups, Mapping):
        raise InvalidSpecError.single(
            "hf_quantization_config.config_groups", "must map group names to schemes"
        )
    top_format = config.get("format")
    schemes: dict[str, CtScheme] = {}
    for group_name, group in groups.items():
        path = f"hf_quantization_config.config_groups.{group_name}"
        if not isinstance(group, Mapping) or not isinstance(group.get("targets"), list):
            raise InvalidSpecError.single(path, "needs a 'targets' list and 'weights'")
        targets = group["targets"]
        if len(targets) == 1 and str(targets[0]).endswith("Attention"):
            continue
        weights = group.get("weights")
        args = _parse_weight_args(weights, f"{path}.weights") if weights is not None else None
        act_order = None if args is None else args.actorder
        if act_order in ("group", "dynamic") and not rules.act_order_supported:
            raise vllm_error(
                "quantization",
                "ValueError",
                "Compressed-tensors group/dynamic activation ordering "
                f"(actorder={act_order!r}) is no longer supported. Use a checkpoint with "
                "static/weight activation ordering or without activation ordering.",
                quantization=name,
            )
        scheme = CtScheme(
            args, group.get("input_activations") is not None, group.get("format") or top_format
        )
        for target in targets:
            schemes[target] = scheme
    if "Linear" in schemes and "RoutedExperts" not in schemes:
        schemes["RoutedExperts"] = schemes["Linear"]
    return schemes
