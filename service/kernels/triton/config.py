"""How our Triton WNA16 kernel is launched: the tile types, the heuristics, the decode choice.

A forward runs either the prefill kernels (an alignment of routes by expert, then two
tensor-core GEMMs over blocks of BLOCK_M routes: `prefill.py`, or `prefill_rs.py` with the
weights as wgmma's register operand, on our re-laid-out weights) or the decode kernels (one
program per route, split-K GEMVs, no alignment: `decode.py`). `KernelConfig` names which and
carries each GEMM's tile. The tiles come from the tuned table (`tuned.py`) where it has the
layer's shape, else from the heuristics here: `choose_config` for prefill (a table by routes
per expert), `choose_config_decode` for decode; `use_decode` says when the decode kernels are
taken (few routes per expert). The measurements behind every constant are in
bench/KERNEL_NOTES.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import triton

from service.kernels.errors import KernelUnavailableError
from service.kernels.interface import LayerSpec
from service.triton_runtime import interpreting

#: Smallest K tile: tl.dot needs K >= 16 and the int4 unpack works on whole bytes.
MIN_BLOCK_K = 16
#: Smallest K tile a compiled GEMM feeds to the tensor cores. Triton 3.6 gives the dot
#: operands (the weight one upcast from integer codes) an MMAv2 layout of kWidth 8, which
#: spans 4 x 8 = 32 inputs along K; at a K tile of 16 the layout wraps and the m16n8k16 reads
#: inputs 0-3 and 8-11 twice, 4-7 and 12-15 never (upstream fix triton-lang/triton#11691,
#: after 3.6). The launcher widens smaller tiles to this, masked, or multiplies in float32.
MMA_MIN_BLOCK_K = 32


@dataclass(frozen=True, slots=True)
class KTile:
    """The K tile a prefill GEMM is launched with and whether its dot multiplies float32. Where
    the tile does not divide K the kernels mask the last one (K and BLOCK_K are constexprs:
    the masks are compiled in only then)."""

    block_k: int
    dot_f32: bool


def _tile_fits_groups(block_k: int, k: int, group: int) -> bool:
    """Whether `_dequant_tile` reads the right scales for every valid input of every tile:
    the group spans whole tiles, or the tile whole groups, or one group spans all of K
    (channelwise: the masked tail is still in group 0)."""
    return group >= k or group % block_k == 0 or block_k % group == 0


def launch_k_tile(block_k: int, k: int, group: int, interpreted: bool | None = None) -> KTile:
    """The K tile to launch for a configured `block_k` (heuristic, tuned table or caller's
    config, swap-AB or not: every launch goes through here).

    A tile below `MMA_MIN_BLOCK_K` is widened to it where the groups allow, its tail masked
    (layers whose K is an odd multiple of 16: the wasted half tile costs far less than giving
    up the tensor cores); where they do not (a group such as 48 that neither nests in nor
    holds 32), the tile stays and the dot takes float32 operands (FMA, no MMA: the
    interpreter's arithmetic). Under the interpreter (`interpreted` None: whether this
    process interprets) the dot is always float32: it multiplies 16-bit operands as integers.
    """
    if interpreted is None:
        interpreted = interpreting()
    if block_k < MMA_MIN_BLOCK_K and _tile_fits_groups(MMA_MIN_BLOCK_K, k, group):
        block_k = MMA_MIN_BLOCK_K
    return KTile(block_k, interpreted or block_k < MMA_MIN_BLOCK_K)


@dataclass(frozen=True, slots=True)
class GemmTile:
    """One GEMM's tile: N and K extents, warps, pipeline depth, K splits, (prefill) whether
    to compute the transposed tile (weights as the MMA's left operand), and (prefill_rs,
    always transposed) whether the group scale multiplies each K step's float32 partial
    product rather than every weight."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    swap_ab: bool = False
    scale_after: bool = True


#: `KernelConfig.kernel` values: the aligned tensor-core kernels (`prefill.py`), the aligned
#: kernels with the weights as wgmma's register operand on our re-laid-out weights
#: (`prefill_rs.py`), or the per-route GEMVs (`decode.py`).
PREFILL, PREFILL_RS, DECODE = "prefill", "prefill_rs", "decode"
KERNELS = (PREFILL, PREFILL_RS, DECODE)


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """Which kernels run (`kernel`: one of `KERNELS`) and each GEMM's tile.

    `block_m` is the prefill kernels' block of routes (shared by both GEMMs: they read one
    alignment); the decode kernels ignore it and use each tile's `split_k`.
    """

    block_m: int
    w13: GemmTile
    w2: GemmTile
    kernel: str = PREFILL


@dataclass(frozen=True, slots=True)
class _ConfigRow:
    """Guessed tiles for a band of routes per active expert (until the tuner ships data)."""

    max_routes_per_expert: float
    block_m: int
    w13: GemmTile
    w2: GemmTile


#: Chosen on an H200 with bench/kernel_check.py --sweep (bench/KERNEL_NOTES.md has the
#: figures). Few routes per expert: swap-AB (the weights fill wgmma's 64-row side, read
#: from registers); many: the plain orientation, 128-row token blocks, 8 warps.
_CONFIG_TABLE = (
    _ConfigRow(6, 16, GemmTile(64, 128, 4, 4, swap_ab=True), GemmTile(64, 128, 4, 4, swap_ab=True)),
    _ConfigRow(
        40, 32, GemmTile(64, 128, 4, 4, swap_ab=True), GemmTile(64, 128, 4, 4, swap_ab=True)
    ),
    _ConfigRow(160, 64, GemmTile(64, 128, 4, 3), GemmTile(128, 64, 4, 3)),
    _ConfigRow(float("inf"), 128, GemmTile(64, 64, 8, 4), GemmTile(128, 64, 8, 4)),
)
#: When few (expert, 64-column) w13 tiles exist (decode on few large experts), narrower
#: plain tiles give the GPU more programs (measured faster than 64-wide swap-AB tiles on few
#: large experts: bench/KERNEL_NOTES.md, version 3).
_NARROW_W13 = GemmTile(32, 128, 4, 4)
#: Programs per SM the w13 grid should reach before swap-AB's 64-wide tiles are used, and
#: that split-K raises the w2 grid to.
_PROGRAMS_PER_SM = 4
#: Largest token block whose w2 may be split along K.
_SPLIT_K_MAX_BLOCK_M = 32


def fit_block_k(block_k: int, k: int, group: int) -> int:
    """The largest power-of-two K tile <= block_k that divides K and nests with the group
    (the group spans whole tiles, or the tile whole groups)."""
    bk = block_k
    while bk > MIN_BLOCK_K and (k % bk or (group % bk and bk % group)):
        bk //= 2
    if k % bk or (group % bk and bk % group):
        raise KernelUnavailableError(
            "TRITON", f"K={k} with group {group} has no K tile of at least {MIN_BLOCK_K}"
        )
    return bk


def choose_config(num_tokens: int, top_k: int, spec: LayerSpec, num_sms: int) -> KernelConfig:
    """Tiles for this token count: BLOCK_M by routes per active expert, K tiles fitted to
    the layer, narrow w13 tiles when wide ones would leave the GPU short of programs, and
    enough w2 K splits to give it about `_PROGRAMS_PER_SM` programs per SM."""
    routes = num_tokens * top_k
    active = max(1, min(spec.num_experts, routes))
    per_expert = routes / active
    row = next(r for r in _CONFIG_TABLE if per_expert <= r.max_routes_per_expert)
    h, i = spec.hidden_size, spec.intermediate_size
    g13 = h if spec.group_size == -1 else spec.group_size
    g2 = i if spec.group_size == -1 else spec.group_size
    scale = 2 if spec.bits == 8 else 1  # same bytes per tile row for int8
    target = _PROGRAMS_PER_SM * num_sms
    blocks = max(active, triton.cdiv(routes, row.block_m))
    w13_tile = row.w13
    if w13_tile.swap_ab and blocks * triton.cdiv(i, w13_tile.block_n) < target:
        w13_tile = _NARROW_W13
    w13 = replace(
        w13_tile,
        block_n=min(w13_tile.block_n, triton.next_power_of_2(i)),
        block_k=fit_block_k(max(MIN_BLOCK_K, w13_tile.block_k // scale), h, g13),
    )
    bk2 = fit_block_k(max(MIN_BLOCK_K, row.w2.block_k // scale), i, g2)
    bn2 = min(row.w2.block_n, triton.next_power_of_2(h))
    programs = blocks * triton.cdiv(h, bn2)
    split = 1
    # Split-K only where the bytes bound (small blocks): at 64 routes per expert splitting
    # w2 measured slower (bench/KERNEL_NOTES.md, version 3).
    while (
        row.block_m <= _SPLIT_K_MAX_BLOCK_M
        and split * 2 <= i // bk2
        and programs * split * 2 <= target
    ):
        split *= 2
    w2 = replace(row.w2, block_n=bn2, block_k=bk2, split_k=split)
    return KernelConfig(row.block_m, w13, w2)


# --- decode ---------------------------------------------------------------------------------

#: Most routes (M·k) the decode variant is chosen for by `use_decode`: past it experts are
#: shared by many routes and re-reading their tiles per route (even from L2) costs more
#: than the aligned paths' alignment.
DECODE_MAX_ROUTES = 64
#: Programs per SM the split-K choice aims each GEMM at. 8 (~8 programs x 8 KB in flight
#: per SM) was the prediction; the H200 sweep (bench/KERNEL_NOTES.md, "Version 5",
#: measured) found 4 faster: fewer splits mean fewer partial read-backs in the last arriver.
DECODE_PROGRAMS_PER_SM = 4
#: The K tile the heuristic starts from (fitted to K and the group); >= 32 like every
#: compiled K tile of this package, though no tensor-core dot is involved here.
DECODE_BLOCK_K = 256


#: Most routes per distinct expert (expected, uniform routing) the dispatcher accepts: each
#: route dequantizes its expert's tiles again (the bytes may come from L2, the ALU work
#: does not), so where many tokens share experts the aligned paths, which dequantize once
#: per block of routes, win. The H200 put the crossover between 1.46 and 1.6 routes per
#: expert (bench/KERNEL_NOTES.md, "Version 5").
DECODE_MAX_SHARING = 1.5


def use_decode(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether the dispatcher takes the decode kernels (over the tuned table and the prefill
    heuristic): M·k <= DECODE_MAX_ROUTES and at most DECODE_MAX_SHARING routes per expected
    distinct expert (uniform routing), where the H200 measured them faster."""
    routes = num_tokens * top_k
    distinct = num_experts * (1 - (1 - min(top_k, num_experts) / num_experts) ** num_tokens)
    return routes <= DECODE_MAX_ROUTES and routes <= DECODE_MAX_SHARING * max(distinct, 1.0)


def _splits(k: int, block_k: int, programs: int, target: int) -> int:
    """K splits raising `programs` towards `target`, each split a whole number of K tiles."""
    steps = k // block_k
    want = max(1, min(steps, -(-target // max(programs, 1))))
    span = max(1, steps // want)  # round towards more programs
    return -(-steps // span)


def choose_config_decode(
    num_tokens: int, top_k: int, spec: LayerSpec, num_sms: int
) -> KernelConfig:
    """The untuned decode tiles: 32 intermediate columns (gate + up: 64 weight rows) and 64
    hidden columns per program, 256-wide K tiles (128 for int8: the same bytes per row),
    and K splits up to `DECODE_PROGRAMS_PER_SM` programs per SM in each GEMM."""
    routes = num_tokens * top_k
    h, i = spec.hidden_size, spec.intermediate_size
    g13 = h if spec.group_size == -1 else spec.group_size
    g2 = i if spec.group_size == -1 else spec.group_size
    base_k = DECODE_BLOCK_K // (2 if spec.bits == 8 else 1)
    target = DECODE_PROGRAMS_PER_SM * num_sms
    bn1 = min(32, triton.next_power_of_2(i))
    bk1 = fit_block_k(base_k, h, g13)
    s1 = _splits(h, bk1, routes * triton.cdiv(i, bn1), target)
    bn2 = min(64, triton.next_power_of_2(h))
    bk2 = fit_block_k(base_k, i, g2)
    s2 = _splits(i, bk2, routes * triton.cdiv(h, bn2), target)
    return KernelConfig(
        1,
        GemmTile(bn1, bk1, 4, 2, split_k=s1),
        GemmTile(bn2, bk2, 4, 2, split_k=s2),
        kernel=DECODE,
    )


# --- prefill_rs ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _RsRow:
    """Register-operand prefill tiles for a band of routes per active expert: the token
    block (wgmma's N) and each GEMM's weight-row tile (64 rows per warpgroup)."""

    max_routes_per_expert: float
    block_m: int
    w13: GemmTile
    w2: GemmTile


#: Untuned starting points (the tuned table overrides them per measured point): token blocks
#: that fit the routes per expert, 64 weight rows per warpgroup, 128-input K steps.
_RS_TABLE = (
    _RsRow(16, 16, GemmTile(64, 128, 4, 4), GemmTile(64, 128, 4, 4)),
    _RsRow(32, 32, GemmTile(64, 128, 4, 4), GemmTile(64, 128, 4, 4)),
    _RsRow(96, 64, GemmTile(64, 128, 4, 3), GemmTile(64, 128, 4, 3)),
    _RsRow(
        float("inf"),
        128,
        GemmTile(128, 64, 8, 3, scale_after=False),
        GemmTile(128, 64, 8, 3, scale_after=False),
    ),
)


def choose_config_rs(num_tokens: int, top_k: int, spec: LayerSpec, num_sms: int) -> KernelConfig:
    """Untuned tiles for the register-operand prefill kernels: the token block by routes per
    active expert, and w2 K splits (token blocks of <= 32) up to `_PROGRAMS_PER_SM` programs
    per SM. K steps are fitted to the layer and its groups by the launcher."""
    routes = num_tokens * top_k
    active = max(1, min(spec.num_experts, routes))
    row = next(r for r in _RS_TABLE if routes / active <= r.max_routes_per_expert)
    blocks = max(active, triton.cdiv(routes, row.block_m))
    programs = blocks * triton.cdiv(spec.hidden_size, row.w2.block_n)
    steps = spec.intermediate_size // row.w2.block_k
    split = 1
    while (
        row.block_m <= _SPLIT_K_MAX_BLOCK_M
        and split * 2 <= steps
        and programs * split * 2 <= _PROGRAMS_PER_SM * num_sms
    ):
        split *= 2
    return KernelConfig(row.block_m, row.w13, replace(row.w2, split_k=split), kernel=PREFILL_RS)
