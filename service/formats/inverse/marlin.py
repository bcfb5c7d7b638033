"""Reference reader: MARLIN / BATCHED_MARLIN kernel tensors back to the canonical form.

Why a second inverse: the MARLIN writer builds its layout as one digit permutation of the
code tensor (writers/marlin_layout.py) and carries its own inverse (`unpack_marlin`); a
reader that reuses those functions would agree with the writer whatever the writer did. This
one is written from the other description of the same layout, the one vLLM's pure-torch
reference uses (`marlin_utils_test.marlin_weights`, `marlin_utils.marlin_permute_scales`,
`marlin_zero_points`, `marlin_permute_bias`): per expert, the K-first codes cut into 16x16
tiles laid out tile row by tile row, each run of 1024 values reordered by a fixed lane
table, then packed LSB-first into int32 words. The tables are rebuilt here from their
definition (lane i of 32 reads column i // 4 of rows 2(i % 4), 2(i % 4) + 1, 2(i % 4) + 8,
2(i % 4) + 9 in two column blocks, for four 256-value sub-tiles, then the dequantizer's
interleave), inverted, and applied. The writer's exact round trip through this reader (the
tests) therefore checks two independent formulations against each other.

It reads the layout for 16-bit activations, the one vLLM uses by default and the MARLIN
and BATCHED_MARLIN backends run: a layer written for int8 activations carries
``*_input_global_scale`` and is refused (its scales are int16 approximations); one written
for fp8 activations cannot be told apart from the tensors alone (its codes are remapped and
its scales scaled by 512), so the caller must not pass one.

Inputs: the tensors by their vLLM names (``w13_qweight``, ``w13_scales``, optional
``w13_qzeros``, ``w13_bias``, ``w13_g_idx`` + ``w13_g_idx_sort_indices`` for the sorted
act-order form, and the ``w2_`` ones), the bits, the group size (-1 channelwise) and the
layer's true intermediate size (Marlin pads it to a multiple of lcm(64, group); the padding
is dropped here). The hidden size and whether w13 is gated follow from the shapes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import torch

from service.formats.canonical import QuantizedExperts, QuantizedMoELayer
from service.formats.errors import FormatError
from service.formats.registry import MARLIN_LAYOUTS
from service.formats.writers import ConvertedLayer

TILE = 16
CHUNK = 1024
"""Values per permutation run: 4 sub-tiles of 16x16, one warp's 32 lanes x 32 values."""
_INTERLEAVE = {4: (0, 2, 4, 6, 1, 3, 5, 7), 8: (0, 2, 1, 3)}


@functools.cache
def weight_perm(bits: int) -> torch.Tensor:
    """Position p of each 1024-value run holds tiled value `weight_perm(bits)[p]`."""
    perm: list[int] = []
    for lane in range(32):
        column = lane // 4
        lane_values = [
            16 * row + column + 8 * block
            for block in (0, 1)
            for row in (
                2 * (lane % 4),
                2 * (lane % 4) + 1,
                2 * (lane % 4 + 4),
                2 * (lane % 4 + 4) + 1,
            )
        ]
        for sub_tile in range(4):
            perm += [value + 256 * sub_tile for value in lane_values]
    interleave = torch.tensor(_INTERLEAVE[bits])
    table = torch.tensor(perm).view(-1, interleave.numel())[:, interleave]
    return table.reshape(-1)


@functools.cache
def scale_perms() -> tuple[torch.Tensor, torch.Tensor]:
    """(grouped, single): position p of each run of 64 / 32 holds value perm[p]."""
    grouped = [i + 8 * j for i in range(8) for j in range(8)]
    single = [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]
    return torch.tensor(grouped), torch.tensor(single)


def _unpermute(values: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Undo ``x.reshape(-1, len(perm))[:, perm]`` along the last dimension."""
    width = perm.numel()
    if values.shape[-1] % width:
        raise FormatError("marlin", f"last dim {values.shape[-1]} is not a multiple of {width}")
    runs = values.reshape(*values.shape[:-1], -1, width)
    out = torch.empty_like(runs)
    out[..., perm.to(values.device)] = runs
    return out.reshape(values.shape)


def _unpack_lsb_first(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., W * 32/bits]: value i of a word in bits [i*bits, ...)."""
    per_word = 32 // bits
    wide = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per_word, device=words.device) * bits
    values = (wide.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(*words.shape[:-1], -1).to(torch.uint8)


def read_weight(qweight: torch.Tensor, bits: int, size_n: int, size_k: int) -> torch.Tensor:
    """Marlin int32 [E, K/16, N*16*bits/32] -> uint8 codes [E, N, K]."""
    experts = int(qweight.shape[0])
    expected = (experts, size_k // TILE, size_n * TILE * bits // 32)
    if qweight.dtype != torch.int32 or tuple(qweight.shape) != expected:
        raise FormatError("qweight", f"must be int32 {list(expected)}, got {list(qweight.shape)}")
    if size_k % TILE or size_n % 64:
        raise FormatError(
            "qweight", f"Marlin tiles need N % 64 == 0, K % 16 == 0 ({size_n}, {size_k})"
        )
    values = _unpack_lsb_first(qweight, bits)  # [E, K/16, N*16] in permuted order
    tiled = _unpermute(values, weight_perm(bits))
    # tiled[e, kt, nt*256 + kk*16 + nn] = codes[e, kt*16 + kk, nt*16 + nn] (K-first)
    blocks = tiled.view(experts, size_k // TILE, size_n // TILE, TILE, TILE)
    k_first = blocks.permute(0, 1, 3, 2, 4).reshape(experts, size_k, size_n)
    return k_first.transpose(1, 2).contiguous()


def read_scales(scales: torch.Tensor) -> torch.Tensor:
    """Marlin [E, G, N] -> canonical [E, N, G]; the 64-wide order when G > 1, else 32-wide."""
    grouped, single = scale_perms()
    return _unpermute(scales, grouped if scales.shape[1] > 1 else single).transpose(1, 2)


def read_zero_points(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """Marlin int32 [E, G, N*bits/32] -> real zero points uint8 [E, N, G]."""
    grouped, _ = scale_perms()
    values = _unpack_lsb_first(qzeros, bits)  # packed along N, LSB first
    values = _unpermute(values, torch.tensor(_INTERLEAVE[bits]))
    return _unpermute(values, grouped).transpose(1, 2)


def read_bias(bias: torch.Tensor) -> torch.Tensor:
    _, single = scale_perms()
    return _unpermute(bias, single)


def padded_intermediate(intermediate_size: int, group_size: int) -> int:
    unit = math.lcm(64, max(group_size, 1))
    return -(-intermediate_size // unit) * unit


def _projection(
    tensors: Mapping[str, torch.Tensor],
    name: str,
    *,
    bits: int,
    group_size: int,
    size_n: int,
    size_k: int,
) -> QuantizedExperts:
    def get(suffix: str) -> torch.Tensor | None:
        return tensors.get(f"{name}_{suffix}")

    weight, scales = get("qweight"), get("scales")
    if weight is None or scales is None:
        raise FormatError(f"{name}_qweight", "a MARLIN layer needs qweight and scales")
    codes = read_weight(weight, bits, size_n, size_k)
    zeros = get("qzeros")
    g_idx, sort = get("g_idx"), get("g_idx_sort_indices")
    if (g_idx is None) != (sort is None):
        raise FormatError(f"{name}_g_idx", "g_idx and g_idx_sort_indices come together")
    if g_idx is not None and sort is not None:
        # The sorted act-order form: K was reordered by `sort`; put every channel back.
        index = sort.to(torch.int64)
        codes = torch.empty_like(codes).scatter_(
            2, index.unsqueeze(1).expand(-1, codes.shape[1], -1), codes
        )
        g_idx = torch.empty_like(g_idx).scatter_(1, index, g_idx)
    bias = get("bias")
    return QuantizedExperts(
        codes=codes,
        scales=read_scales(scales).contiguous(),
        bits=bits,
        group_size=group_size,
        zeros=None if zeros is None else read_zero_points(zeros, bits).contiguous(),
        g_idx=g_idx,
        bias=None if bias is None else read_bias(bias),
    )


def _strip(experts: QuantizedExperts, shards: int, size: int, *, along_k: bool) -> QuantizedExperts:
    """Drop Marlin's zero padding: w13's N per shard (along_k False), w2's K (True)."""
    if along_k:
        groups = 1 if experts.group_size == -1 else size // experts.group_size

        def cut_k(x: torch.Tensor, keep: int) -> torch.Tensor:
            return x.narrow(2, 0, keep).contiguous()

        return QuantizedExperts(
            codes=cut_k(experts.codes, size),
            scales=cut_k(experts.scales, groups),
            bits=experts.bits,
            group_size=experts.group_size,
            zeros=None if experts.zeros is None else cut_k(experts.zeros, groups),
            g_idx=experts.g_idx,
            bias=experts.bias,
        )

    def cut_n(x: torch.Tensor) -> torch.Tensor:
        split = x.reshape(x.shape[0], shards, -1, *x.shape[2:])
        return split.narrow(2, 0, size).flatten(1, 2).contiguous()

    return QuantizedExperts(
        codes=cut_n(experts.codes),
        scales=cut_n(experts.scales),
        bits=experts.bits,
        group_size=experts.group_size,
        zeros=None if experts.zeros is None else cut_n(experts.zeros),
        g_idx=experts.g_idx,
        bias=None if experts.bias is None else cut_n(experts.bias),
    )


def read_marlin(
    tensors: Mapping[str, torch.Tensor] | ConvertedLayer,
    *,
    intermediate_size: int,
    bits: int | None = None,
    group_size: int | None = None,
) -> QuantizedMoELayer:
    """MARLIN (or BATCHED_MARLIN) tensors -> the canonical layer they were written from.

    With a `ConvertedLayer`, bits and group size come from its descriptor.
    """
    if isinstance(tensors, ConvertedLayer):
        descriptor = tensors.descriptor
        if descriptor.backend not in MARLIN_LAYOUTS:
            raise FormatError("backend", f"reads {MARLIN_LAYOUTS}, not {descriptor.backend!r}")
        bits = descriptor.bits if bits is None else bits
        group_size = descriptor.group_size if group_size is None else group_size
        tensors = tensors.tensors
    if bits not in (4, 8) or group_size is None:
        raise FormatError("bits", f"bits must be 4 or 8 and a group size given, got {bits}")
    if any(name.endswith("_input_global_scale") for name in tensors):
        raise FormatError(
            "input_global_scale",
            "written for int8 activations (int16 relative scales): not exactly readable",
        )
    for name in ("w13_qweight", "w2_qweight"):
        if name not in tensors:
            raise FormatError(name, "missing from the MARLIN layer")
    w13_q, w2_q = tensors["w13_qweight"], tensors["w2_qweight"]
    hidden = int(w13_q.shape[1]) * TILE
    padded = int(w2_q.shape[1]) * TILE
    if padded != padded_intermediate(intermediate_size, group_size):
        raise FormatError(
            "intermediate_size",
            f"the tensors hold I={padded}, which is not Marlin's padding of {intermediate_size}",
        )
    w13_n = int(w13_q.shape[2]) * 32 // (bits * TILE)
    shards, rest = divmod(w13_n, padded)
    if rest or shards not in (1, 2):
        raise FormatError("w13_qweight", f"N={w13_n} is not 1 or 2 shards of {padded}")
    w13 = _projection(tensors, "w13", bits=bits, group_size=group_size, size_n=w13_n, size_k=hidden)
    w2 = _projection(tensors, "w2", bits=bits, group_size=group_size, size_n=hidden, size_k=padded)
    if padded != intermediate_size:
        w13 = _strip(w13, shards, intermediate_size, along_k=False)
        w2 = _strip(w2, 1, intermediate_size, along_k=True)
    return QuantizedMoELayer(w13=w13, w2=w2)
