"""TRITON: our own fused WNA16 MoE forward in Triton, for the TRITON (vLLM) weight layout.

Two GEMM kernels and an alignment, with nothing between them that a CUDA graph cannot hold
(no host synchronisation; grids sized for the worst case, surplus programs return early):

1. `align_block_size`: routes grouped by expert in blocks of BLOCK_M (align.py).
2. `_moe_w13_kernel`: for one block of routes (one expert) and BLOCK_N intermediate
   columns, the gate tile and the up tile of x·w13ᵀ in two float32 accumulators, then bias
   and the activation in the epilogue, stored once as the [M·k, I] intermediate. No
   pre-activation [M·k, 2I] tensor is written or read back.
3. `_moe_w2_kernel`: intermediate·w2ᵀ, bias, times the router weight, and the sum over the
   k experts of each token fused in: float32 atomic adds into the [M, H] output (split-K
   partials add the same way), cast to the activation dtype at the end. With top-1 routing
   and no split-K each output row has one writer and is stored directly.

Why it should beat vLLM's `fused_moe_kernel_gptq_awq` on Hopper (issue 6):

* weights are dequantized once per tile, not per element: the packed [BLOCK_N, BLOCK_K/2]
  bytes are loaded row-contiguous (wide loads), the nibbles split with two integer ops and
  a join, and turned into exact floats with the 2^23 magic-number trick (an OR and a
  subtract, no int->float conversion instruction);
* scales and zero points are loaded once per (row, group) in the tile: a [BLOCK_N] vector
  when the group spans the K tile, a [BLOCK_N, BLOCK_K/group] tile broadcast over the group
  otherwise, never one load per element;
* `tl.dot` on 16-bit operands (wgmma where the tile allows it), float32 accumulation;
* split-K in the down projection where there are too few (block, N-tile) programs to fill
  the GPU (decode), whose partials the fused top-k reduction absorbs for free.

Tile shapes come from `choose_config` (a table by routes per expert); issue 6's tuner will
replace the guesses with measured configurations shipped as data.
"""

# Triton idiom: compile-time parameters are UPPER_CASE, kernels take many arguments and
# constexpr branches stay statements (not conditional expressions);
# @triton.jit device functions are untyped (triton has no type information).
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# ruff: noqa: N803, PLR0917, SIM108

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
import triton
import triton.language as tl

from service.formats.canonical import QuantizedMoELayer
from service.kernels.activation import ResolvedActivation
from service.kernels.align import align_block_size
from service.kernels.errors import KernelInputError, KernelUnavailableError
from service.kernels.interface import ExpertsBackend, LayerSpec, LayerTensors
from service.triton_runtime import fix_interpreter_index, interpreting, triton_unavailable_reason

PROJECTIONS = ("w13", "w2")
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
    """The K tile a v3 GEMM is launched with and whether its dot multiplies float32. Where
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
    """One GEMM's tile: N and K extents, warps, pipeline depth, K splits (w2 only), and
    whether to compute the transposed tile (weights as the MMA's left operand)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    swap_ab: bool = False
    #: v4 only: multiply the group scale into each tile's partial product instead of into
    #: every weight (taken where a K tile lies inside one group; int->float codes are exact).
    scale_after: bool = True


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """BLOCK_M (shared by both GEMMs: they read one alignment) and each GEMM's tile.

    `version` picks the kernel pair: "v3" (the design of bench/KERNEL_NOTES.md versions 1-3,
    kept selectable until v4 is measured faster everywhere), "v4" (the Hopper redesign,
    `triton_wna16_v4.py`) or "decode" (one program per route, split-K GEMVs, no alignment:
    `triton_wna16_decode.py`; BLOCK_M unused, each tile's `split_k` used). `fused_routes`
    (v4): no alignment pass; each program finds its expert and routes from `topk_ids`
    itself, and the last w2 program of each column tile writes the 16-bit output (decode:
    two launches in all).
    """

    block_m: int
    w13: GemmTile
    w2: GemmTile
    version: str = "v3"
    fused_routes: bool = False


@dataclass(frozen=True, slots=True)
class _ConfigRow:
    """Guessed tiles for a band of routes per active expert (until the tuner ships data)."""

    max_routes_per_expert: float
    block_m: int
    w13: GemmTile
    w2: GemmTile


#: Measured on an H200 with bench/kernel_check.py --sweep (bench/KERNEL_NOTES.md has the
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
#: plain tiles give the GPU more programs: Mixtral M=1 ran 152 µs so (with w2 split-K)
#: against 195 µs with 64-wide swap-AB tiles.
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
    # Split-K only where the bytes bound (decode rows): at 64 routes per expert splitting
    # w2 in two cost Mixtral 10% (1368 against 1249 µs).
    while (
        row.block_m <= _SPLIT_K_MAX_BLOCK_M
        and split * 2 <= i // bk2
        and programs * split * 2 <= target
    ):
        split *= 2
    w2 = replace(row.w2, block_n=bn2, block_k=bk2, split_k=split)
    return KernelConfig(row.block_m, w13, w2)


def choose_config_v4(num_tokens: int, top_k: int, spec: LayerSpec, num_sms: int) -> KernelConfig:
    """The untuned v4 default: v3's measured tiles; fused routes (no alignment pass) up to
    `_FUSED_DEFAULT_ROUTES` routes; the scale after the partial product for decode tiles
    (memory-bound: a multiply per weight less), in the weights for 64+ rows (the
    accumulator then stays in the wgmma chain)."""
    base = choose_config(num_tokens, top_k, spec, num_sms)
    small = base.block_m <= _SPLIT_K_MAX_BLOCK_M
    w13, w2 = replace(base.w13, scale_after=small), replace(base.w2, scale_after=small)
    if not small:
        # v3's 64+-row tiles spill in v4 (K 128 in w13, N 128 in w2; compiler report):
        # 64x64 tiles, stages as v3's.
        h, i = spec.hidden_size, spec.intermediate_size
        g13 = h if spec.group_size == -1 else spec.group_size
        g2 = i if spec.group_size == -1 else spec.group_size
        w13 = replace(w13, block_n=min(64, w13.block_n), block_k=fit_block_k(64, h, g13))
        w2 = replace(w2, block_n=min(64, w2.block_n), block_k=fit_block_k(64, i, g2))
    return KernelConfig(
        base.block_m,
        w13,
        w2,
        version="v4",
        fused_routes=num_tokens * top_k <= _FUSED_DEFAULT_ROUTES,
    )


#: Routes up to which the untuned v4 default skips the alignment pass.
_FUSED_DEFAULT_ROUTES = 64
#: Where the tuned tables live: one JSON file per device name (bench/tune_triton.py).
CONFIG_DIR = Path(__file__).with_name("triton_configs")


def config_key(spec: LayerSpec, top_k: int) -> str:
    """The tuned table's key for a layer: what the best tiles depend on."""
    return (
        f"E{spec.num_experts}_H{spec.hidden_size}_I{spec.intermediate_size}_k{top_k}"
        f"_int{spec.bits}_g{spec.group_size}"
    )


def config_file(device_name: str) -> Path:
    return CONFIG_DIR / ("".join(c if c.isalnum() else "_" for c in device_name) + ".json")


def config_to_dict(config: KernelConfig) -> dict[str, Any]:
    return asdict(config)


def config_from_dict(data: dict[str, Any]) -> KernelConfig:
    """The inverse of `config_to_dict` (unknown keys are an error: a table from a newer tuner
    must not be half-read)."""
    fields = dict(data)
    w13, w2 = GemmTile(**fields.pop("w13")), GemmTile(**fields.pop("w2"))
    return KernelConfig(w13=w13, w2=w2, **fields)


@functools.cache
def _tuned_tables(device_name: str) -> dict[str, dict[int, KernelConfig]]:
    path = config_file(device_name)
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return {
        key: {int(m): config_from_dict(cfg) for m, cfg in rows.items()}
        for key, rows in data.get("configs", {}).items()
    }


def tuned_config(
    device_name: str, spec: LayerSpec, num_tokens: int, top_k: int
) -> KernelConfig | None:
    """The shipped tuned tiles for the smallest tuned token count >= `num_tokens` (else the
    largest), K tiles refitted to the layer; None when the table has no entry."""
    rows = _tuned_tables(device_name).get(config_key(spec, top_k))
    if not rows:
        return None
    counts = sorted(rows)
    m = next((c for c in counts if c >= num_tokens), counts[-1])
    config = rows[m]
    h, i = spec.hidden_size, spec.intermediate_size
    g13 = h if spec.group_size == -1 else spec.group_size
    g2 = i if spec.group_size == -1 else spec.group_size
    return replace(
        config,
        w13=replace(config.w13, block_k=fit_block_k(config.w13.block_k, h, g13)),
        w2=replace(config.w2, block_k=fit_block_k(config.w2.block_k, i, g2)),
    )


@functools.cache
def _num_sms(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


class TritonWNA16Experts(ExpertsBackend):
    """Our fused WNA16 MoE kernel over TRITON-layout weights (int4/int8, zp, groups)."""

    name: ClassVar[str] = "TRITON"
    layouts: ClassVar[frozenset[str]] = frozenset({"TRITON"})

    def __init__(self, config: KernelConfig | None = None, *, poison_workspace: bool = False):
        """`config` pins the tiles (tests, the tuner); `poison_workspace` fills the
        intermediate with NaN before each forward, so an unwritten element shows up."""
        super().__init__()
        from service.kernels.triton_wna16_decode import DecodeWorkspace
        from service.kernels.triton_wna16_v4 import Workspace

        self._config = config
        self._poison = poison_workspace
        self._tensors: dict[str, torch.Tensor] = {}
        self._workspace = Workspace()
        self._decode_workspace = DecodeWorkspace()

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        return triton_unavailable_reason(device)

    def _prepare(self, tensors: LayerTensors, spec: LayerSpec) -> None:
        if isinstance(tensors, QuantizedMoELayer):
            raise KernelInputError("layout", "TRITON reads TRITON-layout tensors by name")
        if spec.act_order:
            raise KernelUnavailableError(
                "TRITON", "act-order (g_idx) weights are not supported by the TRITON layout"
            )
        reason = triton_unavailable_reason(tensors["w13_qweight"].device)
        if reason is not None:
            raise KernelUnavailableError("TRITON", reason)
        self._tensors = check_triton_tensors(tensors, spec)

    def _forward_into(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        activation: ResolvedActivation,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        spec, t = self.spec, self._tensors
        device = hidden_states.device
        if device != t["w13_qweight"].device:
            raise KernelInputError(
                "hidden_states", f"is on {device}, the layer on {t['w13_qweight'].device}"
            )
        m, top_k = topk_ids.shape
        config = self._config or self.config_for(m, top_k, device)
        if interpreting():
            fix_interpreter_index()
        if config.version == "decode":
            from service.kernels.triton_wna16_decode import fused_moe_decode

            return fused_moe_decode(
                hidden_states, topk_ids, topk_weights, t, spec, activation, config,
                self._decode_workspace, self._poison, out,
            )  # fmt: skip
        if config.version == "v4":
            from service.kernels.triton_wna16_v4 import fused_moe_v4

            return fused_moe_v4(
                hidden_states, topk_ids, topk_weights, t, spec, activation, config,
                self._workspace, self._poison, out,
            )  # fmt: skip
        return fused_moe(
            hidden_states, topk_ids, topk_weights, t, spec, activation, config, self._poison, out
        )

    def config_for(self, num_tokens: int, top_k: int, device: torch.device) -> KernelConfig:
        """The tiles for this token count: the tuned table shipped in triton_configs/ for
        this device and layer shape when it has one, else the v3 heuristic (or the v4 one
        when MOE_CONTROL_TRITON_VERSION=v4). Before both, the decode variant for few routes
        per expert (triton_wna16_decode.py `use_decode`; MOE_CONTROL_TRITON_DECODE=0 turns
        it off)."""
        spec = self.spec
        num_sms = 4 if device.type != "cuda" else _num_sms(device.index or 0)
        from service.kernels.triton_wna16_decode import choose_config_decode, use_decode

        if use_decode(num_tokens, top_k, spec.num_experts):
            return choose_config_decode(num_tokens, top_k, spec, num_sms)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        tuned = tuned_config(name, spec, num_tokens, top_k)
        if tuned is not None:
            return tuned
        if os.environ.get("MOE_CONTROL_TRITON_VERSION", "v3") == "v4":
            return choose_config_v4(num_tokens, top_k, spec, num_sms)
        return choose_config(num_tokens, top_k, spec, num_sms)


def check_triton_tensors(tensors: LayerTensors, spec: LayerSpec) -> dict[str, torch.Tensor]:
    """The TRITON-layout tensors, checked against the descriptor (dtype, shape, device)."""
    assert not isinstance(tensors, QuantizedMoELayer)
    e, h, i, bits = spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.bits
    if h % MIN_BLOCK_K or i % MIN_BLOCK_K:
        raise KernelUnavailableError(
            "TRITON", f"hidden {h} and intermediate {i} must be multiples of {MIN_BLOCK_K}"
        )
    per_byte = 8 // bits
    dims = {"w13": (spec.w13_rows, h), "w2": (h, i)}
    out: dict[str, torch.Tensor] = {}
    device = None
    for name, (n, k) in dims.items():
        groups = 1 if spec.group_size == -1 else k // spec.group_size
        if spec.group_size != -1 and k % spec.group_size:
            raise KernelInputError("group_size", f"{spec.group_size} does not divide {k}")
        expected: dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]] = {
            f"{name}_qweight": ((e, n, k // per_byte), (torch.uint8,)),
            f"{name}_scales": ((e, n, groups), (torch.float16, torch.bfloat16, torch.float32)),
        }
        if spec.has_zero_points:
            zrows = n // 2 if bits == 4 else n
            expected[f"{name}_qzeros"] = ((e, zrows, groups), (torch.uint8,))
        if spec.has_bias:
            expected[f"{name}_bias"] = ((e, n), (torch.float16, torch.bfloat16, torch.float32))
        for key, (shape, dtypes) in expected.items():
            tensor = tensors.get(key)
            if tensor is None:
                raise KernelInputError(key, f"missing (have {sorted(tensors)})")
            if tuple(tensor.shape) != shape or tensor.dtype not in dtypes:
                raise KernelInputError(
                    key,
                    f"must be {[str(d).removeprefix('torch.') for d in dtypes]} {list(shape)}, "
                    f"got {tensor.dtype} {list(tensor.shape)}",
                )
            device = device or tensor.device
            if tensor.device != device:
                raise KernelInputError(key, f"is on {tensor.device}, the layer on {device}")
            out[key] = tensor.contiguous()
    return out


def fused_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    t: dict[str, torch.Tensor],
    spec: LayerSpec,
    act: ResolvedActivation,
    config: KernelConfig,
    poison: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The whole forward (launches only; no host synchronisation), into `out` if given."""
    m, top_k = topk_ids.shape
    h, i = spec.hidden_size, spec.intermediate_size
    aligned = align_block_size(topk_ids, config.block_m, spec.num_experts)
    max_blocks = aligned.expert_ids.numel()
    num_routes = m * top_k
    inter = torch.empty((num_routes, i), dtype=x.dtype, device=x.device)
    if poison:
        inter.fill_(float("nan"))
    has_zp, has_bias = spec.has_zero_points, spec.has_bias
    dummy = t["w13_scales"]  # a valid pointer for absent optional tensors (never read)
    q13, s13 = t["w13_qweight"], t["w13_scales"]
    z13 = t.get("w13_qzeros", dummy)
    b13 = t.get("w13_bias", dummy)
    c1 = config.w13
    g13 = h if spec.group_size == -1 else spec.group_size
    k1 = launch_k_tile(c1.block_k, h, g13)
    _moe_w13_kernel[(max_blocks, triton.cdiv(i, c1.block_n))](
        x,
        q13,
        s13,
        z13,
        b13,
        inter,
        aligned.sorted_ids,
        aligned.expert_ids,
        aligned.sorted_ids.numel(),
        num_routes,
        i,
        x.stride(0),
        q13.stride(0),
        q13.stride(1),
        s13.stride(0),
        s13.stride(1),
        z13.stride(0),
        z13.stride(1),
        b13.stride(0),
        inter.stride(0),
        act.limit,
        act.alpha,
        act.beta,
        K=h,
        TOP_K=top_k,
        BITS=spec.bits,
        GROUP=g13,
        HAS_ZP=has_zp,
        HAS_BIAS=has_bias,
        ACT=act.code,
        GATED=act.gated,
        INTERLEAVED=act.interleaved,
        BLOCK_M=config.block_m,
        BLOCK_N=c1.block_n,
        BLOCK_K=k1.block_k,
        SWAP_AB=c1.swap_ab,
        DOT_F32=k1.dot_f32,
        num_warps=c1.num_warps,
        num_stages=c1.num_stages,
    )
    c2 = config.w2
    g2 = i if spec.group_size == -1 else spec.group_size
    k2 = launch_k_tile(c2.block_k, i, g2)
    atomic = top_k > 1 or c2.split_k > 1
    result = torch.empty_like(x) if out is None else out
    # The top-k sum (and split-K partials) accumulate in float32; one writer needs none.
    acc = torch.zeros((m, h), dtype=torch.float32, device=x.device) if atomic else result
    q2, s2 = t["w2_qweight"], t["w2_scales"]
    z2 = t.get("w2_qzeros", dummy)
    b2 = t.get("w2_bias", dummy)
    _moe_w2_kernel[(max_blocks, triton.cdiv(h, c2.block_n), c2.split_k)](
        inter,
        q2,
        s2,
        z2,
        b2,
        topk_weights,
        acc,
        aligned.sorted_ids,
        aligned.expert_ids,
        aligned.sorted_ids.numel(),
        num_routes,
        h,
        inter.stride(0),
        q2.stride(0),
        q2.stride(1),
        s2.stride(0),
        s2.stride(1),
        z2.stride(0),
        z2.stride(1),
        b2.stride(0),
        acc.stride(0),
        K=i,
        TOP_K=top_k,
        BITS=spec.bits,
        GROUP=g2,
        HAS_ZP=has_zp,
        HAS_BIAS=has_bias,
        BLOCK_M=config.block_m,
        BLOCK_N=c2.block_n,
        BLOCK_K=k2.block_k,
        K_SPAN=triton.cdiv(i, c2.split_k * k2.block_k) * k2.block_k,
        ATOMIC=atomic,
        SWAP_AB=c2.swap_ab,
        DOT_F32=k2.dot_f32,
        num_warps=c2.num_warps,
        num_stages=c2.num_stages,
    )
    if atomic:
        result.copy_(acc)
    return result


# --- device code ------------------------------------------------------------------------------


@triton.jit
def _zero_points(
    z_ptr, rows, row_mask, groups, stride_zn, BITS: tl.constexpr, HAS_ZP: tl.constexpr
):
    """2^23 + zero point, float32, for `rows` [BN] x `groups` (any broadcastable shape)."""
    if HAS_ZP:
        if BITS == 4:
            packed = tl.load(z_ptr + (rows // 2) * stride_zn + groups, mask=row_mask, other=0)
            zp = (packed.to(tl.int32) >> ((rows % 2) * 4)) & 0xF
        else:
            zp = tl.load(z_ptr + rows * stride_zn + groups, mask=row_mask, other=0).to(tl.int32)
        z = zp.to(tl.float32) + 8388608.0
    else:
        z = tl.full(groups.shape, 8388608.0 + (1 << (BITS - 1)), tl.float32)
    return z


@triton.jit
def _dequant_tile(
    q_ptr,
    s_ptr,
    z_ptr,
    rows,
    row_mask,
    k0,
    stride_qn,
    stride_sn,
    stride_zn,
    K: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    OUT: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """[BLOCK_N, BLOCK_K] weights (q - zp)·scale of `rows`, inputs k0 .. k0+BLOCK_K.

    Where BLOCK_K does not divide K the last tile runs past it: codes, scales and zero points
    past K are not read; the weights there are finite (zero codes, or zero scales) and meet
    zero activations.

    The pointers are already offset to the expert. Codes become exact float32 values as
    2^23 + q (OR the code into the mantissa of 2^23) and the zero point is folded into the
    subtracted constant, so no int->float conversion instruction runs.
    """
    if BITS == 4:
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        q_mask = row_mask[:, None]
        if K % BLOCK_K != 0:
            q_mask = q_mask & (kb[None, :] < K // 2)
        packed = tl.load(q_ptr + rows[:, None] * stride_qn + kb[None, :], mask=q_mask, other=0)
        q = tl.join(packed & 0xF, packed >> 4).reshape(BLOCK_N, BLOCK_K)
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        q_mask = row_mask[:, None]
        if K % BLOCK_K != 0:
            q_mask = q_mask & (kk[None, :] < K)
        q = tl.load(q_ptr + rows[:, None] * stride_qn + kk[None, :], mask=q_mask, other=0)
    qf = (q.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True)
    if GROUP >= BLOCK_K:
        g = k0 // GROUP + tl.zeros([BLOCK_N], dtype=tl.int32)
        s = tl.load(s_ptr + rows * stride_sn + g, mask=row_mask, other=0).to(tl.float32)
        z = _zero_points(z_ptr, rows, row_mask, g, stride_zn, BITS, HAS_ZP)
        w = (qf - z[:, None]) * s[:, None]
    else:
        g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        g2 = g[None, :] + tl.zeros([BLOCK_N, BLOCK_K // GROUP], dtype=tl.int32)
        rows2 = rows[:, None] + tl.zeros([BLOCK_N, BLOCK_K // GROUP], dtype=tl.int32)
        mask2 = row_mask[:, None] & (g2 >= 0)
        if K % BLOCK_K != 0:
            mask2 = mask2 & (g2 < K // GROUP)
        s = tl.load(s_ptr + rows2 * stride_sn + g2, mask=mask2, other=0).to(tl.float32)
        z = _zero_points(z_ptr, rows2, mask2, g2, stride_zn, BITS, HAS_ZP)
        w3 = qf.reshape(BLOCK_N, BLOCK_K // GROUP, GROUP)
        w = ((w3 - z[:, :, None]) * s[:, :, None]).reshape(BLOCK_N, BLOCK_K)
    return _round16(w, OUT, DOT_F32)


@triton.jit
def _round16(v, OUT: tl.constexpr, DOT_F32: tl.constexpr):
    """`v` rounded to the 16-bit type OUT (to nearest, ties to even).

    Compiled, that is a plain cast. The interpreter truncates float32 -> bfloat16 (and its
    rounding mode drops the carry into the exponent), so there the rounding is done on the
    bits and the value stays float32 (exactly representable in OUT): interpreted kernels
    then round like compiled ones and the tests can hold them to GPU tolerances.
    """
    if DOT_F32:
        if tl.bfloat16 == OUT:
            bits = v.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            r = bits.to(tl.float32, bitcast=True)
        else:
            r = v.to(OUT).to(tl.float32)
    else:
        r = v.to(OUT)
    return r


@triton.jit
def _mma(a, w, acc, SWAP_AB: tl.constexpr, DOT_F32: tl.constexpr):
    """acc + a·wᵀ ([BLOCK_M, BLOCK_N]), or with SWAP_AB acc + w·a (`a` loaded as
    [BLOCK_K, BLOCK_M]; result [BLOCK_N, BLOCK_M]). The interpreter multiplies bfloat16 dot
    operands as raw integers, so there the operands go in as float32 (`w` is already
    float32, rounded by `_round16`)."""
    if DOT_F32:
        a = a.to(tl.float32)
    if SWAP_AB:
        if DOT_F32:
            acc = tl.dot(w, a, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, a, acc)
    elif DOT_F32:
        acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, tl.trans(w), acc)
    return acc


@triton.jit
def _gated_activation(g, u, limit, alpha, beta, ACT: tl.constexpr):
    """The gated formulas of activation.py, same codes, float32."""
    if ACT == 0:
        out = g * tl.sigmoid(g) * u
    elif ACT == 1:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        out = g * tl.sigmoid(alpha * g) * (u + beta)
    elif ACT == 2:
        out = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476)) * u
    elif ACT == 3:
        out = _gelu_tanh(g) * u
    else:
        out = tl.minimum(g * tl.sigmoid(g), limit) * tl.minimum(tl.maximum(u, -limit), limit)
    return out


@triton.jit
def _plain_activation(h, ACT: tl.constexpr):
    """The `_no_mul` formulas of activation.py, float32."""
    if ACT == 5:
        out = h * tl.sigmoid(h)
    elif ACT == 6:
        out = 0.5 * h * (1.0 + tl.erf(h * 0.7071067811865476))
    elif ACT == 7:
        out = _gelu_tanh(h)
    else:
        r = tl.maximum(h, 0.0)
        out = r * r
    return out


@triton.jit
def _gelu_tanh(x):
    # 0.5·x·(1 + tanh(y)) == x·sigmoid(2y), y = sqrt(2/pi)·(x + 0.044715·x³)
    y = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return x * tl.sigmoid(2.0 * y)


@triton.jit
def _block_routes(expert_ids_ptr, sorted_ptr, max_padded, num_routes, BLOCK_M: tl.constexpr):
    """This program's expert (-1: a block past the end) and its BLOCK_M routes. Both loads
    are independent, so they are in flight together (the GEMM preamble is latency-bound)."""
    pid_m = tl.program_id(0)
    expert = tl.load(expert_ids_ptr + pid_m)
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    route = tl.load(sorted_ptr + slots, mask=slots < max_padded, other=num_routes)
    return expert.to(tl.int64), route


@triton.jit
def _moe_w13_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    bias_ptr,
    out_ptr,
    sorted_ptr,
    expert_ids_ptr,
    max_padded,
    num_routes,
    inter,
    stride_xm,
    stride_qe,
    stride_qn,
    stride_se,
    stride_sn,
    stride_ze,
    stride_zn,
    stride_be,
    stride_om,
    limit,
    alpha,
    beta,
    K: tl.constexpr,
    TOP_K: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """act(x·w13ᵀ + b) for one block of routes (one expert) and BLOCK_N columns of I.

    SWAP_AB computes the transposed tile (w13·xᵀ, [BLOCK_N, BLOCK_M]): the dequantized
    weights are then the MMA's left operand, which Hopper's wgmma reads from registers (no
    shared-memory round trip for the big operand) and whose 64-row minimum the weight tile
    fills while a decode block holds only a few tokens.
    """
    expert, route = _block_routes(expert_ids_ptr, sorted_ptr, max_padded, num_routes, BLOCK_M)
    if expert < 0:
        return
    pid_n = tl.program_id(1)
    m_mask = route < num_routes
    token = (route // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < inter
    if GATED:
        if INTERLEAVED:
            gate_rows = 2 * cols
            up_rows = 2 * cols + 1
        else:
            gate_rows = cols
            up_rows = cols + inter
    else:
        up_rows = cols
    q_e = q_ptr + expert * stride_qe
    s_e = s_ptr + expert * stride_se
    z_e = z_ptr + expert * stride_ze
    out_dtype = out_ptr.dtype.element_ty
    offs_k = tl.arange(0, BLOCK_K)
    if SWAP_AB:
        a_ptrs = x_ptr + token[None, :] * stride_xm + offs_k[:, None]  # [BLOCK_K, BLOCK_M]
        a_mask = m_mask[None, :]
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        a_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        a_mask = m_mask[:, None]
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if GATED:
        acc_g = tl.zeros_like(acc_u)
    for k0 in range(0, K, BLOCK_K):
        a = _load_a(a_ptrs, a_mask, offs_k, k0, K, BLOCK_K, SWAP_AB)
        w_u = _dequant_tile(
            q_e, s_e, z_e, up_rows, n_mask, k0, stride_qn, stride_sn, stride_zn,
            K, BITS, GROUP, HAS_ZP, BLOCK_N, BLOCK_K, out_dtype, DOT_F32,
        )  # fmt: skip
        acc_u = _mma(a, w_u, acc_u, SWAP_AB, DOT_F32)
        if GATED:
            w_g = _dequant_tile(
                q_e, s_e, z_e, gate_rows, n_mask, k0, stride_qn, stride_sn, stride_zn,
                K, BITS, GROUP, HAS_ZP, BLOCK_N, BLOCK_K, out_dtype, DOT_F32,
            )  # fmt: skip
            acc_g = _mma(a, w_g, acc_g, SWAP_AB, DOT_F32)
    if HAS_BIAS:
        b_e = bias_ptr + expert * stride_be
        b_u = tl.load(b_e + up_rows, mask=n_mask, other=0.0).to(tl.float32)
        acc_u += _along_n(b_u, SWAP_AB)
        if GATED:
            b_g = tl.load(b_e + gate_rows, mask=n_mask, other=0.0).to(tl.float32)
            acc_g += _along_n(b_g, SWAP_AB)
    if GATED:
        h = _gated_activation(acc_g, acc_u, limit, alpha, beta, ACT)
    else:
        h = _plain_activation(acc_u, ACT)
    h = _round16(h, out_dtype, DOT_F32)
    row = route.to(tl.int64) * stride_om
    if SWAP_AB:
        out_ptrs = out_ptr + row[None, :] + cols[:, None]
        mask = n_mask[:, None] & m_mask[None, :]
    else:
        out_ptrs = out_ptr + row[:, None] + cols[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
    tl.store(out_ptrs, h.to(out_dtype), mask=mask)


@triton.jit
def _load_a(
    a_ptrs, a_mask, offs_k, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr
):
    """The activation tile at k0 ([BLOCK_M, BLOCK_K], SWAP_AB [BLOCK_K, BLOCK_M]), zero past
    K where the last tile runs over (BLOCK_K does not divide K)."""
    mask = a_mask
    if K % BLOCK_K != 0:
        if SWAP_AB:
            mask = mask & (k0 + offs_k[:, None] < K)
        else:
            mask = mask & (k0 + offs_k[None, :] < K)
    return tl.load(a_ptrs + k0, mask=mask, other=0.0)


@triton.jit
def _along_n(v, SWAP_AB: tl.constexpr):
    """A per-column [BLOCK_N] vector broadcast over the accumulator's route axis."""
    if SWAP_AB:
        r = v[:, None]
    else:
        r = v[None, :]
    return r


@triton.jit
def _along_m(v, SWAP_AB: tl.constexpr):
    """A per-route [BLOCK_M] vector broadcast over the accumulator's column axis."""
    if SWAP_AB:
        r = v[None, :]
    else:
        r = v[:, None]
    return r


@triton.jit
def _moe_w2_kernel(
    a_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    bias_ptr,
    topk_w_ptr,
    out_ptr,
    sorted_ptr,
    expert_ids_ptr,
    max_padded,
    num_routes,
    hidden,
    stride_am,
    stride_qe,
    stride_qn,
    stride_se,
    stride_sn,
    stride_ze,
    stride_zn,
    stride_be,
    stride_om,
    K: tl.constexpr,
    TOP_K: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_SPAN: tl.constexpr,
    ATOMIC: tl.constexpr,
    SWAP_AB: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """weight·(inter·w2ᵀ + b) for one block of routes, BLOCK_N columns of H and one K split,
    added into the token's output row (the top-k sum). SWAP_AB as in `_moe_w13_kernel`."""
    expert, route = _block_routes(expert_ids_ptr, sorted_ptr, max_padded, num_routes, BLOCK_M)
    if expert < 0:
        return
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    m_mask = route < num_routes
    token = (route // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < hidden
    q_e = q_ptr + expert * stride_qe
    s_e = s_ptr + expert * stride_se
    z_e = z_ptr + expert * stride_ze
    a_dtype = a_ptr.dtype.element_ty
    offs_k = tl.arange(0, BLOCK_K)
    row = route.to(tl.int64) * stride_am
    if SWAP_AB:
        a_ptrs = a_ptr + row[None, :] + offs_k[:, None]
        a_mask = m_mask[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        a_ptrs = a_ptr + row[:, None] + offs_k[None, :]
        a_mask = m_mask[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = pid_k * K_SPAN
    for k0 in range(k_lo, tl.minimum(k_lo + K_SPAN, K), BLOCK_K):
        a = _load_a(a_ptrs, a_mask, offs_k, k0, K, BLOCK_K, SWAP_AB)
        w = _dequant_tile(
            q_e, s_e, z_e, cols, n_mask, k0, stride_qn, stride_sn, stride_zn,
            K, BITS, GROUP, HAS_ZP, BLOCK_N, BLOCK_K, a_dtype, DOT_F32,
        )  # fmt: skip
        acc = _mma(a, w, acc, SWAP_AB, DOT_F32)
    if HAS_BIAS:
        # Only the first K split adds the bias.
        bias = tl.load(bias_ptr + expert * stride_be + cols, mask=n_mask & (pid_k == 0), other=0.0)
        acc += _along_n(bias.to(tl.float32), SWAP_AB)
    acc *= _along_m(tl.load(topk_w_ptr + route, mask=m_mask, other=0.0), SWAP_AB)
    out_row = token * stride_om
    if SWAP_AB:
        out_ptrs = out_ptr + out_row[None, :] + cols[:, None]
        mask = n_mask[:, None] & m_mask[None, :]
    else:
        out_ptrs = out_ptr + out_row[:, None] + cols[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
    if ATOMIC:
        tl.atomic_add(out_ptrs, acc, mask=mask, sem="relaxed")
    else:
        out_dtype = out_ptr.dtype.element_ty
        tl.store(out_ptrs, _round16(acc, out_dtype, DOT_F32).to(out_dtype), mask=mask)
