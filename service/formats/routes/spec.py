"""What a conversion reads and what it writes, decided before any tensor moves (torch-free).

The server process decides this, so bad requests fail before a byte is streamed, and the
oracle (pure Python) answers `auto` with the converting worker's own platform; the worker
then only does the heavy lifting. The local CLI uses the same functions.

* `source_spec`: the checkpoint's `quantization_config` (Hugging Face form) -> the source
  layout and its quantization facts (bits, group size, symmetry, act-order, GPTQ v1/v2,
  Quark's pack method).
* `resolve_target`: the requested backend, or the oracle's choice for the platform.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from service.formats.errors import ConvertInputError
from service.oracle import DEFAULT_RULESET, Decision, DeploymentSpec, select
from service.oracle.rulesets import get_ruleset

#: The layouts vLLM's integrations hand to `convert_to_wna16_moe_kernel_format`.
SOURCE_LAYOUTS = (
    "gptq",
    "awq",
    "compressed-tensors",
    "moe_wna16",
    "quark",
    "quark-order",
    "quark-loaded",
)
#: AMD Quark's export `pack_method` -> its checkpoint layout.
_QUARK_LAYOUTS = {"reorder": "quark", "order": "quark-order"}
_AUTO = ("", "AUTO")


@dataclass(frozen=True, slots=True)
class SourceSpec:
    """A checkpoint layout and the quantization of its expert weights."""

    layout: str
    bits: int
    group_size: int
    symmetric: bool = True
    desc_act: bool = False
    gptq_v2: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> SourceSpec:
        return cls(
            layout=str(obj["layout"]),
            bits=int(obj["bits"]),
            group_size=int(obj["group_size"]),
            symmetric=bool(obj.get("symmetric", True)),
            desc_act=bool(obj.get("desc_act", False)),
            gptq_v2=bool(obj.get("gptq_v2", False)),
        )


def _get(config: Mapping[str, Any], keys: tuple[str, ...], kind: type, field: str) -> Any:
    for key in keys:
        if key in config and config[key] is not None:
            value = config[key]
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConvertInputError(f"{field}.{key}", f"must be an integer, got {value!r}")
            if kind is bool and not isinstance(value, bool):
                raise ConvertInputError(f"{field}.{key}", f"must be true or false, got {value!r}")
            return value
    raise ConvertInputError(f"{field}.{keys[0]}", "required")


def _opt(config: Mapping[str, Any], key: str, kind: type, default: Any, field: str) -> Any:
    if config.get(key) is None:
        return default
    return _get(config, (key,), kind, field)


def _gptq(config: Mapping[str, Any], field: str) -> SourceSpec:
    group = _get(config, ("group_size",), int, field)
    desc_act = _opt(config, "desc_act", bool, False, field) and group != -1
    return SourceSpec(
        layout="gptq",
        bits=_get(config, ("bits",), int, field),
        group_size=group,
        symmetric=_opt(config, "sym", bool, True, field),
        desc_act=desc_act,
        gptq_v2=config.get("checkpoint_format") == "gptq_v2",
    )


def _awq(config: Mapping[str, Any], field: str) -> SourceSpec:
    return SourceSpec(
        layout="awq",
        bits=_get(config, ("w_bit", "bits"), int, field),
        group_size=_get(config, ("q_group_size", "group_size"), int, field),
        symmetric=not _opt(config, "zero_point", bool, True, field),
    )


def _compressed_tensors(config: Mapping[str, Any], field: str) -> SourceSpec:
    groups = config.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ConvertInputError(f"{field}.config_groups", "required: at least one config group")
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, Mapping) else None
        if not isinstance(weights, Mapping):
            continue
        path = f"{field}.config_groups.{name}.weights"
        fmt = group.get("format") or config.get("format")
        if fmt not in (None, "pack-quantized"):
            raise ConvertInputError(
                f"{field}.format", f"only pack-quantized integer weights convert, got {fmt!r}"
            )
        if weights.get("type", "int") != "int":
            raise ConvertInputError(f"{path}.type", "only integer weights convert")
        strategy = weights.get("strategy")
        group_size = -1 if strategy == "channel" else _get(weights, ("group_size",), int, path)
        actorder = weights.get("actorder")
        return SourceSpec(
            layout="compressed-tensors",
            bits=_get(weights, ("num_bits",), int, path),
            group_size=group_size,
            symmetric=_opt(weights, "symmetric", bool, True, path),
            desc_act=actorder == "group" and group_size != -1,
        )
    raise ConvertInputError(f"{field}.config_groups", "no group quantizes weights")


def _quark_weight(config: Mapping[str, Any], field: str) -> tuple[Mapping[str, Any], str]:
    """The routed experts' weight scheme: the global one, else a `layer_quant_config`
    entry naming experts (an export that quantizes the experts only)."""
    found = (config.get("global_quant_config") or {}).get("weight")
    path = f"{field}.global_quant_config.weight"
    if found is None:
        for pattern, layer in (config.get("layer_quant_config") or {}).items():
            if "experts" in str(pattern) and isinstance(layer, Mapping):
                found, path = layer.get("weight"), f"{field}.layer_quant_config.{pattern}.weight"
                break
    if isinstance(found, list) and len(found) == 1:
        found = found[0]
    if not isinstance(found, Mapping):
        raise ConvertInputError(path, "required: an int4 weight scheme for the experts")
    return found, path


def _quark(config: Mapping[str, Any], field: str) -> SourceSpec:
    export = config.get("export")
    pack_method = export.get("pack_method") if isinstance(export, Mapping) else None
    if pack_method not in _QUARK_LAYOUTS:
        raise ConvertInputError(
            f"{field}.export.pack_method", f"must be one of {sorted(_QUARK_LAYOUTS)}"
        )
    weight, path = _quark_weight(config, field)
    if weight.get("dtype") not in ("int4", "uint4"):
        raise ConvertInputError(f"{path}.dtype", "only int4/uint4 weight-only schemes convert")
    return SourceSpec(
        layout=_QUARK_LAYOUTS[pack_method],
        bits=4,
        group_size=_get(weight, ("group_size",), int, path),
        symmetric=_get(weight, ("symmetric",), bool, path),
    )


_PARSERS = {
    "gptq": _gptq,
    "awq": _awq,
    "awq_marlin": _awq,
    "compressed-tensors": _compressed_tensors,
    "quark": _quark,
}


def source_spec(
    hf_config: Mapping[str, Any],
    *,
    quantization: str | None = None,
    stacked: bool = False,
    field: str = "hf_quantization_config",
) -> SourceSpec:
    """The source layout of a checkpoint with this `quantization_config`.

    `stacked`: the tensors are vLLM's stacked layer parameters rather than per-expert
    checkpoint tensors; under `--quantization moe_wna16` those are MoeWNA16's N-first bytes.
    """
    method = str(hf_config.get("quant_method", "")).lower()
    parser = _PARSERS.get(method)
    if parser is None:
        raise ConvertInputError(
            f"{field}.quant_method",
            f"cannot convert {method or 'an unquantized'!r} checkpoints; one of {sorted(_PARSERS)}",
        )
    spec = parser(hf_config, field)
    if spec.bits not in (4, 8):
        raise ConvertInputError(f"{field}.bits", f"must be 4 or 8, got {spec.bits}")
    if stacked and quantization == "moe_wna16":
        spec = SourceSpec(
            "moe_wna16", spec.bits, spec.group_size, spec.symmetric, False, spec.gptq_v2
        )
    elif stacked and method == "quark":
        # vLLM's Quark loader has already unpacked either export into its N-first bytes.
        spec = SourceSpec("quark-loaded", spec.bits, spec.group_size, spec.symmetric)
    return spec


@dataclass(frozen=True, slots=True)
class Target:
    """The kernel layout a conversion writes."""

    backend: str
    experts_class: str
    ruleset: str
    #: "request" (the caller named it) or "oracle" (vLLM's choice for the platform).
    chosen_by: str
    decision: Decision | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "experts_class": self.experts_class,
            "ruleset": self.ruleset,
            "chosen_by": self.chosen_by,
        }


def resolve_target(
    deployment: DeploymentSpec,
    requested: str = "",
    *,
    ruleset: str = "",
    field: str = "target_backend",
) -> Target:
    """The requested backend (checked to be one of the ruleset's: `ruleset`, else the
    spec's own, else the newest), or, for `""`/`auto`,
    the one the oracle selects for the deployment's platform (`SelectionError` when vLLM
    would select none)."""
    rules = get_ruleset(ruleset or deployment.ruleset or DEFAULT_RULESET)
    name = requested.strip().upper()
    if name in _AUTO:
        decision = select(deployment, ruleset=rules.name)
        if decision.backend is None:
            raise ConvertInputError(
                "deployment",
                f"vLLM leaves {deployment.layer.name} unquantized ({decision.moe_method}): "
                "there is nothing to convert",
            )
        return Target(
            decision.backend, decision.experts_class or "", rules.name, "oracle", decision
        )
    if name not in rules.backends:
        raise ConvertInputError(
            field, f"unknown backend {requested!r}; one of {list(rules.backends)} or 'auto'"
        )
    classes = rules.experts_classes.get(name, ())
    return Target(name, classes[0].name if len(classes) == 1 else "", rules.name, "request")
