"""Direct packed -> packed conversions for the hot (source layout, backend) routes.

The canonical route (reader -> one byte per code -> writer) is general and is the exactness
reference, but for a 4-bit layer it writes and re-reads twice the checkpoint's bytes in
codes, stacks and concatenates them, and checks every code's range: 20-40x the memory
traffic of the conversion itself. The routes here never expand the weight: they rearrange
the packed words (GPTQ -> TRITON is a transpose of int32 words) or, where nibbles must
change words, pair them with one mask-and-shift exchange over int32 words and then move
bytes once, straight into the output tensor (a single strided copy on a GPU, a fixed
per-block table on the CPU: `_move_blocks`), expert by expert (no stacking, w1/w3 written
into their rows of w13). `compile_weights` runs the same transforms through torch.compile,
which fuses them into one kernel on a GPU. Everything except the weight (scales, zero
points, g_idx, bias: a few percent of the bytes) still goes through the canonical helpers,
so those rules are stated once.

`ROUTES` is the dispatch table: (layout, backend) -> the weight transform, plus what that
transform assumes. `convert` takes a direct route when one exists and the layer fits it,
and the canonical route otherwise; both give byte-identical tensors (tests/formats/
test_direct.py checks every variant). A layer a route does not cover (act-order, Marlin
padding, 8-bit activations, AWQ int8...) simply takes the canonical route, and so does any
malformed input: its error then comes from the canonical reader, word for word.

The nibble exchange: two int32 words `a`, `b` whose byte i holds codes (2i, 2i+1) of one
run each become `low` (byte i = a's low nibble | b's low nibble << 4) and `high` (a's high
nibble | b's high nibble << 4): t = ((a >> 4) ^ b) & 0x0F0F0F0F; high = b ^ t;
low = a ^ (t << 4). Six elementwise passes over half the weight each.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from service.formats import gpu_repack, registry
from service.formats.canonical import FormatError, QuantizedMoELayer
from service.formats.readers import bits as packing
from service.formats.readers.checkpoint import NAMINGS
from service.formats.readers.layouts import (
    LAYOUTS,
    Role,
    SourceLayout,
    SourceQuantization,
    _check_groups,
    _decode_g_idx,
    _to_canonical,
    _unpack_as,
)
from service.formats.writers import (
    DEFAULT_OPTIONS,
    ConversionOptions,
    ConvertedLayer,
    finish,
    weight_type,
)
from service.formats.writers import marlin_layout as mlayout
from service.formats.writers.marlin import MARLIN_GROUP_SIZES, padded_intermediate

__all__ = [
    "ROUTES",
    "PackedLayer",
    "PackedProjection",
    "Route",
    "canonical",
    "convert",
    "read_packed",
    "try_direct",
]

_KEY = re.compile(r"^(\d+)\.([A-Za-z0-9_]+)\.([A-Za-z0-9_]+)$")
_STYLES = {
    gated: {p: style for style, names in list(NAMINGS.items())[::-1] for p in names[gated]}
    for gated in (True, False)
}
"""gated -> projection name -> its naming style (the first naming that lists it wins)."""
_LOW_NIBBLES = 0x0F0F0F0F


@dataclass(frozen=True)
class PackedProjection:
    """One projection of every expert with its weight still packed as the checkpoint has it.

    `weights[e]` lists expert e's stored weight tensors (2-D, source storage order) whose
    output rows follow one another (gate then up for w13). Everything else is canonical:
    `zeros` uint8 [E, N, G] (real) or None, `g_idx`, `bias`; the scales are kept per shard
    as `shard_scales` [E, S, N/S, G], any strides (S = 2 for a fused w13: gate, up): a view
    of the one stack of the stored tensors, so a target that wants them K-first (Marlin)
    gathers them straight from the stored order, and only a target that wants canonical
    [E, N, G] (`scales`, computed on first use) pays for the transpose.
    """

    weights: Sequence[Sequence[torch.Tensor]]
    n: int
    k: int
    bits: int
    group_size: int
    shard_scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    bias: torch.Tensor | None

    @functools.cached_property
    def scales(self) -> torch.Tensor:
        """Canonical [E, N, G], contiguous (one copy unless the stored order was already)."""
        e, s, rows, g = (int(d) for d in self.shard_scales.shape)
        return self.shard_scales.reshape(e, s * rows, g).contiguous()

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @property
    def num_experts(self) -> int:
        return len(self.weights)

    @property
    def num_groups(self) -> int:
        return int(self.shard_scales.shape[3])

    @property
    def device(self) -> torch.device:
        return self.shard_scales.device


@dataclass(frozen=True)
class PackedLayer:
    layout: SourceLayout
    w13: PackedProjection
    w2: PackedProjection

    @property
    def hidden_size(self) -> int:
        return self.w13.k

    @property
    def intermediate_size(self) -> int:
        return self.w2.k


# -- reading: the canonical reader's checks, the weight left packed ----------------------


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
    uniform = _read_uniform(layout, by_projection, quant, num_experts, deferred)
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


# The common case, read in a few launches and one host sync. A layer whose experts, and
# gate and up, all store tensors of one dtype, shape and device (every real checkpoint) is
# checked on expert 0's tensors plus equality of the rest, each role stacked once for all
# experts (gate and up interleaved, so the stack already is the fused w13), and every
# content check (midpoint zero points, plain g_idx, GPTQ v1 zero points below the limit,
# the `shape` tensors) runs on the device into one boolean read once. Anything else, and
# any check that fails, returns None: `read_packed` then reads the layer the general way
# (`_projection`, `_fuse`), which accepts it or raises the same error it always did.


def _read_uniform(
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
        deferred.append(functools.partial(_content_holds, layout, quant, checks, content, device))
        return PackedLayer(layout, w13, w2)
    if not _content_holds(layout, quant, checks, content, device):
        return None
    return PackedLayer(layout, w13, w2)


DEFER_DEVICES = {"cuda"}
"""Device types whose content checks `read_packed(deferred=...)` defers: where the ops are
queued, so the weights' kernels get queued ahead of the sync. On the CPU every op runs at
once, nothing is gained, and a layer whose checks fail (act-order g_idx, say) would have
its weights converted for nothing (the tests add "cpu" to check the deferred path)."""


def _content_holds(
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
        checks.append(flat == _midpoint_word(layout, quant, flat.dtype))
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
    _check_groups(quant, k, dims["G"], "scales")
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
        raw = _unpack_as(layout.zeros, stacks["zeros"], quant.bits, ("N", "G"))
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


def _midpoint_word(layout: SourceLayout, quant: SourceQuantization, dtype: torch.dtype) -> int:
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
    scales = _to_canonical(small["scales"], layout.scales, ("N", "G")).contiguous()
    _check_groups(quant, k, int(scales.shape[2]), fields["scales"])
    zeros = None
    if "zeros" in small and not _midpoint_words(layout, small["zeros"], quant):
        raw = _unpack_as(layout.zeros, small["zeros"], quant.bits, ("N", "G"))
        zeros = layout._real_zeros(raw, quant, fields["zeros"])
    g_idx = None
    if "g_idx" in small and not _trivial_g_idx(small["g_idx"], quant, k):
        g_idx = _decode_g_idx(small["g_idx"], quant, k, int(scales.shape[2]), fields["g_idx"])
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
    return bool((stored == _midpoint_word(layout, quant, stored.dtype)).all())


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


# -- weight transforms: one expert's stored tensor -> its rows of the target --------------


def _exchange_nibbles(
    a: torch.Tensor, b: torch.Tensor, low: torch.Tensor, high: torch.Tensor
) -> None:
    """int32 words: `low` byte i = a's low nibble | b's low nibble << 4, `high` the same
    for the high nibbles (see the module docstring). `low`/`high` may be strided views."""
    t = torch.bitwise_right_shift(a, 4)
    t ^= b
    t &= _LOW_NIBBLES
    torch.bitwise_xor(b, t, out=high)
    t <<= 4
    torch.bitwise_xor(a, t, out=low)


def _pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int32 [..., 2]: (low, high) of `_exchange_nibbles`. Eagerly the results go straight
    into their final places (no stacking pass); under torch.compile (which has no `out=`
    into views) the same arithmetic is written functionally and fused."""
    if torch.compiler.is_compiling():
        t = ((a >> 4) ^ b) & _LOW_NIBBLES
        return torch.stack((a ^ (t << 4), b ^ t), dim=-1)
    mixed = torch.empty(*a.shape, 2, dtype=torch.int32, device=a.device)
    _exchange_nibbles(a, b, mixed[..., 0], mixed[..., 1])
    return mixed


# A weight transform writes one stored per-expert tensor (source order) into `out`, the
# target's bytes for exactly those output rows, already shaped by the route's `target_view`.
WeightFn = Callable[[torch.Tensor, torch.Tensor, int], None]


def _triton_from_k_first(stored: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """GPTQ int32 [K/pf, N] (K packed) -> Triton bytes [N, K*bits/8]: a word transpose."""
    out.view(torch.int32).copy_(stored.t())


def _triton_from_n_first(stored: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """compressed-tensors int32 [N, K/pf] / MoeWNA16 uint8 [N, K/p8]: the same bytes."""
    out.copy_(stored.contiguous().view(torch.uint8).view(out.shape))


def _triton_from_awq(stored: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """AWQ int4 int32 [K, N/8] (N packed, nibble order 0,2,4,6,1,3,5,7) -> Triton [N, K/2].

    Rows k and k+1 exchange nibbles: byte i of `low` pairs column order[2i] of both rows,
    of `high` column order[2i+1], so column j = 4*(i%2) + 2*high + i//2. A GPU then puts
    every byte in place with one strided copy (a transpose of the whole matrix). On the CPU
    a byte-granular transpose is slow, so the move is split by granularity: the eight
    bytes of each (k pair, word) move as one int64 (a word transpose), 4 x 8 byte blocks
    are reordered by a table, and the 4-byte results move as int32 words."""
    k, words = (int(d) for d in stored.shape)
    pairs = stored.view(k // 2, 2, words)
    mixed = _pair(pairs[:, 0], pairs[:, 1])  # [kb, nw, high] words of bytes i
    if not _table_moves(stored):
        source = mixed.view(torch.uint8).view(k // 2, words, 2, 2, 2)  # kb nw high ih il
        out.view(words, 2, 2, 2, k // 2).copy_(source.permute(1, 4, 2, 3, 0))
        return
    by_word = mixed.view(torch.int64).view(k // 2, words).t().contiguous()  # [nw, kb]
    blocks = by_word.view(torch.uint8).view(words, k // 8, 32)  # [nw, kw, (kb4 high ih il)]
    moved = torch.empty_like(blocks)
    _move_blocks(blocks, (4, 2, 2, 2), (3, 1, 2, 0), moved)  # -> [nw, kw, (j, kb4)]
    columns = moved.view(torch.int32).view(words, k // 8, 8)
    out.view(torch.int32).view(words, 8, k // 8).copy_(columns.transpose(1, 2))


TABLE_MOVE_DEVICES = {"cpu"}
"""Device types whose block moves go through numpy's `take` (see `_move_blocks`); the
tests empty it to check the strided-copy path a GPU takes, on the CPU."""


def _table_moves(tensor: torch.Tensor) -> bool:
    return tensor.device.type in TABLE_MOVE_DEVICES and not torch.compiler.is_compiling()


def _move_blocks(
    source: torch.Tensor, block: tuple[int, ...], order: tuple[int, ...], out: torch.Tensor
) -> None:
    """out[x, y] = source[x, y] with each block's bytes, seen as digits `block`, permuted
    to `order`; `source` and `out` are uint8 [X, Y, prod(block)] (`out` may be a slice).

    On a GPU one strided copy (a single kernel). On the CPU torch's copy of a 7-D byte
    permutation runs at 0.1-0.2 GB/s, while numpy's `take` over one fixed table of the
    block's bytes runs at ~1 GB/s per core, so the CPU takes that path."""
    x, y, _ = (int(d) for d in source.shape)
    if _table_moves(source):
        table = _block_table(block, order)
        np.take(source.numpy(), table, axis=2, out=out.numpy(), mode="clip")
        return
    target = tuple(block[d] for d in order)
    shifted = (0, 1, *(2 + d for d in order))
    out.view(x, y, *target).copy_(source.view(x, y, *block).permute(shifted))


@functools.cache
def _block_table(block: tuple[int, ...], order: tuple[int, ...]) -> npt.NDArray[np.intp]:
    """Source byte of each target byte of one block."""
    table = np.arange(math.prod(block), dtype=np.intp).reshape(block).transpose(order)
    return np.ascontiguousarray(table).reshape(-1)


# Marlin (16-bit activations): in a 16x64 tile k = 8a + 2q + b, n = 16j + 8c + r; word
# (r, q, j) holds byte (b, c) with the a = 0 code in the low nibble (marlin_layout).
def _marlin4_from_gptq(stored: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """GPTQ int4 [K/8, N] -> Marlin bytes [K/16, N/64, 512]: words of a = 0 and a = 1 (the
    two words of each k tile) exchange nibbles into b = 0 / b = 1 bytes (byte q of a word),
    then each 512-byte block's (j, c, r, b, q) moves to (r, q, j, b, c)."""
    k8, n = (int(d) for d in stored.shape)
    kt = k8 // 2
    pairs = stored.view(kt, 2, n)
    mixed = _pair(pairs[:, 0], pairs[:, 1])  # [kt, n, b] words of bytes q
    source = mixed.view(torch.uint8).view(kt, n // 64, 512)
    _move_blocks(source, (4, 2, 8, 2, 4), (2, 4, 0, 3, 1), out)


def _marlin4_from_ct(stored: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """compressed-tensors int4 [N, K/8]: the same exchange, words (a = 0, 1) adjacent."""
    n, k8 = (int(d) for d in stored.shape)
    kt = k8 // 2
    pairs = stored.view(n, kt, 2)
    mixed = _pair(pairs[..., 0], pairs[..., 1])
    source = mixed.view(torch.uint8).view(n // 64, 4, 2, 8, kt, 2, 4)  # nt j c r kt b q
    out.view(kt, n // 64, 8, 4, 4, 2, 2).copy_(source.permute(4, 0, 3, 6, 1, 5, 2))


def _marlin4_from_awq(stored: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """AWQ int4 [K, N/8]: rows k and k+8 of a tile (a = 0, 1) exchange nibbles; byte i of
    the low/high word holds column r = 4*(i%2) + 2*high + i//2 of word nw = 8nt + 2j + c.

    For the CPU's table move the exchange reads the rows through a transposed view so each
    64-column block comes out contiguous; a GPU exchanges in storage order (coalesced) and
    lets its one strided copy gather the blocks."""
    k, words = (int(d) for d in stored.shape)
    kt = k // 16
    if _table_moves(stored):
        pairs = stored.view(kt, 2, 8, words).transpose(2, 3)  # kt a nw kin
        mixed = _pair(pairs[:, 0], pairs[:, 1])  # [kt, nw, kin, high] words of bytes i
        source = mixed.view(torch.uint8).view(kt, words // 8, 512)
        # block digits: j c q b high ih il -> r = (il, high, ih), q, j, b, c
        _move_blocks(source, (4, 2, 4, 2, 2, 2, 2), (6, 4, 5, 2, 0, 3, 1), out)
        return
    pairs = stored.view(kt, 2, 8, words)
    mixed = _pair(pairs[:, 0], pairs[:, 1])  # [kt, kin, nw, high] words of bytes i
    # kt q b nt j c high ih il -> kt nt (il high ih) q j b c
    digits = mixed.view(torch.uint8).view(kt, 4, 2, words // 8, 4, 2, 2, 2, 2)
    target = out.view(kt, words // 8, 2, 2, 2, 4, 4, 2, 2)
    target.copy_(digits.permute(0, 3, 8, 6, 7, 1, 4, 2, 5))


def _marlin8_from_gptq(stored: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """GPTQ int8 [K/4, N] (byte 2*(q%2)+b of word 4kt + 2a + q//2): a byte permutation
    into Marlin's int8 tile order (r, q, j, c, b, a)."""
    k4, n = (int(d) for d in stored.shape)
    kt = k4 // 4
    source = stored.view(torch.uint8).view(kt, 2, 2, n // 64, 4, 2, 8, 2, 2)
    # kt a qh nt j c r ql b -> kt nt r qh ql j c b a
    out.view(kt, n // 64, 8, 2, 2, 4, 2, 2, 2).copy_(source.permute(0, 3, 6, 2, 7, 4, 5, 8, 1))


def _marlin8_from_ct(stored: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """compressed-tensors int8 [N, K/4]: bytes [N, K] permuted the same way."""
    n, k4 = (int(d) for d in stored.shape)
    kt = k4 // 4
    source = stored.view(torch.uint8).view(n // 64, 4, 2, 8, kt, 2, 2, 2, 2)
    # nt j c r kt a qh ql b -> kt nt r qh ql j c b a
    out.view(kt, n // 64, 8, 2, 2, 4, 2, 2, 2).copy_(source.permute(4, 0, 3, 6, 7, 1, 2, 8, 5))


# -- targets -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Target:
    """How a backend's weight tensor is allocated and sliced per expert and row block.

    `allocate(e, n, k, bits, device)` gives the output weight; `rows(out_e, start, stop,
    bits)` the bytes of output rows [start, stop) of one expert's slice."""

    allocate: Callable[[int, int, int, int, torch.device], torch.Tensor]
    rows: Callable[[torch.Tensor, int, int, int], torch.Tensor]
    tensors: Callable[[PackedLayer, torch.Tensor, torch.Tensor], dict[str, torch.Tensor | None]]
    applies: Callable[[PackedLayer, ConversionOptions], bool]


def _triton_allocate(e: int, n: int, k: int, bits: int, device: torch.device) -> torch.Tensor:
    return torch.empty(e, n, k * bits // 8, dtype=torch.uint8, device=device)


def _triton_rows(out_e: torch.Tensor, start: int, stop: int, bits: int) -> torch.Tensor:
    return out_e[start:stop]


def _triton_tensors(
    layer: PackedLayer, w13: torch.Tensor, w2: torch.Tensor
) -> dict[str, torch.Tensor | None]:
    def zeros(p: PackedProjection) -> torch.Tensor | None:
        return None if p.zeros is None else packing.pack(p.zeros, p.bits, 1, torch.uint8)

    return {
        "w13_qweight": w13,
        "w2_qweight": w2,
        "w13_scales": layer.w13.scales.contiguous(),
        "w2_scales": layer.w2.scales.contiguous(),
        "w13_qzeros": zeros(layer.w13),
        "w2_qzeros": zeros(layer.w2),
        "w13_bias": layer.w13.bias,
        "w2_bias": layer.w2.bias,
    }


def _triton_applies(layer: PackedLayer, options: ConversionOptions) -> bool:
    return all(p.g_idx is None and (p.bits != 4 or p.n % 2 == 0) for p in (layer.w13, layer.w2))


def _marlin_allocate(e: int, n: int, k: int, bits: int, device: torch.device) -> torch.Tensor:
    return torch.empty(e, k // 16, n * 16 * bits // 32, dtype=torch.int32, device=device)


def _marlin_rows(out_e: torch.Tensor, start: int, stop: int, bits: int) -> torch.Tensor:
    """Output rows [start, stop) are whole 64-wide n tiles of every k tile."""
    k_tiles = int(out_e.shape[0])
    tiles = out_e.view(torch.uint8).view(k_tiles, -1, 64 * 16 * bits // 8)
    return tiles[:, start // 64 : stop // 64]


def _marlin_tensors(
    layer: PackedLayer, w13: torch.Tensor, w2: torch.Tensor
) -> dict[str, torch.Tensor | None]:
    out: dict[str, torch.Tensor | None] = {"w13_qweight": w13, "w2_qweight": w2}
    for name, p in (("w13", layer.w13), ("w2", layer.w2)):
        out[f"{name}_scales"] = _marlin_scales(p)
    for name, p in (("w13", layer.w13), ("w2", layer.w2)):
        out[f"{name}_qzeros"] = (
            None
            if p.zeros is None
            else mlayout.pack_zero_points(p.zeros.transpose(1, 2).contiguous(), p.bits)
        )
    for name, p in (("w13", layer.w13), ("w2", layer.w2)):
        if p.bias is None:
            out[f"{name}_bias"] = None
        else:
            index = _gather_index("bias", int(p.bias.shape[1]), p.bias.device)
            out[f"{name}_bias"] = torch.index_select(p.bias, 1, index)
    return out


def _marlin_scales(p: PackedProjection) -> torch.Tensor:
    """`mlayout.permute_scales` of the K-first scales [E, G, N], as one gather straight
    from the per-shard stack (K-first already for GPTQ and AWQ: no transpose copy first):
    the permutation moves channels only within runs of 64 (32), which never straddle gate
    and up (Marlin's route needs N/S a multiple of 64), so each shard permutes alone."""
    e, shards, rows, groups = (int(d) for d in p.shard_scales.shape)
    grouped = p.num_groups > 1
    if rows % 64:
        return mlayout.permute_scales(p.scales.transpose(1, 2), grouped)
    index = _gather_index("grouped" if grouped else "channelwise", rows, p.device)
    k_first = p.shard_scales.permute(0, 3, 1, 2)  # [E, G, S, N/S], a view
    return torch.index_select(k_first, 3, index).reshape(e, groups, shards * rows)


_ORDERS: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "grouped": lambda x: mlayout.permute_scales(x, True),
    "channelwise": lambda x: mlayout.permute_scales(x, False),
    "bias": lambda x: mlayout.permute_bias(x[0]).unsqueeze(0),
}


@functools.lru_cache(maxsize=32)
def _gather_index(order: str, width: int, device: torch.device) -> torch.Tensor:
    """The source channel of each output channel of `_ORDERS[order]` over `width` channels:
    that very function applied to 0, 1, ..., width - 1 (so the gather is its permutation by
    construction), kept on the device."""
    channels = torch.arange(width, dtype=torch.int64).view(1, 1, width)
    return _ORDERS[order](channels).reshape(width).to(device)


_A16 = (None, torch.float16, torch.bfloat16)


def _marlin_applies(layer: PackedLayer, options: ConversionOptions) -> bool:
    """16-bit activations, no act-order, no padding, shapes Marlin tiles: everything else
    (and every refusal) is the canonical writer's."""
    w13, w2 = layer.w13, layer.w2
    inter, group = layer.intermediate_size, w13.group_size
    return (
        options.activation_dtype in _A16
        and options.extra.get("act_order", "reject") in ("reject", "sort")
        and w13.g_idx is None
        and w2.g_idx is None
        and group in MARLIN_GROUP_SIZES
        and layer.hidden_size % 128 == 0
        and inter % 64 == 0
        and padded_intermediate(inter, group) == inter
        and w13.n in (inter, 2 * inter)
        and all(len(shards) * inter == w13.n for shards in w13.weights)
    )


TRITON = _Target(_triton_allocate, _triton_rows, _triton_tensors, _triton_applies)
MARLIN = _Target(_marlin_allocate, _marlin_rows, _marlin_tensors, _marlin_applies)


@dataclass(frozen=True)
class Route:
    """A direct route: the target, the weight transform by bit width (absent widths take
    the canonical route), and the fused Triton kernels that replace those transforms on a
    device `gpu_repack.usable` accepts (absent widths keep the torch transform)."""

    target: _Target
    weight: Mapping[int, WeightFn]
    kernels: Mapping[int, WeightFn] = dataclasses.field(default_factory=dict)


def _kernel(
    layout: str,
    target: _Target,
    fn: WeightFn,
    bits: int,
    *,
    in_tile: tuple[int, int],
    out_tile: tuple[int, int],
    kind: str = "table",
) -> gpu_repack.Repack:
    """`fn` as one Triton kernel; its permutation is read off `fn` itself (run on a probe
    of one expert's stored words, into the target's word matrix)."""

    def probe(stored: torch.Tensor, probe_bits: int) -> torch.Tensor:
        n, k = LAYOUTS[layout].dims_from_weight(tuple(stored.shape), probe_bits, "probe")
        out_e = target.allocate(1, n, k, probe_bits, stored.device)[0]
        fn(stored, target.rows(out_e, 0, n, probe_bits), probe_bits)
        return out_e.view(torch.int32).view(int(out_e.shape[0]), -1)

    return gpu_repack.Repack(fn, probe, bits, in_tile, out_tile, kind=kind)


# Tiles in int32 words, [rows, columns] of the stored tensor -> of the output word matrix:
# Marlin: one 16 x 64 tile (16 * bits words) per k tile and n tile; TRITON: a transpose of
# words (GPTQ) or of 8 x 8 code blocks (AWQ: 8 rows of one word -> 8 rows of one word).
# Int4 Marlin has dedicated kernels (coalesced block loads, constant shifts); the generic
# table kernel (one gathered word per nibble field) stays in TABLE_KERNELS for comparison.
_GPTQ_MARLIN_TABLE = {
    bits: _kernel("gptq", MARLIN, fn, bits, in_tile=(16 * bits // 32, 64), out_tile=(1, 32 * bits))
    for bits, fn in ((4, _marlin4_from_gptq), (8, _marlin8_from_gptq))
}
_AWQ_MARLIN_TABLE = {
    4: _kernel("awq", MARLIN, _marlin4_from_awq, 4, in_tile=(16, 8), out_tile=(1, 128))
}
_GPTQ_MARLIN = {
    **_GPTQ_MARLIN_TABLE,
    4: _kernel(
        "gptq",
        MARLIN,
        _marlin4_from_gptq,
        4,
        in_tile=(2, 64),
        out_tile=(1, 128),
        kind="marlin4_gptq",
    ),
}
_AWQ_MARLIN = {
    4: _kernel(
        "awq", MARLIN, _marlin4_from_awq, 4, in_tile=(16, 8), out_tile=(1, 128), kind="marlin4_awq"
    )
}
_GPTQ_TRITON = {
    bits: _kernel(
        "gptq",
        TRITON,
        _triton_from_k_first,
        bits,
        in_tile=(1, 1),
        out_tile=(1, 1),
        kind="transpose",
    )
    for bits in (4, 8)
}
_AWQ_TRITON = {
    4: _kernel(
        "awq", TRITON, _triton_from_awq, 4, in_tile=(8, 1), out_tile=(8, 1), kind="awq_triton"
    )
}

ROUTES: Mapping[tuple[str, str], Route] = {
    ("gptq", "TRITON"): Route(
        TRITON, {4: _triton_from_k_first, 8: _triton_from_k_first}, _GPTQ_TRITON
    ),
    ("awq", "TRITON"): Route(TRITON, {4: _triton_from_awq}, _AWQ_TRITON),
    ("compressed-tensors", "TRITON"): Route(
        TRITON, {4: _triton_from_n_first, 8: _triton_from_n_first}
    ),
    ("moe_wna16", "TRITON"): Route(TRITON, {4: _triton_from_n_first, 8: _triton_from_n_first}),
    ("gptq", "MARLIN"): Route(MARLIN, {4: _marlin4_from_gptq, 8: _marlin8_from_gptq}, _GPTQ_MARLIN),
    ("awq", "MARLIN"): Route(MARLIN, {4: _marlin4_from_awq}, _AWQ_MARLIN),
    ("compressed-tensors", "MARLIN"): Route(MARLIN, {4: _marlin4_from_ct, 8: _marlin8_from_ct}),
    ("gptq", "BATCHED_MARLIN"): Route(
        MARLIN, {4: _marlin4_from_gptq, 8: _marlin8_from_gptq}, _GPTQ_MARLIN
    ),
    ("awq", "BATCHED_MARLIN"): Route(MARLIN, {4: _marlin4_from_awq}, _AWQ_MARLIN),
    ("compressed-tensors", "BATCHED_MARLIN"): Route(
        MARLIN, {4: _marlin4_from_ct, 8: _marlin8_from_ct}
    ),
}
"""(source layout, backend) -> direct route. Absent pairs take the canonical route."""

TABLE_KERNELS: Mapping[tuple[str, str], Mapping[int, WeightFn]] = {
    ("gptq", "MARLIN"): _GPTQ_MARLIN_TABLE,
    ("gptq", "BATCHED_MARLIN"): _GPTQ_MARLIN_TABLE,
    ("awq", "MARLIN"): _AWQ_MARLIN_TABLE,
    ("awq", "BATCHED_MARLIN"): _AWQ_MARLIN_TABLE,
}
"""The Marlin routes' generic table kernels, which the dedicated int4 kernels in `ROUTES`
replaced (`try_direct(table_kernels=True)`, the bench's `table` route, times them against
each other; every test checks both)."""

KERNEL_DEFAULTS: frozenset[tuple[str, str, int]] = frozenset(
    {
        ("gptq", "TRITON", 4),
        ("gptq", "MARLIN", 4),
        ("gptq", "BATCHED_MARLIN", 4),
        ("awq", "TRITON", 4),
        ("awq", "MARLIN", 4),
        ("awq", "BATCHED_MARLIN", 4),
    }
)
"""(layout, backend, bits) whose fused Triton kernels replace the torch transforms by
default (`try_direct(kernels=None)`) on a device `gpu_repack.usable` accepts: the routes
an H200 run showed faster with the kernel (`bash scripts/gpu_convert_bench.sh --routes
direct triton`, Mixtral-8x7B layer, int4; both weight writes, device ms, torch -> kernel:
gptq->TRITON 1.34 -> 0.87, gptq->MARLIN 4.54 -> 1.42, awq->TRITON 6.28 -> 1.93 (whole
call 7.35 -> 1.70), awq->MARLIN 4.98 -> 1.50, with the table kernel: the dedicated int4
Marlin kernels that replaced it load and store int32 x 4 vectors, untimed on the H200
when they went in; the bench's `table` route times the table kernel). BATCHED_MARLIN
writes MARLIN's weight with the same transform and kernel. 8-bit kernels stay off until
an H200 run times them; the bench's `triton` route forces every kernel on, its `direct`
route off."""


_COMPILED: dict[WeightFn, WeightFn] = {}


def compiled(fn: WeightFn) -> WeightFn:
    """`fn` through torch.compile (inductor fuses the nibble exchange and the byte move into
    one kernel on a GPU; eagerly they are seven passes). Compiled once per transform, then
    once per tensor shape by torch's own guards."""
    found = _COMPILED.get(fn)
    if found is None:
        found = _COMPILED[fn] = torch.compile(fn, dynamic=False, fullgraph=True)
    return found


def _write_weight(
    route: Route,
    fn: WeightFn,
    projection: PackedProjection,
    device: torch.device,
    compile_weights: bool = False,
) -> torch.Tensor:
    if compile_weights:
        fn = compiled(fn)
    bits = projection.bits
    out = route.target.allocate(projection.num_experts, projection.n, projection.k, bits, device)
    if isinstance(fn, gpu_repack.Repack) and _run_experts(route, fn, projection, out, device):
        return out
    pairs = []
    for expert, shards in enumerate(projection.weights):
        start = 0
        rows = projection.n // len(shards)
        for stored in shards:
            view = route.target.rows(out[expert], start, start + rows, bits)
            pairs.append((stored.to(device), view))
            start += rows
    if isinstance(fn, gpu_repack.Repack):
        fn.run(pairs, bits)  # one launch when every pair has one shape
    else:
        for stored, view in pairs:
            fn(stored, view, bits)
    return out


def _run_experts(
    route: Route,
    kernel: gpu_repack.Repack,
    projection: PackedProjection,
    out: torch.Tensor,
    device: torch.device,
) -> bool:
    """Every expert and shard of `projection` in one kernel launch, only expert 0's output
    views cut (expert e's are the same views e experts further on); False when the
    experts differ in shards or shapes (the caller then cuts every view)."""
    shards = len(projection.weights[0])
    rows = projection.n // shards
    bits = projection.bits
    views = [route.target.rows(out[0], i * rows, (i + 1) * rows, bits) for i in range(shards)]
    stored = [[t.to(device) for t in expert] for expert in projection.weights]
    return kernel.run_experts(stored, views, int(out.stride(0)) * out.element_size(), bits)


def direct_route(layout: str, backend: str, bits: int) -> tuple[Route, WeightFn] | None:
    route = ROUTES.get((layout, backend))
    fn = None if route is None else route.weight.get(bits)
    return None if route is None or fn is None else (route, fn)


def try_direct(
    layout: str,
    tensors: Mapping[str, torch.Tensor],
    quant: SourceQuantization,
    backend: str,
    *,
    num_experts: int,
    gated: bool = True,
    options: ConversionOptions = DEFAULT_OPTIONS,
    compile_weights: bool = False,
    kernels: bool | None = None,
    table_kernels: bool = False,
    check: Callable[[PackedLayer], None] | None = None,
    defer_checks: bool = True,
) -> ConvertedLayer | None:
    """The direct route's result, or None when there is none for this layer (or the input
    is malformed: the canonical reader then says how). `compile_weights` runs the weight
    transforms through torch.compile (the bench's `compiled` route; the first call per
    shape compiles). `kernels`: on a device `gpu_repack.usable` accepts, the route's fused
    Triton kernels replace its torch transforms (True), or not (False); None (the default)
    takes them for the routes in `KERNEL_DEFAULTS` (those an H200 run showed faster).
    The bench's `triton` route forces them on, its `direct` route off.
    `table_kernels` (with kernels on) takes `TABLE_KERNELS` where a route has one.
    `defer_checks`: `read_packed`'s content checks are waited for after the weights are
    queued (see its `deferred`); False waits for them before anything is written.
    `check` sees the layer as read, before anything is written (the inline path's
    declared-shape check)."""
    found = direct_route(layout, backend, quant.bits)
    if found is None or layout not in LAYOUTS:
        return None
    route, fn = found
    registry.writer_for(backend)
    deferred: list[Callable[[], bool]] | None = [] if defer_checks else None
    try:
        packed = read_packed(
            LAYOUTS[layout], tensors, quant, num_experts=num_experts, gated=gated, deferred=deferred
        )
    except FormatError:
        return None
    if check is not None:
        check(packed)
    if not route.target.applies(packed, options):
        return None
    device = packed.w13.device
    if kernels is None:
        kernels = (layout, backend, quant.bits) in KERNEL_DEFAULTS
    if kernels and not compile_weights and gpu_repack.usable(device):
        table = TABLE_KERNELS.get((layout, backend), {}) if table_kernels else {}
        fn = table.get(quant.bits) or route.kernels.get(quant.bits, fn)
    w13 = _write_weight(route, fn, packed.w13, device, compile_weights)
    w2 = _write_weight(route, fn, packed.w2, device, compile_weights)
    named = route.target.tensors(packed, w13, w2)
    if deferred and not all(holds() for holds in deferred):
        # A content check failed: what was written is dropped, and the layer is read the
        # general way (which refuses it, or accepts it as, say, asymmetric).
        return try_direct(
            layout,
            tensors,
            quant,
            backend,
            num_experts=num_experts,
            gated=gated,
            options=options,
            compile_weights=compile_weights,
            kernels=kernels,
            table_kernels=table_kernels,
            check=check,
            defer_checks=False,
        )
    return finish(
        named,
        backend=backend,
        source=layout,
        layer=packed,
        weight_type_name=weight_type(packed.w13),
        options=options,
    )


def canonical(
    layout: str,
    tensors: Mapping[str, torch.Tensor],
    quant: SourceQuantization,
    backend: str,
    *,
    num_experts: int,
    gated: bool = True,
    options: ConversionOptions = DEFAULT_OPTIONS,
    check: Callable[[QuantizedMoELayer], None] | None = None,
) -> ConvertedLayer:
    """The general route: reader -> canonical layer -> writer (`check` as `try_direct`'s)."""
    layer = registry.read_layer(layout, tensors, quant, num_experts=num_experts, gated=gated)
    if check is not None:
        check(layer)
    return registry.convert(layer, backend, source=layout, options=options)


def convert(
    layout: str,
    tensors: Mapping[str, torch.Tensor],
    quant: SourceQuantization,
    backend: str,
    *,
    num_experts: int,
    gated: bool = True,
    options: ConversionOptions = DEFAULT_OPTIONS,
    check: Callable[[PackedLayer | QuantizedMoELayer], None] | None = None,
) -> ConvertedLayer:
    """Per-expert checkpoint tensors -> `backend`'s tensors: a direct route when `ROUTES`
    has one that fits the layer, else the canonical route. Same bytes either way. `check`
    sees the layer read (packed or canonical) before anything is written, and may raise."""
    route = try_direct(
        layout,
        tensors,
        quant,
        backend,
        num_experts=num_experts,
        gated=gated,
        options=options,
        check=check,
    )
    if route is not None:
        return route
    return canonical(
        layout,
        tensors,
        quant,
        backend,
        num_experts=num_experts,
        gated=gated,
        options=options,
        check=check,
    )
