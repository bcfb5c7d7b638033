"""The source layouts as data: where each tensor's axes are, which one is packed, how.

A projection (gate, up or down of every expert) is stored as a few tensors; the layouts differ
only in axis order, packed axis, word type, AWQ's in-word order, and whether zero points are
stored minus one (GPTQ v1). `SourceLayout` holds those facts and one generic decoder/encoder
uses them, so adding a layout is a table entry, not new unpacking code.

Axis letters: N output features, K input features, G scale groups. Tensors here carry a
leading expert axis E; per-expert checkpoint tensors are stacked before decoding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from service.formats import bits as packing
from service.formats.canonical import SUPPORTED_BITS, QuantizedExperts
from service.formats.errors import FormatError

Role = Literal["weight", "scales", "zeros", "g_idx", "bias", "shape"]
ROLES: tuple[Role, ...] = ("weight", "scales", "zeros", "g_idx", "bias", "shape")
Axes = tuple[str, str]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class SourceQuantization:
    """What a checkpoint's `quantization_config` says about its expert weights.

    - `bits`: 4 or 8.
    - `group_size`: input channels per scale group; -1 means one group per output channel.
    - `symmetric`: GPTQ `sym`, AWQ `not zero_point`, compressed-tensors `symmetric`,
      MoeWNA16 `not has_zp`. Symmetric weights have no stored zero point (GPTQ stores the
      midpoint anyway; we check it and drop it).
    - `desc_act`: GPTQ act-order (compressed-tensors `actorder: group`): g_idx tensors are
      then required. Without it g_idx is optional, and a stored g_idx that is the plain
      `k // group_size` is dropped.
    - `gptq_v2`: GPTQ zero points stored as is (`checkpoint_format: gptq_v2`) rather than
      minus one (v1, the AutoGPTQ default).
    """

    bits: int
    group_size: int
    symmetric: bool = True
    desc_act: bool = False
    gptq_v2: bool = False

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise FormatError("bits", f"must be one of {SUPPORTED_BITS}, got {self.bits}")
        if self.group_size != -1 and self.group_size <= 0:
            raise FormatError("group_size", f"must be positive or -1, got {self.group_size}")


@dataclass(frozen=True)
class PackedAxes:
    """A 2-D (per expert) integer tensor: its axes in storage order and how it is packed."""

    axes: Axes
    packed: str
    word: torch.dtype
    order_by_bits: Mapping[int, tuple[int, ...]] = field(default_factory=dict)

    def per_word(self, bits: int) -> int:
        return packing.codes_per_word(bits, self.word)

    def order(self, bits: int) -> tuple[int, ...] | None:
        return self.order_by_bits.get(bits)


@dataclass(frozen=True)
class SourceLayout:
    """One checkpoint (or vLLM integration) layout of a projection's tensors."""

    name: str
    weight: PackedAxes
    zeros: PackedAxes
    scales: Axes
    names: Mapping[Role, str]
    zero_stored_minus_one: bool = False
    """GPTQ v1: the stored zero point is the real one minus one."""
    zeros_stored_when_symmetric: bool = False
    """GPTQ writes the midpoint (minus one) even for symmetric weights."""
    g_idx_always_stored: bool = False
    """GPTQ writes the trivial g_idx even without act-order."""
    signed_when_symmetric: bool = False
    """Quark stores symmetric weights as two's-complement codes: the canonical (offset)
    code is the stored one with its top bit flipped, as vLLM's Quark loader flips it."""
    zeros_ignored_when_symmetric: bool = False
    """Quark exports may carry zero points for symmetric weights; vLLM loads and never
    reads them, so they are dropped unchecked."""
    supported_bits: tuple[int, ...] = SUPPORTED_BITS

    @property
    def roles(self) -> tuple[Role, ...]:
        return tuple(role for role in ROLES if role in self.names)

    def role_of(self, suffix: str) -> Role | None:
        for role, name in self.names.items():
            if name == suffix:
                return role
        return None

    def minus_one(self, quant: SourceQuantization) -> bool:
        return self.zero_stored_minus_one and not quant.gptq_v2

    # -- shapes ---------------------------------------------------------------------------

    def check_shape(self, quant: SourceQuantization, n: int, k: int) -> None:
        """The rules a projection of `n` outputs and `k` inputs meets to be stored in this
        layout, checked before any tensor exists: its bits, a group that divides K, and
        every packed axis whole words. `FormatError.field` names the rule's axis: "bits",
        "group_size", "N", "K" or "G"."""
        if quant.bits not in self.supported_bits:
            raise FormatError("bits", f"{self.name} stores {self.supported_bits}-bit weights only")
        if quant.group_size != -1 and k % quant.group_size:
            raise FormatError(
                "group_size", f"{quant.group_size} does not divide K={k} (use -1 for channelwise)"
            )
        groups = 1 if quant.group_size == -1 else k // quant.group_size
        dims = {"N": n, "K": k, "G": groups}
        for spec in (self.weight, self.zeros):
            per_word = spec.per_word(quant.bits)
            if dims[spec.packed] % per_word:
                raise FormatError(
                    spec.packed,
                    f"{spec.packed}={dims[spec.packed]} is not a multiple of {per_word}, "
                    f"the {quant.bits}-bit codes per {self.name} word",
                )

    def dims_from_weight(
        self, shape: tuple[int, ...], bits: int, field_name: str
    ) -> tuple[int, int]:
        """(N, K) of a projection from its packed weight's per-expert shape [a, b]."""
        if len(shape) != 2:
            raise FormatError(field_name, f"must be 2-D per expert, got shape {list(shape)}")
        sizes = dict(zip(self.weight.axes, shape, strict=True))
        sizes[self.weight.packed] *= self.weight.per_word(bits)
        return sizes["N"], sizes["K"]

    def expected_shape(self, role: Role, dims: Mapping[str, int], bits: int) -> tuple[int, ...]:
        if role in ("weight", "zeros"):
            spec = self.weight if role == "weight" else self.zeros
            out = []
            for axis in spec.axes:
                size = dims[axis]
                if axis == spec.packed:
                    size //= spec.per_word(bits)
                out.append(size)
            return tuple(out)
        if role == "scales":
            return tuple(dims[axis] for axis in self.scales)
        if role == "g_idx":
            return (dims["K"],)
        if role == "bias":
            return (dims["N"],)
        return (2,)

    def check(
        self,
        role: Role,
        tensor: torch.Tensor,
        dims: Mapping[str, int],
        bits: int,
        field_name: str,
        *,
        batch: int | None = None,
    ) -> None:
        """Raise FormatError unless `tensor` has the dtype and shape `role` needs.

        `batch` is the expert count when the tensor is stacked ([E, ...]), None per expert.
        """
        if role in ("weight", "zeros"):
            spec = self.weight if role == "weight" else self.zeros
            if spec.packed == "N" and dims["N"] % spec.per_word(bits):
                raise FormatError(
                    field_name,
                    f"N={dims['N']} is not a multiple of {spec.per_word(bits)} "
                    f"(codes per {spec.word} word at {bits} bits)",
                )
            allowed: tuple[torch.dtype, ...] = (spec.word,)
        elif role in ("scales", "bias"):
            allowed = FLOAT_DTYPES
        elif role == "g_idx":
            allowed = INDEX_DTYPES
        else:
            allowed = (*INDEX_DTYPES, torch.float32)
        if tensor.dtype not in allowed:
            names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
            raise FormatError(field_name, f"dtype must be {names}, got {tensor.dtype}")
        shape = self.expected_shape(role, dims, bits)
        if batch is not None:
            shape = (batch, *shape)
        if tuple(tensor.shape) != shape:
            raise FormatError(
                field_name, f"shape must be {list(shape)} for {self.name}, got {list(tensor.shape)}"
            )

    # -- decode / encode ------------------------------------------------------------------

    def decode(
        self,
        parts: Mapping[Role, torch.Tensor],
        quant: SourceQuantization,
        fields: Mapping[Role, str],
    ) -> QuantizedExperts:
        """Stacked, already shape-checked tensors of one projection -> canonical form."""
        bits = quant.bits
        codes = self._flip_signed(unpack_as(self.weight, parts["weight"], bits, ("N", "K")), quant)
        scales = to_canonical(parts["scales"], self.scales, ("N", "G")).contiguous()
        k = int(codes.shape[2])
        groups = int(scales.shape[2])
        check_groups(quant, k, groups, fields["scales"])
        zeros = None
        stored = parts.get("zeros")
        if quant.symmetric and self.zeros_ignored_when_symmetric:
            stored = None
        if stored is not None:
            raw = unpack_as(self.zeros, stored, bits, ("N", "G"))
            zeros = self.real_zeros(raw, quant, fields["zeros"])
        g_idx = None
        if "g_idx" in parts:
            g_idx = decode_g_idx(parts["g_idx"], quant, k, groups, fields["g_idx"])
        bias = parts.get("bias")
        return QuantizedExperts(
            codes=codes,
            scales=scales,
            bits=bits,
            group_size=quant.group_size,
            zeros=zeros,
            g_idx=g_idx,
            bias=None if bias is None else bias.contiguous(),
        )

    def _flip_signed(self, codes: torch.Tensor, quant: SourceQuantization) -> torch.Tensor:
        """Two's-complement codes <-> offset codes (the same flip both ways)."""
        if not (self.signed_when_symmetric and quant.symmetric):
            return codes
        return codes ^ (1 << (quant.bits - 1))

    def real_zeros(
        self, raw: torch.Tensor, quant: SourceQuantization, field_name: str
    ) -> torch.Tensor | None:
        limit = (1 << quant.bits) - 1
        if quant.symmetric:
            midpoint = 1 << (quant.bits - 1)
            expected = midpoint - 1 if self.minus_one(quant) else midpoint
            if bool((raw != expected).any()):
                raise FormatError(
                    field_name,
                    f"declared symmetric, but stores zero points other than {expected}",
                )
            return None
        if self.minus_one(quant):
            if bool((raw == limit).any()):
                raise FormatError(
                    field_name,
                    f"a stored GPTQ v1 zero point of {limit} means {limit + 1}, which no "
                    f"{quant.bits}-bit kernel can represent",
                )
            return (raw + 1).contiguous()
        return raw.contiguous()

    def encode(
        self, experts: QuantizedExperts, quant: SourceQuantization
    ) -> dict[Role, torch.Tensor]:
        """Canonical -> stacked tensors of this layout (inverse of `decode`)."""
        bits = experts.bits
        if bits not in self.supported_bits:
            raise FormatError("bits", f"{self.name} stores {self.supported_bits}-bit weights only")
        dims = {"N": experts.n, "K": experts.k, "G": experts.num_groups}
        _check_packable(self.weight, dims, bits, self.names["weight"])
        out: dict[Role, torch.Tensor] = {}
        codes = self._flip_signed(experts.codes, quant)
        out["weight"] = _pack_as(self.weight, codes, bits, ("N", "K"))
        out["scales"] = _from_canonical(experts.scales, ("N", "G"), self.scales).contiguous()
        stored = None
        if experts.zeros is not None:
            if self.minus_one(quant) and bool((experts.zeros == 0).any()):
                raise FormatError(
                    self.names["zeros"], "GPTQ v1 stores zero point minus one: 0 cannot be stored"
                )
            stored = experts.zeros - 1 if self.minus_one(quant) else experts.zeros
        elif self.zeros_stored_when_symmetric:
            midpoint = 1 << (bits - 1)
            value = midpoint - 1 if self.minus_one(quant) else midpoint
            stored = torch.full_like(experts.scales, value, dtype=torch.uint8)
        if stored is not None:
            _check_packable(self.zeros, dims, bits, self.names["zeros"])
            out["zeros"] = _pack_as(self.zeros, stored, bits, ("N", "G"))
        if experts.g_idx is not None and "g_idx" not in self.names:
            raise FormatError("g_idx", f"{self.name} has no act-order (g_idx) tensor")
        if "g_idx" in self.names and (
            experts.g_idx is not None or self.g_idx_always_stored or quant.desc_act
        ):
            out["g_idx"] = experts.group_index().to(torch.int32).contiguous()
        if experts.bias is not None:
            if "bias" not in self.names:
                raise FormatError("bias", f"{self.name} has no expert bias tensor")
            out["bias"] = experts.bias.contiguous()
        if "shape" in self.names:
            shape = torch.tensor(
                [experts.n, experts.k], dtype=torch.int64, device=experts.codes.device
            )
            out["shape"] = shape.unsqueeze(0).expand(experts.num_experts, 2).contiguous()
        return out


def _check_packable(spec: PackedAxes, dims: Mapping[str, int], bits: int, name: str) -> None:
    if dims[spec.packed] % spec.per_word(bits):
        raise FormatError(
            name,
            f"{spec.packed}={dims[spec.packed]} is not a multiple of {spec.per_word(bits)}, "
            f"the {bits}-bit codes per {spec.word} word",
        )


def unpack_as(spec: PackedAxes, stored: torch.Tensor, bits: int, target: Axes) -> torch.Tensor:
    """[E, a, b] words in `spec`'s storage order -> contiguous uint8 codes [E, *target].

    Only the words are ever transposed (a view; they are 1/2 to 1/8 of the codes' bytes):
    unpacking then writes the codes in their final order.
    """
    words = stored if spec.axes == target else stored.transpose(1, 2)
    return packing.unpack(words, bits, 1 + target.index(spec.packed), spec.order(bits))


def _pack_as(spec: PackedAxes, codes: torch.Tensor, bits: int, source: Axes) -> torch.Tensor:
    """Inverse of `unpack_as`: uint8 codes [E, *source] -> words in `spec`'s storage order."""
    words = packing.pack(codes, bits, 1 + source.index(spec.packed), spec.word, spec.order(bits))
    return words if spec.axes == source else words.transpose(1, 2).contiguous()


def to_canonical(tensor: torch.Tensor, axes: Axes, target: Axes) -> torch.Tensor:
    """[E, a, b] stored in `axes` order -> [E, target[0], target[1]]."""
    return tensor if axes == target else tensor.transpose(1, 2)


def _from_canonical(tensor: torch.Tensor, source: Axes, axes: Axes) -> torch.Tensor:
    return tensor if axes == source else tensor.transpose(1, 2).contiguous()


def check_groups(quant: SourceQuantization, k: int, groups: int, field_name: str) -> None:
    if quant.group_size == -1:
        expected = 1
    else:
        if k % quant.group_size:
            raise FormatError(
                "group_size", f"{quant.group_size} does not divide K={k} (use -1 for channelwise)"
            )
        expected = k // quant.group_size
    if groups != expected:
        raise FormatError(
            field_name,
            f"has {groups} groups, but K={k} with group_size {quant.group_size} needs {expected}",
        )


def decode_g_idx(
    g_idx: torch.Tensor, quant: SourceQuantization, k: int, groups: int, field_name: str
) -> torch.Tensor | None:
    """Stored group indices -> canonical int32 [E, K], or None when they add nothing."""
    values = g_idx.to(torch.int64)
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= groups):
        raise FormatError(field_name, f"group indices must lie in [0, {groups})")
    size = k if quant.group_size == -1 else quant.group_size
    trivial = torch.arange(k, device=g_idx.device) // size
    if bool((values == trivial).all()):
        return None
    return values.to(torch.int32).contiguous()


GPTQ = SourceLayout(
    name="gptq",
    weight=PackedAxes(("K", "N"), "K", torch.int32),
    zeros=PackedAxes(("G", "N"), "N", torch.int32),
    scales=("G", "N"),
    names={
        "weight": "qweight",
        "scales": "scales",
        "zeros": "qzeros",
        "g_idx": "g_idx",
        "bias": "bias",
    },
    zero_stored_minus_one=True,
    zeros_stored_when_symmetric=True,
    g_idx_always_stored=True,
)

_AWQ_ORDERS = {4: packing.AWQ_ORDER_4BIT, 8: packing.AWQ_ORDER_8BIT}

AWQ = SourceLayout(
    name="awq",
    weight=PackedAxes(("K", "N"), "N", torch.int32, _AWQ_ORDERS),
    zeros=PackedAxes(("G", "N"), "N", torch.int32, _AWQ_ORDERS),
    scales=("G", "N"),
    names={"weight": "qweight", "scales": "scales", "zeros": "qzeros", "bias": "bias"},
)

COMPRESSED_TENSORS = SourceLayout(
    name="compressed-tensors",
    weight=PackedAxes(("N", "K"), "K", torch.int32),
    zeros=PackedAxes(("N", "G"), "N", torch.int32),
    scales=("N", "G"),
    names={
        "weight": "weight_packed",
        "scales": "weight_scale",
        "zeros": "weight_zero_point",
        "g_idx": "weight_g_idx",
        "bias": "bias",
        "shape": "weight_shape",
    },
)

MOE_WNA16 = SourceLayout(
    name="moe_wna16",
    weight=PackedAxes(("N", "K"), "K", torch.uint8),
    zeros=PackedAxes(("N", "G"), "N", torch.uint8),
    scales=("N", "G"),
    names={"weight": "qweight", "scales": "scales", "zeros": "qzeros", "bias": "bias"},
)

_QUARK_NAMES: Mapping[Role, str] = {
    "weight": "weight",
    "scales": "weight_scale",
    "zeros": "weight_zero_point",
}

QUARK = SourceLayout(
    name="quark",
    weight=PackedAxes(("K", "N"), "N", torch.int32, {4: packing.AWQ_ORDER_4BIT}),
    zeros=PackedAxes(("G", "N"), "N", torch.int32, {4: packing.AWQ_ORDER_4BIT}),
    scales=("G", "N"),
    names=_QUARK_NAMES,
    signed_when_symmetric=True,
    zeros_ignored_when_symmetric=True,
    supported_bits=(4,),
)
"""AMD Quark's int4 export with `pack_method: reorder` (AWQ's in-word order)."""

QUARK_ORDER = dataclasses.replace(
    QUARK,
    name="quark-order",
    weight=PackedAxes(("K", "N"), "N", torch.int32),
    zeros=PackedAxes(("G", "N"), "N", torch.int32),
)
"""AMD Quark's int4 export with `pack_method: order` (codes in sequence)."""

QUARK_LOADED = SourceLayout(
    name="quark-loaded",
    weight=PackedAxes(("N", "K"), "K", torch.uint8),
    zeros=PackedAxes(("N", "G"), "N", torch.uint8),
    scales=("N", "G"),
    names=_QUARK_NAMES,
    zeros_ignored_when_symmetric=True,
    supported_bits=(4,),
)
"""What vLLM's Quark loader builds from either export: MoeWNA16's N-first bytes of offset
codes, under Quark's parameter names (the layout it hands to the conversion)."""

LAYOUTS: Mapping[str, SourceLayout] = {
    layout.name: layout
    for layout in (GPTQ, AWQ, COMPRESSED_TENSORS, MOE_WNA16, QUARK, QUARK_ORDER, QUARK_LOADED)
}
