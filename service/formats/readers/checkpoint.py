"""Per-expert checkpoint tensors and vLLM's stacked layer parameters <-> canonical layers.

Two spellings of the same data reach us:

* Hugging Face checkpoints store each expert's projections separately, under the experts
  module: ``"<e>.gate_proj.qweight"``, ``"<e>.up_proj.scales"``, ``"<e>.down_proj.g_idx"``
  (Qwen-MoE / DeepSeek), or Mixtral's ``"<e>.w1.qweight"`` (gate), ``w3`` (up), ``w2`` (down).
  Non-gated experts have only ``up_proj``/``down_proj`` (``w1``/``w2``).
* vLLM's integrations stack them into layer parameters (``w13_qweight``, ``w2_scales``,
  ``w13_weight_packed``...) with gate rows before up rows along N: the form
  `convert_to_wna16_moe_kernel_format` consumes, and the one the exactness tests feed to vLLM.

Both are read into the same `QuantizedMoELayer`, and both can be written back from one
(tests build synthetic checkpoints that way).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from service.formats.canonical import QuantizedExperts, QuantizedMoELayer
from service.formats.errors import FormatError
from service.formats.readers.layouts import Role, SourceLayout, SourceQuantization

NAMINGS: Mapping[str, Mapping[bool, tuple[str, ...]]] = {
    # naming -> gated -> projections in w13 order, then the w2 projection
    "hf": {True: ("gate_proj", "up_proj", "down_proj"), False: ("up_proj", "down_proj")},
    "mixtral": {True: ("w1", "w3", "w2"), False: ("w1", "w2")},
}
_KEY = re.compile(r"^(\d+)\.([A-Za-z0-9_]+)\.([A-Za-z0-9_]+)$")


# -- per-expert checkpoints ---------------------------------------------------------------


def read_checkpoint(
    layout: SourceLayout,
    tensors: Mapping[str, torch.Tensor],
    quant: SourceQuantization,
    *,
    num_experts: int,
    gated: bool = True,
) -> QuantizedMoELayer:
    """Per-expert tensors (names relative to the experts module) -> canonical layer."""
    if num_experts <= 0:
        raise FormatError("num_experts", f"must be positive, got {num_experts}")
    found: dict[str, dict[Role, dict[int, torch.Tensor]]] = {}
    naming = None
    known = {p for names in NAMINGS.values() for p in names[gated]}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise FormatError(key, "not a per-expert name '<expert>.<projection>.<tensor>'")
        expert, projection, suffix = int(match[1]), match[2], match[3]
        if projection not in known:
            raise FormatError(
                key, f"unknown projection {projection!r}; expected one of {sorted(known)}"
            )
        style = next(n for n, names in NAMINGS.items() if projection in names[gated])
        if naming is not None and style != naming:
            raise FormatError(key, f"mixes {style} and {naming} projection names")
        naming = style
        role = layout.role_of(suffix)
        if role is None:
            expected = sorted(layout.names.values())
            raise FormatError(key, f"unknown tensor for {layout.name}; expected one of {expected}")
        if expert >= num_experts:
            raise FormatError(key, f"expert {expert} out of range for {num_experts} experts")
        found.setdefault(projection, {}).setdefault(role, {})[expert] = tensor
    if naming is None:
        raise FormatError("tensors", "no expert tensors given")
    projections = NAMINGS[naming][gated]
    decoded = [
        _read_projection(layout, found.get(p, {}), quant, p, num_experts) for p in projections
    ]
    w13 = _fuse(decoded[0], decoded[1], projections[1]) if gated else decoded[0]
    return QuantizedMoELayer(w13=w13, w2=decoded[-1])


def _read_projection(
    layout: SourceLayout,
    by_role: Mapping[Role, Mapping[int, torch.Tensor]],
    quant: SourceQuantization,
    projection: str,
    num_experts: int,
) -> QuantizedExperts:
    def key(role: Role, expert: int = 0) -> str:
        return f"{expert}.{projection}.{layout.names[role]}"

    for role in _required(layout, quant):
        if role not in by_role:
            raise FormatError(key(role), "missing")
    for role, experts in by_role.items():
        for expert in range(num_experts):
            if expert not in experts:
                raise FormatError(key(role, expert), "missing (other experts have it)")
    weight0 = by_role["weight"][0]
    n, k = layout.dims_from_weight(tuple(weight0.shape), quant.bits, key("weight"))
    scales0 = by_role["scales"][0]
    groups = int(scales0.shape[layout.scales.index("G")]) if scales0.dim() == 2 else -1
    dims = {"N": n, "K": k, "G": groups}
    stacked: dict[Role, torch.Tensor] = {}
    for role, experts in by_role.items():
        for expert, tensor in experts.items():
            layout.check(role, tensor, dims, quant.bits, key(role, expert))
            if role == "shape" and [int(v) for v in tensor.tolist()] != [n, k]:
                raise FormatError(
                    key(role, expert), f"says {tensor.tolist()}, the tensors are {[n, k]}"
                )
        if role == "shape":
            continue
        stacked[role] = torch.stack([experts[e] for e in range(num_experts)])
    fields = {role: f"{projection}.{layout.names[role]}" for role in layout.roles}
    return layout.decode(stacked, quant, fields)


def _required(layout: SourceLayout, quant: SourceQuantization) -> tuple[Role, ...]:
    roles: list[Role] = ["weight", "scales"]
    if not quant.symmetric:
        roles.append("zeros")
    if quant.desc_act and "g_idx" in layout.names:
        roles.append("g_idx")
    return tuple(roles)


def write_checkpoint(
    layout: SourceLayout,
    layer: QuantizedMoELayer,
    quant: SourceQuantization,
    *,
    naming: str = "hf",
    gated: bool = True,
) -> dict[str, torch.Tensor]:
    """Canonical layer -> per-expert checkpoint tensors (names relative to the experts module)."""
    if naming not in NAMINGS:
        raise FormatError("naming", f"must be one of {sorted(NAMINGS)}, got {naming!r}")
    projections = NAMINGS[naming][gated]
    if gated:
        if layer.w13.n % 2:
            raise FormatError("w13", f"gated w13 needs an even N, got {layer.w13.n}")
        half = layer.w13.n // 2
        parts = [_rows(layer.w13, 0, half), _rows(layer.w13, half, layer.w13.n), layer.w2]
    else:
        parts = [layer.w13, layer.w2]
    out: dict[str, torch.Tensor] = {}
    for projection, experts in zip(projections, parts, strict=True):
        encoded = layout.encode(experts, quant)
        for expert in range(experts.num_experts):
            for role, tensor in encoded.items():
                out[f"{expert}.{projection}.{layout.names[role]}"] = tensor[expert].contiguous()
    return out


def pack_projection(
    layout: SourceLayout, experts: QuantizedExperts, quant: SourceQuantization
) -> dict[str, torch.Tensor]:
    """One expert's projection -> its checkpoint tensors, by their names in `layout`."""
    if experts.num_experts != 1:
        raise FormatError("codes", f"pack one expert at a time, got {experts.num_experts}")
    encoded = layout.encode(experts, quant)
    return {layout.names[role]: tensor[0].contiguous() for role, tensor in encoded.items()}


# -- vLLM's stacked layer parameters ------------------------------------------------------


def read_stacked(
    layout: SourceLayout,
    params: Mapping[str, torch.Tensor],
    quant: SourceQuantization,
) -> QuantizedMoELayer:
    """vLLM layer parameters (``w13_qweight``, ``w2_scales``...) -> canonical layer.

    Names are ``w13_`` or ``w2_`` followed by the layout's per-expert tensor name; w13 holds
    gate rows then up rows (or only up rows when not gated), as vLLM's loader writes them.
    """
    by_stem: dict[str, dict[Role, torch.Tensor]] = {"w13": {}, "w2": {}}
    for name, tensor in params.items():
        stem, _, suffix = name.partition("_")
        role = layout.role_of(suffix)
        if stem not in by_stem or role is None:
            expected = sorted(f"{s}_{n}" for s in by_stem for n in layout.names.values())
            raise FormatError(name, f"unknown parameter for {layout.name}; expected {expected}")
        by_stem[stem][role] = tensor
    decoded = [_read_stacked_projection(layout, by_stem[s], quant, s) for s in ("w13", "w2")]
    return QuantizedMoELayer(w13=decoded[0], w2=decoded[1])


def _read_stacked_projection(
    layout: SourceLayout,
    by_role: Mapping[Role, torch.Tensor],
    quant: SourceQuantization,
    stem: str,
) -> QuantizedExperts:
    fields = {role: f"{stem}_{layout.names[role]}" for role in layout.roles}
    for role in _required(layout, quant):
        if role not in by_role:
            raise FormatError(fields[role], "missing")
    weight = by_role["weight"]
    if weight.dim() != 3:
        raise FormatError(fields["weight"], f"must be [E, ., .], got {list(weight.shape)}")
    batch = int(weight.shape[0])
    n, k = layout.dims_from_weight(tuple(weight.shape[1:]), quant.bits, fields["weight"])
    scales = by_role["scales"]
    groups = int(scales.shape[1 + layout.scales.index("G")]) if scales.dim() == 3 else -1
    dims = {"N": n, "K": k, "G": groups}
    parts: dict[Role, torch.Tensor] = {}
    for role, tensor in by_role.items():
        layout.check(role, tensor, dims, quant.bits, fields[role], batch=batch)
        if role != "shape":  # vLLM keeps the last loaded shard's shape there: not checkable
            parts[role] = tensor
    return layout.decode(parts, quant, fields)


def write_stacked(
    layout: SourceLayout, layer: QuantizedMoELayer, quant: SourceQuantization
) -> dict[str, torch.Tensor]:
    """Canonical layer -> vLLM's stacked layer parameters for this layout."""
    out: dict[str, torch.Tensor] = {}
    for stem, experts in (("w13", layer.w13), ("w2", layer.w2)):
        for role, tensor in layout.encode(experts, quant).items():
            if role != "shape":
                out[f"{stem}_{layout.names[role]}"] = tensor
    return out


# -- canonical helpers --------------------------------------------------------------------


def _rows(experts: QuantizedExperts, start: int, stop: int) -> QuantizedExperts:
    """Output rows [start, stop) of every expert (gate or up half of w13)."""
    return QuantizedExperts(
        codes=experts.codes[:, start:stop].contiguous(),
        scales=experts.scales[:, start:stop].contiguous(),
        bits=experts.bits,
        group_size=experts.group_size,
        zeros=None if experts.zeros is None else experts.zeros[:, start:stop].contiguous(),
        g_idx=experts.g_idx,
        bias=None if experts.bias is None else experts.bias[:, start:stop].contiguous(),
    )


def _fuse(gate: QuantizedExperts, up: QuantizedExperts, up_name: str) -> QuantizedExperts:
    """Gate rows over up rows, vLLM's w13 order; they must share K, groups and act order."""
    if (gate.k, gate.num_groups) != (up.k, up.num_groups):
        raise FormatError(up_name, "K or group count differs from the gate projection")
    if gate.scales.dtype != up.scales.dtype:
        raise FormatError(f"{up_name}.scales", "dtype differs from the gate projection")
    if (gate.zeros is None) != (up.zeros is None):
        raise FormatError(f"{up_name}.zeros", "present in only one of gate and up")
    if (gate.bias is None) != (up.bias is None):
        raise FormatError(f"{up_name}.bias", "present in only one of gate and up")
    if (gate.g_idx is None) != (up.g_idx is None) or (
        gate.g_idx is not None and up.g_idx is not None and not torch.equal(gate.g_idx, up.g_idx)
    ):
        raise FormatError(
            f"{up_name}.g_idx", "differs from the gate projection's (w13 has one act order)"
        )

    def cat(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
        return None if a is None or b is None else torch.cat((a, b), dim=1).contiguous()

    codes = cat(gate.codes, up.codes)
    scales = cat(gate.scales, up.scales)
    assert codes is not None and scales is not None
    return QuantizedExperts(
        codes=codes,
        scales=scales,
        bits=gate.bits,
        group_size=gate.group_size,
        zeros=cat(gate.zeros, up.zeros),
        g_idx=gate.g_idx,
        bias=cat(gate.bias, up.bias),
    )
