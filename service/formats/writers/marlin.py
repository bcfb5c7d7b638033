"""MARLIN and BATCHED_MARLIN: the layout vLLM's Marlin MoE GEMM (`moe_wna16_marlin_gemm`) reads.

Both backends run the same kernel (BATCHED_MARLIN only batches tokens differently), so both
get the same tensors, those of vLLM 0.33.0's `convert_to_wna16_moe_kernel_format`:

- ``*_qweight`` int32 [E, K/16, N*16*bits/32]: the codes in Marlin's tile order
  (`marlin_layout.repack_weights`; vLLM's CUDA `gptq_marlin_moe_repack`/`awq_marlin_moe_repack`).
- ``*_scales`` [E, G, N] (K-first), in the 64-wide grouped order when the kernel sees more
  than one group, else the 32-wide channelwise order; with int8 activations, grouped scales
  are rescaled to int16 (stored in the scale dtype's bits) and ``*_input_global_scale``
  holds the float32 factor back.
- ``*_qzeros`` (zero points only) int32 [E, G, N*bits/32]: real zero points, grouped
  order plus the dequantizer's interleave, packed along N.
- ``*_bias`` [E, N] in the channelwise order.

`ConversionOptions.activation_dtype` picks the activation path (`VLLM_MARLIN_INPUT_DTYPE`):
16-bit (the default); int8 (32x32 weight tiles, channelwise scale order, no zero-point
interleave, int16 scales); fp8 (the same 8-bit layouts, int4 codes q remapped to q - z or
15 - q around their zero point z, 8 when symmetric, and scales times 512).

The intermediate size I is zero-padded to ``round_up(I, lcm(64, group))`` exactly where vLLM
pads (`marlin_moe_padded_intermediate`): w13's gate and up shards each get padded output
channels (codes, scales, zero points and bias all zero, so those outputs are zero), w2 gets
padded input channels. `unpack_marlin` inverts all of it.

Where we depart from vLLM 0.33.0 (each checked by the exactness tests):

- vLLM chooses the scale order for w13 with ``size_k = I`` (and for AWQ's w2 with the unpadded
  I) instead of the GEMM's real K. The kernel decides by the real group count, so when
  I == group_size < H, or H == group_size < I, vLLM's w13 scales are in the wrong order; we use
  the group count the kernel sees. The same holds for which int8-activation scales get the
  int16 treatment.
- vLLM 0.30 and later have no act-order Marlin MoE (GPTQ ``desc_act`` and
  compressed-tensors ``actorder=group`` are refused at config time, and the GEMM takes no
  g_idx). For a ruleset whose release still accepts act-order
  (`IntegrationRules.act_order_supported`: 0.29 and older) act-order layers get that
  release's form, as its `gptq_marlin_moe_repack(b_q_weight, perm, ...)` writes it: K sorted
  by group per expert (a stable argsort of g_idx), with ``*_g_idx`` (sorted) and
  ``*_g_idx_sort_indices`` int32 [E, K], and no intermediate-size padding. Other rulesets
  refuse them, unless ``options.extra["act_order"] == "sort"`` asks for that form anyway
  (``"reject"`` refuses them whatever the ruleset).
- vLLM's padding helper views w13 as two shards, so a non-gated layer that needs padding
  crashes there; we pad the one shard.
- GPTQ symmetric checkpoints carry v1 zero points that vLLM converts but the kernel never
  reads; we write none.
- With fp8 activations vLLM's GPTQ/compressed-tensors path remaps codes around 8 even when
  the layer has zero points; we remap around the zero point, as its AWQ path does for the
  same zero-point kernel type.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from service.formats.canonical import QuantizedExperts, QuantizedMoELayer
from service.formats.errors import ConversionUnsupported, FormatError
from service.formats.writers import ConversionOptions, ConvertedLayer, Writer, finish, weight_type
from service.formats.writers import marlin_layout as layout
from service.oracle import DEFAULT_RULESET
from service.oracle.rulesets import RULESETS, get_ruleset

MARLIN_GROUP_SIZES = (-1, 32, 64, 128)
"""Group sizes vLLM's Marlin MoE accepts (`check_moe_marlin_supports_config`)."""

_INT8_SCALE_RANGE = 4096.0
"""vLLM's `marlin_act_int8_process_scales` maps the largest scale to this int16 value."""

_ACT_ORDER_OPTION = "act_order"


def padded_intermediate(intermediate_size: int, group_size: int) -> int:
    """vLLM's `marlin_moe_padded_intermediate`: round I up to lcm(64, group)."""
    unit = math.lcm(64, max(group_size, 1))
    return -(-intermediate_size // unit) * unit


@dataclass(frozen=True)
class _ActivationPath:
    """How the activation dtype the kernel will see changes the weights' layout.

    - `a8`: 8-bit activations: the 32x32 weight tiles, the channelwise scale order for every
      group size and no zero-point interleave;
    - `int8_scales`: grouped scales as int16 relative to their maximum plus a global factor
      (`marlin_act_int8_process_scales`);
    - `fp8`: int4 codes remapped for fp8 arithmetic (`marlin_int4_fp8_preprocess`) and scales
      times 512.
    """

    a8: bool = False
    int8_scales: bool = False
    fp8: bool = False


_A16 = _ActivationPath()
_ACTIVATION_PATHS: dict[torch.dtype | None, _ActivationPath] = {
    None: _A16,
    torch.float16: _A16,
    torch.bfloat16: _A16,
    torch.int8: _ActivationPath(a8=True, int8_scales=True),
    torch.float8_e4m3fn: _ActivationPath(a8=True, fp8=True),
}

_FP8_SCALE_FACTOR = 512
"""vLLM multiplies Marlin's scales by 512 for fp8 activations (undone by the fp8 dequant)."""


def _activation_path(activation_dtype: torch.dtype | None, backend: str) -> _ActivationPath:
    path = _ACTIVATION_PATHS.get(activation_dtype)
    if path is None:
        raise ConversionUnsupported(backend, f"no Marlin path for {activation_dtype} activations")
    return path


def _fp8_codes(experts: QuantizedExperts) -> torch.Tensor:
    """`marlin_int4_fp8_preprocess`: code q with zero point z (8 when symmetric) becomes
    q - z when q >= z, else 15 - q (a bijection on 0..15). vLLM applies it before padding,
    so padded codes stay 0 (a zero weight in this encoding)."""
    codes = experts.codes
    if experts.zeros is None:
        zero = torch.full((), 8, dtype=torch.uint8, device=codes.device)
    else:
        index = experts.group_index().unsqueeze(1).expand(-1, experts.n, -1)
        zero = torch.gather(experts.zeros, 2, index)
    return torch.where(codes >= zero, codes - zero, 15 - codes)


def _fp8_codes_inverse(codes: torch.Tensor, zeros: torch.Tensor | None) -> torch.Tensor:
    """Inverse of `_fp8_codes` for codes whose groups are contiguous along K."""
    if zeros is None:
        zero = torch.full((), 8, dtype=torch.uint8, device=codes.device)
    else:
        zero = zeros.repeat_interleave(codes.shape[2] // zeros.shape[2], dim=2)
    return torch.where(codes <= 15 - zero, codes + zero, 15 - codes)


def _pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """Zero-pad dimension `dim` of `x` up to `size`."""
    if x.shape[dim] == size:
        return x
    shape = list(x.shape)
    shape[dim] = size
    out = x.new_zeros(shape)
    out.narrow(dim, 0, x.shape[dim]).copy_(x)
    return out


def _pad_shards(x: torch.Tensor, shards: int, size: int) -> torch.Tensor:
    """Zero-pad each of the `shards` equal parts of dimension 1 to `size`."""
    if x.shape[1] == shards * size:
        return x
    return _pad(_split_shards(x, shards), 2, size).flatten(1, 2)


def _unpad_shards(x: torch.Tensor, shards: int, size: int) -> torch.Tensor:
    return _split_shards(x, shards).narrow(2, 0, size).flatten(1, 2)


def _split_shards(x: torch.Tensor, shards: int) -> torch.Tensor:
    """View dimension 1 as (shards, rows)."""
    return x.reshape(x.shape[0], shards, -1, *x.shape[2:])


def _needs_act_order(experts: QuantizedExperts) -> bool:
    """Whether the projection has act-order: a g_idx other than k // group_size."""
    if experts.g_idx is None:
        return False
    plain = torch.arange(experts.k, device=experts.g_idx.device) // experts.effective_group_size
    return not torch.equal(experts.g_idx.to(torch.int64), plain.expand_as(experts.g_idx))


def _g_idx(experts: QuantizedExperts) -> torch.Tensor:
    """The projection's g_idx, k // group_size where it has none (the older releases load
    one for every projection of an act-order layer)."""
    if experts.g_idx is not None:
        return experts.g_idx
    plain = torch.arange(experts.k, device=experts.codes.device) // experts.effective_group_size
    return plain.to(torch.int32).expand(experts.num_experts, -1).contiguous()


def _act_order_sort(experts: QuantizedExperts, name: str) -> torch.Tensor:
    """The older releases' sort of the projection's g_idx (int64 [E, K]).

    Each expert's int32 g_idx is sorted with `torch.argsort` as those releases do (not a
    stable sort: channels of one group come in the order torch's sort gives them, which the
    kernel does not mind and the bytes do). Sorted act-order is only exact in the older
    kernel's full-K mode when every group holds exactly group_size channels.
    """
    g_idx = _g_idx(experts).to(torch.int64)
    counts = torch.zeros(
        experts.num_experts, experts.num_groups, dtype=torch.int64, device=g_idx.device
    )
    counts.scatter_add_(1, g_idx, torch.ones_like(g_idx))
    if not bool((counts == experts.effective_group_size).all()):
        raise FormatError(
            f"{name}.g_idx", "act-order needs every group to hold exactly group_size channels"
        )
    rows = _g_idx(experts).to(torch.int32)
    return torch.stack([torch.argsort(row) for row in rows]).to(torch.int64)


class _Projection:
    """One projection's Marlin tensors, built from padded (and sorted) canonical data."""

    def __init__(
        self,
        bits: int,
        *,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        bias: torch.Tensor | None,
        path: _ActivationPath,
    ) -> None:
        groups = int(scales.shape[2])
        self.qweight = layout.repack_weights(codes, bits, path.a8)
        # The kernel reads a single group (channelwise) in the 32-wide order, and so does
        # every 8-bit-activation layout.
        grouped = groups > 1 and not path.a8
        self.scales = layout.permute_scales(scales.transpose(1, 2), grouped)
        self.input_global_scale: torch.Tensor | None = None
        if path.int8_scales and groups > 1:
            self.scales, self.input_global_scale = _int8_activation_scales(self.scales)
        self.zeros = (
            None
            if zeros is None
            else layout.pack_zero_points(zeros.transpose(1, 2).contiguous(), bits, path.a8)
        )
        self.bias = None if bias is None else layout.permute_bias(bias)


def _int8_activation_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's `marlin_act_int8_process_scales`: scales relative to their maximum as int16
    (kept in the 16-bit scale dtype's bits), and that maximum / 4096 as a float32 scalar.
    The arithmetic is vLLM's, in the scale dtype, so the bits match."""
    if scales.dtype.itemsize != 2:
        raise FormatError("scales", f"int8 activations need 16-bit scales, got {scales.dtype}")
    peak = scales.max()
    global_scale = 1 / _INT8_SCALE_RANGE * peak.float()
    relative = (scales / peak * _INT8_SCALE_RANGE).round().to(torch.int16)
    return relative.view(scales.dtype), global_scale


def marlin_tensors(
    layer: QuantizedMoELayer,
    *,
    activation_dtype: torch.dtype | None = None,
    act_order: bool = False,
    backend: str = "MARLIN",
    ruleset: str = DEFAULT_RULESET,
) -> dict[str, torch.Tensor | None]:
    """The Marlin tensors of `layer`, by vLLM's parameter names (None where absent);
    act-order layers in the sorted form when `act_order`, else refused (naming `ruleset`)."""
    w13, w2 = layer.w13, layer.w2
    path = _activation_path(activation_dtype, backend)
    bits, group = w13.bits, w13.group_size
    if path.fp8 and bits != 4:
        raise ConversionUnsupported(backend, "fp8 activations take int4 weights only")
    if group != w2.group_size:
        raise FormatError("w2", f"group size {w2.group_size} differs from w13's {group}")
    if w13.symmetric != w2.symmetric:
        raise FormatError("w2.zeros", "w13 and w2 must both have zero points or neither")
    if group not in MARLIN_GROUP_SIZES:
        raise ConversionUnsupported(
            backend, f"group size {group} is not one of Marlin's {MARLIN_GROUP_SIZES}"
        )
    hidden, inter = layer.hidden_size, layer.intermediate_size
    if hidden % 128:
        raise ConversionUnsupported(backend, f"hidden size {hidden} is not a multiple of 128")
    shards, rest = divmod(w13.n, inter)
    if rest or shards not in (1, 2):
        raise FormatError("w13", f"N={w13.n} must be 1 or 2 times the intermediate size {inter}")
    padded = padded_intermediate(inter, group)

    sorts: list[torch.Tensor | None] = [None, None]
    if _needs_act_order(w13) or _needs_act_order(w2):
        if act_order:
            # as the older releases do for an act-order layer: every g_idx sorted
            sorts = [_act_order_sort(e, name) for name, e in (("w13", w13), ("w2", w2))]
        else:
            raise ConversionUnsupported(
                backend,
                f"act-order (g_idx) weights: {ruleset}'s Marlin MoE kernel takes no g_idx "
                f"(the rulesets whose release converts act-order: {act_order_rulesets()}; "
                "or set extra act_order=sort for their sorted form)",
            )
        if padded != inter:
            raise ConversionUnsupported(
                backend, f"act-order with a padded intermediate size ({inter} -> {padded})"
            )

    out: dict[str, torch.Tensor | None] = {}
    projections: dict[str, _Projection] = {}
    for name, experts, sort in (("w13", w13, sorts[0]), ("w2", w2, sorts[1])):
        codes, scales, zeros, bias = experts.codes, experts.scales, experts.zeros, experts.bias
        if path.fp8:
            codes, scales = _fp8_codes(experts), scales * _FP8_SCALE_FACTOR
        if name == "w13":
            codes = _pad_shards(codes, shards, padded)
            scales = _pad_shards(scales, shards, padded)
            zeros = None if zeros is None else _pad_shards(zeros, shards, padded)
            bias = None if bias is None else _pad_shards(bias, shards, padded)
        else:
            codes = _pad(codes, 2, padded)
            if group > 0:
                scales = _pad(scales, 2, padded // group)
                zeros = None if zeros is None else _pad(zeros, 2, padded // group)
        if sort is not None:
            index = sort.unsqueeze(1).expand(-1, codes.shape[1], -1)
            codes = torch.gather(codes, 2, index)
        projections[name] = _Projection(
            bits, codes=codes, scales=scales, zeros=zeros, bias=bias, path=path
        )
    for field in ("qweight", "scales", "zeros", "input_global_scale", "bias"):
        suffix = {"zeros": "qzeros"}.get(field, field)
        for name in ("w13", "w2"):
            out[f"{name}_{suffix}"] = getattr(projections[name], field)
    for name, experts, sort in (("w13", w13, sorts[0]), ("w2", w2, sorts[1])):
        if sort is not None:
            out[f"{name}_g_idx"] = torch.gather(_g_idx(experts), 1, sort)
            out[f"{name}_g_idx_sort_indices"] = sort.to(torch.int32)
    return out


def act_order_rulesets() -> list[str]:
    """The rulesets whose release converts act-order layers for Marlin (sorted by group)."""
    return [name for name, rules in RULESETS.items() if rules.integrations.act_order_supported]


def sorts_act_order(options: ConversionOptions) -> bool:
    """Whether act-order layers get the sorted form: ``extra["act_order"]`` when set
    ("sort" or "reject"), else whether the ruleset's release accepts act-order."""
    asked = options.extra.get(_ACT_ORDER_OPTION)
    if asked is None:
        return get_ruleset(options.ruleset).integrations.act_order_supported
    if asked not in ("reject", "sort"):
        raise FormatError(f"extra.{_ACT_ORDER_OPTION}", "must be 'reject' or 'sort'")
    return asked == "sort"


def refuse_removed_activations(options: ConversionOptions, backend: str) -> None:
    """Refuse 8-bit activations where the ruleset's release has no Marlin path for them
    (`ConversionRules.marlin_8bit_activations`: vLLM 0.34 removed `VLLM_MARLIN_INPUT_DTYPE`),
    naming the releases that have one."""
    path = _activation_path(options.activation_dtype, backend)
    if not path.a8 or get_ruleset(options.ruleset).conversions.marlin_8bit_activations:
        return
    having = [name for name, rules in RULESETS.items() if rules.conversions.marlin_8bit_activations]
    raise ConversionUnsupported(
        backend,
        f"{get_ruleset(options.ruleset).name} has no Marlin path for {options.activation_dtype} "
        f"activations (vLLM 0.34 removed VLLM_MARLIN_INPUT_DTYPE); rulesets that have one: "
        f"{having}",
    )


def _writer(backend: str) -> Writer:
    def write(
        layer: QuantizedMoELayer, *, source: str, options: ConversionOptions
    ) -> ConvertedLayer:
        refuse_removed_activations(options, backend)
        tensors = marlin_tensors(
            layer,
            activation_dtype=options.activation_dtype,
            act_order=sorts_act_order(options),
            backend=backend,
            ruleset=options.ruleset,
        )
        return finish(
            tensors,
            backend=backend,
            source=source,
            layer=layer,
            weight_type_name=weight_type(layer.w13),
            options=options,
        )

    write.__name__ = f"write_{backend.lower()}"
    write.__doc__ = f"Canonical layer -> {backend} tensors (see the module docstring)."
    return write


write_marlin = _writer("MARLIN")
write_batched_marlin = _writer("BATCHED_MARLIN")


def _unpack_projection(
    tensors: Mapping[str, torch.Tensor],
    name: str,
    *,
    bits: int,
    group_size: int,
    size_n: int,
    size_k: int,
    path: _ActivationPath,
) -> QuantizedExperts:
    codes = layout.unpack_weights(tensors[f"{name}_qweight"], bits, size_n, size_k, path.a8)
    scales = tensors[f"{name}_scales"]
    groups = int(scales.shape[1])
    gscale = tensors.get(f"{name}_input_global_scale")
    if gscale is not None:
        # int16 relative scales: only approximately the original ones.
        scales = (scales.view(torch.int16).float() * gscale).to(scales.dtype)
    scales = layout.unpermute_scales(scales, groups > 1 and not path.a8).transpose(1, 2)
    zeros = tensors.get(f"{name}_qzeros")
    if zeros is not None:
        zeros = layout.unpack_zero_points(zeros, bits, path.a8).transpose(1, 2)
    if path.fp8:
        codes = _fp8_codes_inverse(codes, zeros)
        scales = scales / _FP8_SCALE_FACTOR
    bias = tensors.get(f"{name}_bias")
    if bias is not None:
        bias = layout.unpermute_bias(bias)
    g_idx = tensors.get(f"{name}_g_idx")
    sort = tensors.get(f"{name}_g_idx_sort_indices")
    if g_idx is not None and sort is not None:
        index = sort.to(torch.int64)
        codes = torch.empty_like(codes).scatter_(
            2, index.unsqueeze(1).expand(-1, codes.shape[1], -1), codes
        )
        g_idx = torch.empty_like(g_idx).scatter_(1, index, g_idx)
    return QuantizedExperts(
        codes=codes.contiguous(),
        scales=scales.contiguous(),
        bits=bits,
        group_size=group_size,
        zeros=None if zeros is None else zeros.contiguous(),
        g_idx=g_idx,
        bias=bias,
    )


def unpack_marlin(
    tensors: Mapping[str, torch.Tensor],
    *,
    bits: int,
    group_size: int,
    intermediate_size: int,
    activation_dtype: torch.dtype | None = None,
) -> QuantizedMoELayer:
    """Marlin tensors (as `marlin_tensors` names them) -> the canonical layer, padding removed.

    Exact for 16-bit and fp8 activations; with int8 activations grouped scales come back only
    as accurately as their int16 form holds them.
    """
    path = _activation_path(activation_dtype, "MARLIN")
    w13_q, w2_q = tensors["w13_qweight"], tensors["w2_qweight"]
    hidden = int(w13_q.shape[1]) * layout.TILE
    padded = int(w2_q.shape[1]) * layout.TILE
    w13_n = int(w13_q.shape[2]) * 32 // (bits * layout.TILE)
    shards = w13_n // padded
    w13 = _unpack_projection(
        tensors, "w13", bits=bits, group_size=group_size, size_n=w13_n, size_k=hidden, path=path
    )
    w2 = _unpack_projection(
        tensors, "w2", bits=bits, group_size=group_size, size_n=hidden, size_k=padded, path=path
    )
    if padded != intermediate_size:
        w13 = _strip_w13(w13, shards, intermediate_size)
        w2 = _strip_w2(w2, intermediate_size)
    return QuantizedMoELayer(w13=w13, w2=w2)


def _strip_w13(experts: QuantizedExperts, shards: int, size: int) -> QuantizedExperts:
    return QuantizedExperts(
        codes=_unpad_shards(experts.codes, shards, size).contiguous(),
        scales=_unpad_shards(experts.scales, shards, size).contiguous(),
        bits=experts.bits,
        group_size=experts.group_size,
        zeros=None
        if experts.zeros is None
        else _unpad_shards(experts.zeros, shards, size).contiguous(),
        g_idx=experts.g_idx,
        bias=None if experts.bias is None else _unpad_shards(experts.bias, shards, size),
    )


def _strip_w2(experts: QuantizedExperts, size: int) -> QuantizedExperts:
    groups = 1 if experts.group_size == -1 else size // experts.group_size
    return QuantizedExperts(
        codes=experts.codes.narrow(2, 0, size).contiguous(),
        scales=experts.scales.narrow(2, 0, groups).contiguous(),
        bits=experts.bits,
        group_size=experts.group_size,
        zeros=None if experts.zeros is None else experts.zeros.narrow(2, 0, groups).contiguous(),
        g_idx=experts.g_idx,
        bias=experts.bias,
    )
