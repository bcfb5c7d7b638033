"""Reading a layer for a direct route: per-expert checkpoint tensors -> `PackedLayer`.

The same checks as the canonical reader, with the weights left packed: the uniform case
(`uniform_read`) first, and otherwise the general way, projection by projection, which
accepts exactly what the canonical reader accepts (and on anything else raises a
`FormatError`; the caller then lets the canonical reader word the error).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping

import torch

from service.formats.errors import FormatError
from service.formats.readers.checkpoint import NAMINGS
from service.formats.readers.layouts import (
    Role,
    SourceLayout,
    SourceQuantization,
    check_groups,
    decode_g_idx,
    to_canonical,
    unpack_as,
)
from service.formats.routes.packed import PackedLayer, PackedProjection
from service.formats.routes.uniform_read import midpoint_word, read_uniform

__all__ = ["read_packed"]


_KEY = re.compile(r"^(\d+)\.([A-Za-z0-9_]+)\.([A-Za-z0-9_]+)$")


_STYLES = {
    gated: {p: style for style, names in list(NAMINGS.items())[::-1] for p in names[gated]}
    for gated in (True, False)
}
"""gated -> projection name -> its naming style (the first naming that lists it wins)."""


def read_packed(
    layout: SourceLayout,
    tensors: Mapping[str, torch.Tensor],
    quant: SourceQuantization,
    *,
    num_experts: int,
    gated: bool = True,
    deferred: list[Callable[[], bool]] | None = None,
) -> PackedLayer:
    """Per-expert checkpoint tensors -> `PackedLayer`; FormatError on anything the
    canonical reader would refuse (the caller then lets that reader word the error).

    `deferred` (a list): on a device in `DEFER_DEVICES`, the uniform read's content checks
    (GPTQ's zero points and g_idx, checked on the device) are not waited for here but
    appended as one callable whose answer (one host sync) says whether they held; the
    caller writes the weights first (their kernels queued before the sync, so the GPU is not
    left waiting on the host's check ops) and, on False, must read the layer again without
    `deferred`, which then takes the general path (accepting the layer or raising as it
    always did)."""
    if num_experts <= 0:
        raise FormatError("num_experts", f"must be positive, got {num_experts}")
    found: dict[str, dict[Role, dict[int, torch.Tensor]]] = {}
    naming, places = _parse_keys(tuple(tensors), tuple(layout.names.items()), gated, num_experts)
    for (projection, role, expert), tensor in zip(places, tensors.values(), strict=True):
        found.setdefault(projection, {}).setdefault(role, {})[expert] = tensor
    projections = NAMINGS[naming][gated]
    by_projection = [found.get(p, {}) for p in projections]
    uniform = read_uniform(layout, by_projection, quant, num_experts, deferred)
    if uniform is not None:
        return uniform
    read = [_projection(layout, found.get(p, {}), quant, p, num_experts) for p in projections]
    w13 = _fuse(read[0], read[1]) if gated else read[0]
    w2 = read[-1]
    if w13.k != w2.n or (w13.zeros is None) != (w2.zeros is None):
        raise FormatError("w2", "does not match w13")
    return PackedLayer(layout, w13, w2)


@functools.lru_cache(maxsize=64)
def _parse_keys(
    keys: tuple[str, ...], names: tuple[tuple[Role, str], ...], gated: bool, num_experts: int
) -> tuple[str, tuple[tuple[str, Role, int], ...]]:
    """Each key's (projection, role, expert) and the naming they share; FormatError on the
    first key that is none of them. Cached: every layer of a checkpoint has the same keys
    (but for the layer prefix the caller has already cut), and parsing ~100 names with a
    regular expression is a tenth of a millisecond of host time before any GPU work."""
    naming = None
    styles = _STYLES[gated]
    roles = {name: role for role, name in names[::-1]}  # first wins
    places = []
    for key in keys:
        match = _KEY.match(key)
        if match is None:
            raise FormatError(key, "not a per-expert name")
        expert, projection, suffix = int(match[1]), match[2], match[3]
        style = styles.get(projection)
        role = roles.get(suffix)
        if style is None or role is None or expert >= num_experts:
            raise FormatError(key, "unknown tensor")
        if naming is not None and style != naming:
            raise FormatError(key, "mixed namings")
        naming = style
        places.append((projection, role, expert))
    if naming is None:
        raise FormatError("tensors", "no expert tensors given")
    return naming, tuple(places)


def _projection(
    layout: SourceLayout,
    by_role: Mapping[Role, Mapping[int, torch.Tensor]],
    quant: SourceQuantization,
    projection: str,
    num_experts: int,
) -> PackedProjection:
    def key(role: Role, expert: int = 0) -> str:
        return f"{expert}.{projection}.{layout.names[role]}"

    required: list[Role] = ["weight", "scales"]
    if not quant.symmetric:
        required.append("zeros")
    if quant.desc_act and "g_idx" in layout.names:
        required.append("g_idx")
    for role in required:
        if role not in by_role:
            raise FormatError(key(role), "missing")
    for role, experts in by_role.items():
        if len(experts) != num_experts:
            raise FormatError(key(role), "missing for some experts")
    weight0 = by_role["weight"][0]
    n, k = layout.dims_from_weight(tuple(weight0.shape), quant.bits, key("weight"))
    scales0 = by_role["scales"][0]
    groups = int(scales0.shape[layout.scales.index("G")]) if scales0.dim() == 2 else -1
    dims = {"N": n, "K": k, "G": groups}
    small: dict[Role, torch.Tensor] = {}
    for role, experts in by_role.items():
        for expert, tensor in experts.items():
            layout.check(role, tensor, dims, quant.bits, key(role, expert))
            if role == "shape" and [int(v) for v in tensor.tolist()] != [n, k]:
                raise FormatError(key(role, expert), "disagrees with the tensors")
        if role not in ("shape", "weight"):
            small[role] = torch.stack([experts[e] for e in range(num_experts)])
    fields = {role: f"{projection}.{layout.names[role]}" for role in layout.roles}
    scales = to_canonical(small["scales"], layout.scales, ("N", "G")).contiguous()
    check_groups(quant, k, int(scales.shape[2]), fields["scales"])
    zeros = None
    if "zeros" in small and not _midpoint_words(layout, small["zeros"], quant):
        raw = unpack_as(layout.zeros, small["zeros"], quant.bits, ("N", "G"))
        zeros = layout.real_zeros(raw, quant, fields["zeros"])
    g_idx = None
    if "g_idx" in small and not _trivial_g_idx(small["g_idx"], quant, k):
        g_idx = decode_g_idx(small["g_idx"], quant, k, int(scales.shape[2]), fields["g_idx"])
    bias = small.get("bias")
    if bias is not None and (not bias.dtype.is_floating_point or bias.dim() != 2):
        raise FormatError(fields["bias"], "bad bias")
    weights = [[by_role["weight"][e]] for e in range(num_experts)]
    return PackedProjection(
        weights=weights,
        n=n,
        k=k,
        bits=quant.bits,
        group_size=quant.group_size,
        shard_scales=scales.unsqueeze(1),
        zeros=zeros,
        g_idx=g_idx,
        bias=None if bias is None else bias.contiguous(),
    )


def _midpoint_words(layout: SourceLayout, stored: torch.Tensor, quant: SourceQuantization) -> bool:
    """True when symmetric weights store every zero point as the midpoint (GPTQ writes it,
    minus one in v1): checked on the packed words, one comparison instead of an unpack.
    Any other content goes to the canonical check (and its error)."""
    if not quant.symmetric:
        return False
    return bool((stored == midpoint_word(layout, quant, stored.dtype)).all())


def _trivial_g_idx(g_idx: torch.Tensor, quant: SourceQuantization, k: int) -> bool:
    """True when the stored group indices are the plain k // group_size (GPTQ writes them
    even without act-order): one comparison; anything else is decoded canonically."""
    size = k if quant.group_size == -1 else quant.group_size
    trivial = torch.arange(k, device=g_idx.device, dtype=g_idx.dtype) // size
    return bool((g_idx == trivial).all())


def _fuse(gate: PackedProjection, up: PackedProjection) -> PackedProjection:
    """Gate rows over up rows (vLLM's w13), under the canonical `_fuse`'s conditions."""
    same_idx = (gate.g_idx is None and up.g_idx is None) or (
        gate.g_idx is not None and up.g_idx is not None and torch.equal(gate.g_idx, up.g_idx)
    )
    if (
        (gate.k, gate.num_groups) != (up.k, up.num_groups)
        or gate.scales.dtype != up.scales.dtype
        or (gate.zeros is None) != (up.zeros is None)
        or (gate.bias is None) != (up.bias is None)
        or not same_idx
    ):
        raise FormatError("up", "does not match the gate projection")

    def cat(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
        return None if a is None or b is None else torch.cat((a, b), dim=1).contiguous()

    scales = cat(gate.scales, up.scales)
    assert scales is not None
    return PackedProjection(
        weights=[[*g, *u] for g, u in zip(gate.weights, up.weights, strict=True)],
        n=gate.n + up.n,
        k=gate.k,
        bits=gate.bits,
        group_size=gate.group_size,
        shard_scales=scales.unsqueeze(1),
        zeros=cat(gate.zeros, up.zeros),
        g_idx=gate.g_idx,
        bias=cat(gate.bias, up.bias),
    )
