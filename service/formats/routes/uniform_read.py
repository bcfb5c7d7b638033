"""The fast read of a packed layer: a few launches and at most one host sync.

A layer whose experts, and gate and up, all store tensors of one dtype, shape and device
(every real checkpoint) is checked on expert 0's tensors plus equality of the rest, each
role stacked once for all experts (gate and up interleaved, so the stack already is the
fused w13), and every content check (midpoint zero points, plain g_idx, GPTQ v1 zero points
below the limit, the `shape` tensors) runs on the device into one boolean read once.
Anything else, and any check that fails, returns None: `read.read_packed` then reads the
layer the general way, which accepts it or raises the same error it always did.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import torch

from service.formats.errors import FormatError
from service.formats.readers.layouts import (
    Role,
    SourceLayout,
    SourceQuantization,
    check_groups,
    unpack_as,
)
from service.formats.routes.packed import PackedLayer, PackedProjection

__all__ = ["DEFER_DEVICES", "content_holds", "midpoint_word", "read_uniform"]


def read_uniform(
    layout: SourceLayout,
    by_projection: Sequence[Mapping[Role, Mapping[int, torch.Tensor]]],
    quant: SourceQuantization,
    num_experts: int,
    deferred: list[Callable[[], bool]] | None = None,
) -> PackedLayer | None:
    roles = set(by_projection[0])
    required: set[Role] = {"weight", "scales"}
    if not quant.symmetric:
        required.add("zeros")
    if quant.desc_act and "g_idx" in layout.names:
        required.add("g_idx")
    if not required <= roles or any(set(p) != roles for p in by_projection):
        return None
    if any(len(experts) != num_experts for p in by_projection for experts in p.values()):
        return None
    checks: list[torch.Tensor] = []
    content: dict[Role, list[tuple[int, torch.Tensor]]] = {"zeros": [], "g_idx": []}
    read = functools.partial(_uniform_part, layout, quant=quant, num_experts=num_experts)
    try:
        w13 = read(by_projection[:-1], checks=checks, content=content)
        w2 = read(by_projection[-1:], checks=checks, content=content)
    except FormatError:
        return None
    if w13 is None or w2 is None or w13.k != w2.n:
        return None
    device = w13.device
    if w2.device != device:
        return None
    pending = checks or content["zeros"] or content["g_idx"]
    if deferred is not None and pending and device.type in DEFER_DEVICES:
        deferred.append(functools.partial(content_holds, layout, quant, checks, content, device))
        return PackedLayer(layout, w13, w2)
    if not content_holds(layout, quant, checks, content, device):
        return None
    return PackedLayer(layout, w13, w2)


DEFER_DEVICES = {"cuda"}
"""Device types whose content checks `read_packed(deferred=...)` defers: where the ops are
queued, so the weights' kernels get queued ahead of the sync. On the CPU every op runs at
once, nothing is gained, and a layer whose checks fail (act-order g_idx, say) would have
its weights converted for nothing (the tests add "cpu" to check the deferred path)."""


def content_holds(
    layout: SourceLayout,
    quant: SourceQuantization,
    checks: list[torch.Tensor],
    content: dict[Role, list[tuple[int, torch.Tensor]]],
    device: torch.device,
) -> bool:
    """The uniform read's device checks (`checks`, plus the zero points and g_idx in
    `content`) all hold: the layer's one host sync when there is any."""
    checks = list(checks)
    if content["zeros"]:  # symmetric: every stored zero point is the midpoint
        flat = torch.cat([t.reshape(-1) for _, t in content["zeros"]])
        checks.append(flat == midpoint_word(layout, quant, flat.dtype))
    if content["g_idx"]:  # the plain k // group_size, expert after expert
        flat = torch.cat([t.reshape(-1) for _, t in content["g_idx"]])
        ks = tuple(k for k, _ in content["g_idx"])
        checks.append(flat == _plain_groups(ks, quant.group_size, flat.dtype, device))
    if not checks:
        return True
    ok = checks[0] if len(checks) == 1 else torch.cat([c.reshape(-1) for c in checks])
    return bool(ok.all())  # the layer's one host sync


def _uniform_part(
    layout: SourceLayout,
    parts: Sequence[Mapping[Role, Mapping[int, torch.Tensor]]],
    *,
    quant: SourceQuantization,
    num_experts: int,
    checks: list[torch.Tensor],
    content: dict[Role, list[tuple[int, torch.Tensor]]],
) -> PackedProjection | None:
    """The projections in `parts` (gate, up; or one) fused; device checks appended to
    `checks`, tensors whose content is checked over the whole layer to `content`."""
    shards = len(parts)
    n, k = layout.dims_from_weight(tuple(parts[0]["weight"][0].shape), quant.bits, "weight")
    scales0 = parts[0]["scales"][0]
    if scales0.dim() != 2:
        return None
    dims = {"N": n, "K": k, "G": int(scales0.shape[layout.scales.index("G")])}
    check_groups(quant, k, dims["G"], "scales")
    device = scales0.device
    stacks: dict[Role, torch.Tensor] = {}
    for role in parts[0]:
        tensors = [part[role][e] for e in range(num_experts) for part in parts]
        first = tensors[0]
        layout.check(role, first, dims, quant.bits, role)
        dtype, shape = first.dtype, first.shape
        if any(t.dtype != dtype or t.shape != shape or t.device != device for t in tensors):
            return None
        if role == "weight":
            continue
        if role == "g_idx" or (role == "zeros" and quant.symmetric):
            content[role].extend((k, t) for t in tensors)
            continue
        stacks[role] = torch.stack(tensors)  # [E * S, ...], expert-major: already fused
    if "shape" in stacks:
        checks.append(stacks["shape"] == _shape_words(n, k, stacks["shape"].dtype, device))
    stored = stacks["scales"].view(num_experts, shards, *scales0.shape)
    shard_scales = stored if layout.scales == ("N", "G") else stored.transpose(2, 3)
    zeros = None
    if "zeros" in stacks:
        raw = unpack_as(layout.zeros, stacks["zeros"], quant.bits, ("N", "G"))
        if layout.minus_one(quant):
            checks.append(raw != (1 << quant.bits) - 1)  # v1 cannot store the top value
            raw = raw + 1
        zeros = raw.view(num_experts, shards * n, dims["G"])
    bias = stacks.get("bias")
    return PackedProjection(
        weights=[[part["weight"][e] for part in parts] for e in range(num_experts)],
        n=shards * n,
        k=k,
        bits=quant.bits,
        group_size=quant.group_size,
        shard_scales=shard_scales,
        zeros=zeros,
        g_idx=None,
        bias=None if bias is None else bias.view(num_experts, shards * n),
    )


def midpoint_word(layout: SourceLayout, quant: SourceQuantization, dtype: torch.dtype) -> int:
    """The stored word (of `dtype`) whose every code is the symmetric midpoint zero point
    (GPTQ writes it, minus one in v1), as a value of that dtype."""
    midpoint = 1 << (quant.bits - 1)
    code = midpoint - 1 if layout.minus_one(quant) else midpoint
    width = 8 * dtype.itemsize
    word = sum(code << shift for shift in range(0, width, quant.bits))
    if word >= 1 << (width - 1) and dtype != torch.uint8:
        word -= 1 << width  # the same bits as a signed word
    return word


@functools.lru_cache(maxsize=32)
def _shape_words(n: int, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[n, k] as the `shape` tensors store it, kept on the device (no copy per layer)."""
    return torch.tensor([n, k], dtype=dtype).to(device)


@functools.lru_cache(maxsize=32)
def _plain_groups(
    ks: tuple[int, ...], group_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The plain group indices of tensors of K = ks[i], one after another (kept on the
    device: the same layer shape comes back for every layer of a checkpoint)."""
    parts = [torch.arange(k, dtype=dtype) // (k if group_size == -1 else group_size) for k in ks]
    return torch.cat(parts).to(device)
