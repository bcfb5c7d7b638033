"""AMD Quark: the config vLLM parses and the MoE method its routed-experts layers get.

`QuarkConfig.from_config` keeps the whole `quantization_config` and reads the `export` block
(its `kv_cache_group` and `pack_method`); a routed-experts layer then goes through the
`exclude` list (all-or-nothing for MoE children), finds its layer config
(`layer_quant_config` patterns, then `layer_type_quant_config`, then `global_quant_config`)
and builds one of Quark's MoE methods. Only `QuarkW4A16Int4MoEMethod` (int4/uint4 weights,
no activation quantization, a `pack_method` of "order" or "reorder") calls the WNA16 oracle;
the others (fp8, int8, OCP MX, W4A8, NVFP4) select their backends with other oracles, so a
spec that reaches one is not a WNA16 question and is refused as such. Releases without the
int4 weight-only method (`IntegrationRules.quark_w4a16_moe`) refuse such a layer as vLLM's
`QuarkMoEMethod` does: "Unsupported FusedMoe scheme".

Where vLLM itself fails on a missing key with a bare `TypeError` or `AttributeError`, the
answer is that error, type and text, at the stage vLLM raises it; a key of the wrong JSON
type is a field error naming what Quark accepts.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from typing import Any

from service.oracle.errors import InvalidSpecError
from service.oracle.quant_key import (
    K_INT4_STATIC,
    K_INT4_STATIC_32,
    K_INT4_STATIC_32_ASYM,
    K_INT4_STATIC_ASYM,
)
from service.oracle.quant_method import (
    IntegrationRules,
    MoEMethodPlan,
    OracleCall,
    QuarkConfig,
    left_unquantized,
    vllm_error,
)
from service.oracle.spec import DeploymentSpec

NAME = "quark"
W4A16_METHOD = "QuarkW4A16Int4MoEMethod"
#: The weight dtypes `_is_w4a16_int4` accepts, and the pack methods it needs.
INT4_DTYPES = ("int4", "uint4")
PACK_METHODS = ("order", "reorder")
#: Quark's other MoE methods by the weight dtype that leads to them (each picks its backend
#: with vLLM's fp8, int8 or OCP MX MoE oracle, not the WNA16 one); where vLLM's own checks
#: on the rest of the scheme fail, it raises "Unsupported FusedMoe scheme" instead.
OTHER_METHODS = {
    "fp8_e4m3": "QuarkW8A8Fp8MoEMethod",
    "int8": "QuarkW8A8Int8MoEMethod",
    "fp4": "QuarkOCP_MX_MoEMethod",
    "fp6_e2m3": "QuarkOCP_MX_MoEMethod",
    "fp6_e3m2": "QuarkOCP_MX_MoEMethod",
}
#: The methods that take a two-entry `weight` or `input_tensors` list.
TWO_PART_METHODS = "QuarkW4A8Fp8MoEMethod or QuarkNvfp4MoEMethod"
_UNSUPPORTED = "Unsupported FusedMoe scheme"
_PATH = "hf_quantization_config"


def _none_error(stage: str, type_: str, message: str) -> Exception:
    return vllm_error(stage, type_, message, quantization=NAME)


# --- QuarkConfig.from_config ----------------------------------------------------------------


def _kv_cache_checked(config: Mapping[str, Any], group: list[Any]) -> Mapping[str, Any]:
    """`from_config`'s kv-cache block: the kv-cache layers' configs must exist and agree;
    their `output_tensors` (and `*q_proj`'s) are then cleared. Returns the layer configs
    as vLLM leaves them."""
    layer_configs = config.get("layer_quant_config")
    if layer_configs is None:
        raise _none_error(
            "quantization", "AttributeError", "'NoneType' object has no attribute 'keys'"
        )
    if not isinstance(layer_configs, Mapping):
        raise InvalidSpecError.single(
            f"{_PATH}.layer_quant_config", "must map layer name patterns to layer configs"
        )
    patterns = [str(p) for p in group]
    names = [str(n) for n in layer_configs]
    covered = set(patterns) <= set(names) or any(
        fnmatch.fnmatchcase(name, pattern) for name in names for pattern in patterns
    )
    if not covered:
        raise _none_error(
            "quantization",
            "ValueError",
            "The Quark quantized model has the kv_cache_group parameter setting, but no "
            "kv_cache quantization settings were found in the quantization configuration.",
        )
    kv_names = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    outputs = []
    for name in kv_names:
        layer = layer_configs[name]
        if not isinstance(layer, Mapping):
            raise InvalidSpecError.single(
                f"{_PATH}.layer_quant_config.{name}", "must be a layer config object"
            )
        if "output_tensors" not in layer:
            raise _none_error("quantization", "KeyError", repr("output_tensors"))
        outputs.append(layer["output_tensors"])
    if any(output != outputs[0] for output in outputs):
        raise _none_error(
            "quantization",
            "ValueError",
            "The quantization method used for kv_cache should be the same, but the "
            "quantization method for the kv_cache layer in the config is different.",
        )
    if outputs[0] is None:
        raise _none_error(
            "quantization", "ValueError", "The kv_cache quantization configuration is empty."
        )
    cleared = {*kv_names, "*q_proj"}
    return {
        name: {**layer, "output_tensors": None}
        if name in cleared and isinstance(layer, Mapping)
        else layer
        for name, layer in layer_configs.items()
    }


def parse_quark(config: Mapping[str, Any]) -> tuple[str | None, Mapping[str, Any]]:
    """`QuarkConfig.from_config`: (the export's `pack_method`, the config as vLLM keeps it
    after the kv-cache block)."""
    export = config.get("export")
    if export is None:
        raise _none_error(
            "quantization",
            "ValueError",
            "The export key should be included in the configurations of Quark quantized model",
        )
    if not isinstance(export, Mapping):
        raise InvalidSpecError.single(
            f"{_PATH}.export", "must be an object with kv_cache_group and pack_method"
        )
    group = export.get("kv_cache_group")
    if group is None:
        raise _none_error("quantization", "TypeError", "object of type 'NoneType' has no len()")
    if not isinstance(group, list):
        raise InvalidSpecError.single(
            f"{_PATH}.export.kv_cache_group", "must be a list of layer name patterns ([] for none)"
        )
    pack_method = export.get("pack_method")
    if pack_method is not None and not isinstance(pack_method, str):
        raise InvalidSpecError.single(
            f"{_PATH}.export.pack_method", f"must be one of {list(PACK_METHODS)} or absent"
        )
    if group:
        config = {**config, "layer_quant_config": _kv_cache_checked(config, group)}
    return pack_method, config


# --- the routed-experts layer's config --------------------------------------------------------


def _excluded(config: Mapping[str, Any], layer: str) -> bool:
    """`should_ignore_layer(check_children=True)`: an exact entry, an entry naming a child
    of the layer, or a 're:' regex matching it (from its start)."""
    ignore = config.get("exclude")
    if ignore is None:
        raise _none_error("moe_method", "TypeError", "'NoneType' object is not iterable")
    if not isinstance(ignore, list) or not all(isinstance(e, str) for e in ignore):
        raise InvalidSpecError.single(f"{_PATH}.exclude", "must be a list of layer names")
    for target in ignore:
        if target.startswith("re:"):
            if re.match(target[3:], layer):
                return True
        elif target == layer or target.startswith(layer + "."):
            return True
    return False


def _mapping_or_none(config: Mapping[str, Any], key: str) -> Mapping[str, Any] | None:
    value = config.get(key)
    if value is not None and not isinstance(value, Mapping):
        raise InvalidSpecError.single(f"{_PATH}.{key}", "must be an object")
    return value


#: Where a layer's config came from (a field path) and the config (None: vLLM has none).
Matched = tuple[str, Any]


def _layer_pattern_config(layer_configs: Mapping[str, Any], layer: str) -> Matched | None:
    """`get_layer_quant_config_from_name`: the first pattern that matches, in order; a
    pattern without '*' matches when the layer's name is part of it."""
    for pattern, layer_config in layer_configs.items():
        matches = layer in pattern if "*" not in pattern else fnmatch.fnmatch(layer, pattern)
        if matches:
            return f"{_PATH}.layer_quant_config.{pattern}", layer_config
    return None


def _matched_config(config: Mapping[str, Any], layer: str, rules: IntegrationRules) -> Matched:
    """`_find_matched_config` for the MoE layer: a `layer_quant_config` pattern, else
    `layer_type_quant_config` (keyed by layer classes, which JSON keys never are), else
    `global_quant_config`. Releases before 0.29 walk `layer_quant_config` unguarded and ask
    the type table only when no pattern matched; later ones ask it first."""
    layer_configs = _mapping_or_none(config, "layer_quant_config")
    by_type = _mapping_or_none(config, "layer_type_quant_config")
    if rules.quark_legacy_config_lookup:
        if layer_configs is None:
            raise _none_error(
                "moe_method", "AttributeError", "'NoneType' object has no attribute 'items'"
            )
        found = _layer_pattern_config(layer_configs, layer)
        if found is not None:
            return found
        if by_type is None:
            raise _none_error(
                "moe_method", "TypeError", "argument of type 'NoneType' is not iterable"
            )
    else:
        if by_type is None:
            raise _none_error(
                "moe_method", "AttributeError", "'NoneType' object has no attribute 'get'"
            )
        found = _layer_pattern_config(layer_configs or {}, layer)
        if found is not None:
            return found
    return f"{_PATH}.global_quant_config", _mapping_or_none(config, "global_quant_config")


def _single(value: Any) -> Any:
    """`_unwrap_single_quant_config`: a one-entry list is its entry, an empty one None."""
    if isinstance(value, list):
        return value[0] if len(value) == 1 else None
    return value


def _positive_group_and_symmetry(weight: Mapping[str, Any]) -> tuple[int, bool]:
    """`parse_w4a16_int4_weight_config`, with vLLM's errors."""
    for key in ("group_size", "symmetric"):
        if key not in weight:
            raise _none_error(
                "moe_method",
                "ValueError",
                f"Quark W4A16 INT4/UINT4 configs must specify weight.{key}",
            )
    group_size, symmetric = weight["group_size"], weight["symmetric"]
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise _none_error(
            "moe_method",
            "ValueError",
            f"Quark W4A16 weight.group_size must be a positive int, got {_py(group_size)}",
        )
    if not isinstance(symmetric, bool):
        raise _none_error(
            "moe_method",
            "ValueError",
            f"Quark W4A16 weight.symmetric must be a bool, got {_py(symmetric)}",
        )
    return group_size, symmetric


def _py(value: Any) -> str:
    """`repr` of a JSON value as Python spells it (vLLM's `{value!r}`)."""
    return repr(value)


def _other_method(weight: Any, inputs: Any) -> str | None:
    """The non-WNA16 Quark method a scheme leads to, by its weight dtype (None: none)."""
    if (isinstance(weight, list) and len(weight) > 1) or (
        isinstance(inputs, list) and len(inputs) > 1
    ):
        return TWO_PART_METHODS
    single = _single(weight)
    if isinstance(single, Mapping):
        return OTHER_METHODS.get(str(single.get("dtype")))
    return None


def quark_moe_method(
    spec: DeploymentSpec,
    pack_method: str | None,
    config: Mapping[str, Any],
    rules: IntegrationRules,
) -> MoEMethodPlan:
    """`QuarkConfig.get_quant_method` for the routed-experts layer, up to the oracle call
    `QuarkW4A16Int4MoEMethod`'s constructor makes."""
    layer = spec.layer.name
    if _excluded(config, layer):
        return left_unquantized(NAME, layer, "it matches the exclude list")
    path, layer_config = _matched_config(config, layer, rules)
    if layer_config is None:
        raise _none_error(
            "moe_method", "AttributeError", "'NoneType' object has no attribute 'get'"
        )
    if not isinstance(layer_config, Mapping):
        raise InvalidSpecError.single(path, "must be a layer config object")
    if layer_config.get("output_tensors") or layer_config.get("bias"):
        raise _none_error(
            "moe_method",
            "NotImplementedError",
            "Currently, Quark models with output_tensors and bias quantized are not supported",
        )
    weight, inputs = layer_config.get("weight"), layer_config.get("input_tensors")
    if not rules.quark_unwraps_single_configs and isinstance(weight, list) and len(weight) != 2:
        raise _none_error("moe_method", "AttributeError", "'list' object has no attribute 'get'")
    other = _other_method(weight, inputs)
    if other is not None:
        raise InvalidSpecError.single(
            path,
            f"the MoE layer's Quark scheme is not int4 weight-only (W4A16): vLLM builds "
            f"{other} for it (where Quark accepts the rest of the scheme), which selects its "
            "backend with another MoE oracle, not the WNA16 one; the WNA16 scheme is weight "
            f"dtype one of {list(INT4_DTYPES)}, input_tensors null and export.pack_method one "
            f"of {list(PACK_METHODS)}",
        )
    weight, inputs = _single(weight), _single(inputs)
    is_w4a16 = (
        isinstance(weight, Mapping)
        and inputs is None
        and weight.get("dtype") in INT4_DTYPES
        and pack_method in PACK_METHODS
    )
    if not is_w4a16 or not rules.quark_w4a16_moe:
        raise _none_error("moe_method", "RuntimeError", _UNSUPPORTED)
    assert isinstance(weight, Mapping)
    group_size, symmetric = _positive_group_and_symmetry(weight)
    if symmetric:
        key = K_INT4_STATIC_32 if group_size == 32 else K_INT4_STATIC
    else:
        key = K_INT4_STATIC_32_ASYM if group_size == 32 else K_INT4_STATIC_ASYM
    parsed = QuarkConfig(str(pack_method), str(weight["dtype"]), group_size, symmetric)
    return OracleCall(NAME, W4A16_METHOD, key, parsed, not symmetric, False, False)
