"""Names of MoE expert tensors (torch-free: the server checks names as they arrive).

Checkpoints name each expert's projections under the experts module, per architecture
family; clients of inline conversions may also send names relative to that module, or vLLM's
stacked layer parameters. `classify` says which a name is, `normalize_names` turns a layer's
names into what the readers take, and anything else is an unknown tensor name reported with
the field ``tensors[<name>].name``.
"""

from __future__ import annotations

import re

from service.formats.errors import ConvertInputError

#: MoE expert tensor names, per architecture family: the experts module (the fused layer's
#: prefix), the decoder layer index and the name relative to the experts module, in the
#: form the readers take ("<expert>.<projection>.<tensor>").
EXPERT_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "mixtral",  # Mixtral, PhiMoE: block_sparse_moe.experts.N.w1/w2/w3
        re.compile(
            r"^(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.block_sparse_moe\.experts)\."
            r"(?P<key>\d+\.(?:w1|w2|w3)\.[A-Za-z0-9_]+)$"
        ),
    ),
    (
        "hf",  # Qwen2-MoE, Qwen3-MoE, DeepSeek V2/V3, OLMoE...: mlp.experts.N.*_proj
        re.compile(
            r"^(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.mlp\.experts)\."
            r"(?P<key>\d+\.(?:gate_proj|up_proj|down_proj)\.[A-Za-z0-9_]+)$"
        ),
    ),
)
EXPERT_INDEX = re.compile(r"^(\d+)\.")
_STACKED = re.compile(r"^(?:(?P<module>.+)\.)?(?P<key>(?:w13|w2)_[A-Za-z0-9_]+)$")
_RELATIVE = re.compile(r"^\d+\.[A-Za-z0-9_]+\.[A-Za-z0-9_]+$")


def match_expert_tensor(name: str) -> tuple[str, str, int, str] | None:
    """(family, experts module, layer index, relative name) of an expert tensor, else None."""
    for family, pattern in EXPERT_PATTERNS:
        match = pattern.match(name)
        if match is not None:
            return family, match["module"], int(match["layer"]), match["key"]
    return None


def normalize_names(names: list[str]) -> tuple[str, str, dict[str, str]]:
    """(naming, module prefix, {given name: name the reader takes}). Naming is "per_expert"
    or "stacked"; the prefix is "" when the names carry none."""
    if not names:
        raise ConvertInputError("tensors", "required: the layer's tensors")
    out: dict[str, str] = {}
    modules: set[str] = set()
    naming = ""
    for name in names:
        kind, module, key = classify(name)
        if naming and kind != naming:
            raise ConvertInputError(
                f"tensors[{name}].name",
                f"mixes {kind} names with {naming} names; use one naming for the whole layer",
            )
        naming = kind
        modules.add(module)
        out[name] = key
    if len(modules) > 1:
        raise ConvertInputError(
            "tensors", f"tensors of several experts modules in one layer: {sorted(modules)}"
        )
    return naming, modules.pop(), out


def classify(name: str) -> tuple[str, str, str]:
    """(naming, experts module or "", name the reader takes) of one tensor name."""
    if _RELATIVE.match(name):
        return "per_expert", "", name
    hit = match_expert_tensor(name)
    if hit is not None:
        return "per_expert", hit[1], hit[3]
    stacked = _STACKED.match(name)
    if stacked is not None:
        return "stacked", stacked["module"] or "", stacked["key"]
    raise ConvertInputError(
        f"tensors[{name}].name",
        "not an expert tensor name: expected '<expert>.<gate_proj|up_proj|down_proj|w1|w2|w3>."
        "<tensor>' (optionally under '...layers.N.mlp.experts.' or "
        "'...block_sparse_moe.experts.') or vLLM's stacked 'w13_<tensor>' / 'w2_<tensor>'",
    )
