"""TRITON v4: the Hopper redesign of our fused WNA16 MoE forward (issue 6, item 2).

What version 3 measured (bench/KERNEL_NOTES.md) and what this design changes:

* Decode was launch- and glue-bound, not byte-bound (Qwen3-30B-A3B M=1: 36.7 µs for a 4.6 µs
  floor; five graph nodes: alignment, memset, w13, w2, cast). With `fused_routes` there is
  no alignment pass and no memset or cast: every program reads the (at most a few hundred)
  `topk_ids` itself, histograms them, and takes the p-th chunk of BLOCK_M routes in expert
  order (its routes compacted with one [BLOCK_M, routes] comparison; surplus programs
  return at once). The w2 programs add their float32 partials into a persistent workspace,
  then count themselves in per column tile (a CTA barrier, then one acquire-release
  atomic); the last one of a column tile reads the tile back with atomic reads, zeroes it
  for the next forward, writes the 16-bit output and resets the counter. The forward is
  two launches and graph-capturable. (The float32 sum order of the atomics is not fixed:
  results can differ by float32 rounding between runs.)
* Weights come in as 64-bit words (16 int4 or 8 int8 codes; 8-byte cp.async copies, software-
  pipelined), unpacked with one shift and one mask per code; codes minus zero point
  are small integers, exact in bf16/fp16, so where a K tile lies inside one quantization
  group (`scale_after`) the tile's partial product is scaled once per output element
  instead of once per weight: the multiply per weight and the rounding of scaled weights
  to 16 bits both go away. Scales and zero points: one [BLOCK_N] load per tile.
* Large M keeps `tl.dot` on wgmma (64+ row tiles) with the scale folded into the weights
  (the accumulator then stays in the MMA chain across the K loop); tiles, warps and stages
  are per (shape, token bucket) data found by bench/tune_triton.py.
* Split-K in w2's decode path where few programs would exist: its partials go into the
  same workspace sum; w13 is not split (its activation needs the whole sum).
"""

# Triton idiom: compile-time parameters are UPPER_CASE, kernels take many arguments and
# constexpr branches stay statements (not conditional expressions);
# @triton.jit device functions are untyped (triton has no type information).
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# ruff: noqa: N803, N806, PLR0917, SIM108

from __future__ import annotations

import torch
import triton
import triton.language as tl

from service.kernels.activation import ResolvedActivation
from service.kernels.align import align_block_size
from service.kernels.interface import LayerSpec
from service.kernels.triton_wna16 import (
    KernelConfig,
    _along_m,
    _along_n,
    _block_routes,
    _gated_activation,
    _mma,
    _plain_activation,
    _round16,
)
from service.triton_runtime import interpreting

#: Most routes (M·k) the fused-routes path takes: each program compacts its routes with a
#: [BLOCK_M, routes] comparison and histograms all of them.
FUSED_MAX_ROUTES = 512

#: Smallest K tile a compiled GEMM may feed to the tensor cores. Triton 3.6 gives our dot
#: operands an MMAv2 layout of kWidth 8 (the weight operand is upcast from integer codes),
#: which spans 4 x 8 = 32 inputs along K; with a K tile of 16 the layout wraps, so the
#: single m16n8k16 reads inputs 0-3 and 8-11 twice and never 4-7 or 12-15 (H200: relative
#: error 0.8; upstream fix triton-lang/triton#11691, after 3.6). Smaller K tiles (layers
#: whose H or I is not a multiple of 32) take the float32 `tl.dot` (FMA, no MMA) instead,
#: the same arithmetic the interpreter runs.
MMA_MIN_BLOCK_K = 32


def dot_in_fp32(block_k: int, interpreted: bool | None = None) -> bool:
    """Whether a GEMM with this K tile multiplies float32 operands (`DOT_F32`): always
    under the interpreter (it multiplies 16-bit dot operands as integers; `interpreted`
    None: whether this process interprets), and for K tiles below `MMA_MIN_BLOCK_K` when
    compiled."""
    if interpreted is None:
        interpreted = interpreting()
    return interpreted or block_k < MMA_MIN_BLOCK_K


class Workspace:
    """The persistent float32 sum and per-column-tile counters of the fused w2 reduction.

    Zero between forwards: the last program of each column tile zeroes what it read and
    resets its counter. One forward at a time may use a workspace (the worker runs one).
    """

    def __init__(self) -> None:
        self._sum: torch.Tensor | None = None
        self._count: torch.Tensor | None = None

    def get(
        self, rows: int, cols: int, tiles: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s, c = self._sum, self._count
        if s is None or s.device != device or s.shape[0] < rows or s.shape[1] != cols:
            s = self._sum = torch.zeros((max(rows, 16), cols), dtype=torch.float32, device=device)
        if c is None or c.device != device or c.numel() < tiles:
            c = self._count = torch.zeros(max(tiles, 64), dtype=torch.int32, device=device)
        return s, c


def fused_moe_v4(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    t: dict[str, torch.Tensor],
    spec: LayerSpec,
    act: ResolvedActivation,
    config: KernelConfig,
    workspace: Workspace,
    poison: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The whole v4 forward (launches only; no host synchronisation), into `out` if given."""
    m, top_k = topk_ids.shape
    h, i, e = spec.hidden_size, spec.intermediate_size, spec.num_experts
    num_routes = m * top_k
    fused = config.fused_routes and num_routes <= FUSED_MAX_ROUTES
    flat_ids = topk_ids.reshape(-1)
    if fused:
        # Chunks of BLOCK_M routes per expert: at most one partial chunk per active expert.
        slots = min(num_routes, e) + num_routes // config.block_m
        sorted_ids = expert_ids = flat_ids  # unread by the fused path (valid pointers)
        max_padded = 0
    else:
        aligned = align_block_size(topk_ids, config.block_m, e)
        sorted_ids, expert_ids = aligned.sorted_ids, aligned.expert_ids
        slots = expert_ids.numel()
        max_padded = sorted_ids.numel()
    block_e = max(16, triton.next_power_of_2(e))
    r_pad = max(16, triton.next_power_of_2(num_routes)) if fused else 16
    inter = torch.empty((num_routes, i), dtype=x.dtype, device=x.device)
    if poison:
        inter.fill_(float("nan"))
    dummy = t["w13_scales"]  # a valid pointer for absent optional tensors (never read)
    q13 = _words(t["w13_qweight"])
    s13, z13, b13 = t["w13_scales"], t.get("w13_qzeros", dummy), t.get("w13_bias", dummy)
    c1 = config.w13
    g13 = h if spec.group_size == -1 else spec.group_size
    _v4_w13_kernel[(slots, triton.cdiv(i, c1.block_n))](
        x, q13, s13, z13, b13, inter,
        flat_ids, sorted_ids, expert_ids, max_padded, num_routes, e, i,
        x.stride(0), q13.stride(0), q13.stride(1), s13.stride(0), s13.stride(1),
        z13.stride(0), z13.stride(1), b13.stride(0), inter.stride(0),
        act.limit, act.alpha, act.beta,
        K=h, TOP_K=top_k, BITS=spec.bits, GROUP=g13,
        HAS_ZP=spec.has_zero_points, HAS_BIAS=spec.has_bias,
        ACT=act.code, GATED=act.gated, INTERLEAVED=act.interleaved,
        BLOCK_M=config.block_m, BLOCK_N=c1.block_n, BLOCK_K=c1.block_k,
        SWAP_AB=c1.swap_ab, SCALE_AFTER=c1.scale_after and g13 >= c1.block_k,
        FUSED=fused, BLOCK_E=block_e, R_PAD=r_pad, DOT_F32=dot_in_fp32(c1.block_k),
        num_warps=c1.num_warps, num_stages=c1.num_stages,
    )  # fmt: skip
    c2 = config.w2
    g2 = i if spec.group_size == -1 else spec.group_size
    result = torch.empty_like(x) if out is None else out
    n_tiles = triton.cdiv(h, c2.block_n)
    if fused:
        reduce = 2
        acc, counters = workspace.get(m, h, n_tiles, x.device)
    elif top_k > 1 or c2.split_k > 1:
        reduce = 1
        acc = torch.zeros((m, h), dtype=torch.float32, device=x.device)
        counters = flat_ids
    else:
        reduce = 0
        acc, counters = result, flat_ids
    q2 = _words(t["w2_qweight"])
    s2, z2, b2 = t["w2_scales"], t.get("w2_qzeros", dummy), t.get("w2_bias", dummy)
    _v4_w2_kernel[(slots, n_tiles, c2.split_k)](
        inter, q2, s2, z2, b2, topk_weights, acc, result, counters,
        flat_ids, sorted_ids, expert_ids, max_padded, num_routes, m, e, h,
        inter.stride(0), q2.stride(0), q2.stride(1), s2.stride(0), s2.stride(1),
        z2.stride(0), z2.stride(1), b2.stride(0), acc.stride(0), result.stride(0),
        K=i, TOP_K=top_k, BITS=spec.bits, GROUP=g2,
        HAS_ZP=spec.has_zero_points, HAS_BIAS=spec.has_bias,
        BLOCK_M=config.block_m, BLOCK_N=c2.block_n, BLOCK_K=c2.block_k,
        K_SPAN=triton.cdiv(i, c2.split_k * c2.block_k) * c2.block_k, SPLIT_K=c2.split_k,
        REDUCE=reduce, SWAP_AB=c2.swap_ab, SCALE_AFTER=c2.scale_after and g2 >= c2.block_k,
        FUSED=fused, BLOCK_E=block_e, R_PAD=r_pad, FLUSH_M=16,
        DOT_F32=dot_in_fp32(c2.block_k),
        num_warps=c2.num_warps, num_stages=c2.num_stages,
    )  # fmt: skip
    if reduce == 1:
        result.copy_(acc)
    return result


def _words(packed: torch.Tensor) -> torch.Tensor:
    """The packed uint8 weights as 64-bit words (rows of K/2 or K bytes are multiples of 8:
    K is a multiple of 16); a copy only if the tensor does not start on an 8-byte boundary."""
    if packed.data_ptr() % 8:
        packed = packed.clone()
    return packed.view(torch.int64)


# --- device code ------------------------------------------------------------------------------


@triton.jit
def _fused_routes(ids_ptr, num_routes, num_experts, BLOCK_M: tl.constexpr,
                  BLOCK_E: tl.constexpr, R_PAD: tl.constexpr):  # fmt: skip
    """This program's expert and BLOCK_M routes, straight from the flat `topk_ids`.

    Each expert with routes has cdiv(count, BLOCK_M) chunks; chunks are numbered in expert
    order and program p takes chunk p. Returns (expert, routes with the sentinel
    `num_routes` past the expert's last, the number of chunks: programs past it have none).
    """
    r = tl.arange(0, R_PAD)
    ids = tl.load(ids_ptr + r, mask=r < num_routes, other=-1).to(tl.int32)
    valid = (ids >= 0) & (ids < num_experts)
    ids = tl.where(valid, ids, 0)
    chunks = (tl.histogram(ids, BLOCK_E, mask=valid) + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(chunks, axis=0)
    total = tl.sum(chunks, axis=0)
    p = tl.program_id(0)
    expert = tl.sum((ends <= p).to(tl.int32), axis=0)
    first = tl.sum(tl.where(tl.arange(0, BLOCK_E) == expert, ends - chunks, 0), axis=0)
    member = valid & (ids == expert)
    rank = tl.cumsum(member.to(tl.int32), axis=0) - 1
    slots = (p - first) * BLOCK_M + tl.arange(0, BLOCK_M)
    hit = member[None, :] & (rank[None, :] == slots[:, None])
    route = tl.sum(tl.where(hit, r[None, :], 0), axis=1)
    found = tl.sum(hit.to(tl.int32), axis=1) > 0
    return expert, tl.where(found, route, num_routes), total


@triton.jit
def _codes(q_ptr, rows, row_mask, k0, stride_qn, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr):  # fmt: skip
    """int32 codes [BLOCK_N, BLOCK_K] of `rows`, inputs k0 .. k0+BLOCK_K, from 64-bit words
    (little-endian: the code of input 16w+j of an int4 row sits at bits 4j of word w).

    64-bit words make 8-byte cp.async copies (32-bit words gave 4-byte ones and more
    registers at decode tiles: 192 against 148 at bm16 bn32 bk128)."""
    PER: tl.constexpr = 64 // BITS
    kw = k0 // PER + tl.arange(0, BLOCK_K // PER)
    words = tl.load(
        q_ptr + rows[:, None] * stride_qn + kw[None, :], mask=row_mask[:, None], other=0
    )
    # 32-bit halves, 16-bit halves, bytes, then (int4) nibbles, each split a join: the new
    # axis is always within one thread, so the unpack is register-only shifts and masks.
    lo = (words & 0xFFFFFFFF).to(tl.int32)
    hi = (words >> 32).to(tl.int32)
    w32 = tl.join(lo, hi)
    halves = tl.join(w32 & 0xFFFF, (w32 >> 16) & 0xFFFF)
    q = tl.join(halves & 0xFF, halves >> 8)
    if BITS == 4:
        q = tl.join(q & 0xF, q >> 4)
    return q.reshape(BLOCK_N, BLOCK_K)


@triton.jit
def _zero_point(z_ptr, rows, row_mask, g, stride_zn, BITS: tl.constexpr, HAS_ZP: tl.constexpr):
    """int32 zero points of `rows` in group(s) `g` (broadcastable); 2^(bits-1) if symmetric."""
    if HAS_ZP:
        if BITS == 4:
            packed = tl.load(z_ptr + (rows // 2) * stride_zn + g, mask=row_mask, other=0)
            z = (packed.to(tl.int32) >> ((rows % 2) * 4)) & 0xF
        else:
            z = tl.load(z_ptr + rows * stride_zn + g, mask=row_mask, other=0).to(tl.int32)
    else:
        z = tl.full(g.shape, 1 << (BITS - 1), tl.int32)
    return z


@triton.jit
def _step(a, acc, q_ptr, s_ptr, z_ptr, rows, row_mask, k0, stride_qn, stride_sn, stride_zn,
          BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, SCALE_AFTER: tl.constexpr, SWAP_AB: tl.constexpr,
          OUT: tl.constexpr, DOT_F32: tl.constexpr):  # fmt: skip
    """acc + a·wᵀ for the weight tile of `rows` at k0 (see `_mma` for SWAP_AB)."""
    q = _codes(q_ptr, rows, row_mask, k0, stride_qn, BITS, BLOCK_N, BLOCK_K)
    if SCALE_AFTER:
        g = k0 // GROUP + tl.zeros([BLOCK_N], dtype=tl.int32)
        z = _zero_point(z_ptr, rows, row_mask, g, stride_zn, BITS, HAS_ZP)
        s = tl.load(s_ptr + rows * stride_sn + g, mask=row_mask, other=0).to(tl.float32)
        w = q - z[:, None]  # small integers: exact in any 16-bit float
        if DOT_F32:
            w = w.to(tl.float32)
        else:
            w = w.to(OUT)
        part = _mma(a, w, tl.zeros_like(acc), SWAP_AB, DOT_F32)
        acc += part * _along_n(s, SWAP_AB)
    else:
        if GROUP >= BLOCK_K:
            g = k0 // GROUP + tl.zeros([BLOCK_N], dtype=tl.int32)
            z = _zero_point(z_ptr, rows, row_mask, g, stride_zn, BITS, HAS_ZP)
            s = tl.load(s_ptr + rows * stride_sn + g, mask=row_mask, other=0).to(tl.float32)
            w = (q - z[:, None]).to(tl.float32) * s[:, None]
        else:
            NG: tl.constexpr = BLOCK_K // GROUP
            g = k0 // GROUP + tl.arange(0, NG)
            g2 = g[None, :] + tl.zeros([BLOCK_N, NG], dtype=tl.int32)
            rows2 = rows[:, None] + tl.zeros([BLOCK_N, NG], dtype=tl.int32)
            mask2 = row_mask[:, None] & (g2 >= 0)
            s = tl.load(s_ptr + rows2 * stride_sn + g2, mask=mask2, other=0).to(tl.float32)
            z = _zero_point(z_ptr, rows2, mask2, g2, stride_zn, BITS, HAS_ZP)
            w3 = q.reshape(BLOCK_N, NG, GROUP)
            w = ((w3 - z[:, :, None]).to(tl.float32) * s[:, :, None]).reshape(BLOCK_N, BLOCK_K)
        acc = _mma(a, _round16(w, OUT, DOT_F32), acc, SWAP_AB, DOT_F32)
    return acc


@triton.jit
def _v4_w13_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, out_ptr,
    ids_ptr, sorted_ptr, expert_ids_ptr, max_padded, num_routes, num_experts, inter,
    stride_xm, stride_qe, stride_qn, stride_se, stride_sn, stride_ze, stride_zn, stride_be,
    stride_om, limit, alpha, beta,
    K: tl.constexpr, TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
    HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr, SCALE_AFTER: tl.constexpr,
    FUSED: tl.constexpr, BLOCK_E: tl.constexpr, R_PAD: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """act(x·w13ᵀ + b) for one expert's routes (a block of them, or all with FUSED) and
    BLOCK_N columns of I; gate and up tiles in two accumulators, activation in the epilogue."""
    if FUSED:
        expert, route, n_chunks = _fused_routes(
            ids_ptr, num_routes, num_experts, BLOCK_M, BLOCK_E, R_PAD
        )
        if tl.program_id(0) >= n_chunks:
            return
    else:
        expert, route = _block_routes(expert_ids_ptr, sorted_ptr, max_padded, num_routes, BLOCK_M)
        if expert < 0:
            return
    expert = expert.to(tl.int64)
    pid_n = tl.program_id(1)
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
    m_mask = route < num_routes
    token = (route // TOP_K).to(tl.int64)
    if SWAP_AB:
        a_ptrs = x_ptr + token[None, :] * stride_xm + offs_k[:, None]
        a_mask = m_mask[None, :]
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        a_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :]
        a_mask = m_mask[:, None]
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_g = tl.zeros_like(acc_u)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs + k0, mask=a_mask, other=0.0)
        acc_u = _step(
            a, acc_u, q_e, s_e, z_e, up_rows, n_mask, k0, stride_qn, stride_sn, stride_zn,
            BITS, GROUP, HAS_ZP, BLOCK_N, BLOCK_K, SCALE_AFTER, SWAP_AB, out_dtype, DOT_F32,
        )  # fmt: skip
        if GATED:
            acc_g = _step(
                a, acc_g, q_e, s_e, z_e, gate_rows, n_mask, k0, stride_qn, stride_sn,
                stride_zn, BITS, GROUP, HAS_ZP, BLOCK_N, BLOCK_K, SCALE_AFTER, SWAP_AB,
                out_dtype, DOT_F32,
            )  # fmt: skip
    if HAS_BIAS:
        b_e = bias_ptr + expert * stride_be
        b_u = tl.load(b_e + up_rows, mask=n_mask, other=0.0).to(tl.float32)
        acc_u += _along_n(b_u, SWAP_AB)
        if GATED:
            b_g = tl.load(b_e + gate_rows, mask=n_mask, other=0.0).to(tl.float32)
            acc_g += _along_n(b_g, SWAP_AB)
    if GATED:
        hidden = _gated_activation(acc_g, acc_u, limit, alpha, beta, ACT)
    else:
        hidden = _plain_activation(acc_u, ACT)
    hidden = _round16(hidden, out_dtype, DOT_F32)
    row = route.to(tl.int64) * stride_om
    if SWAP_AB:
        out_ptrs = out_ptr + row[None, :] + cols[:, None]
        mask = n_mask[:, None] & m_mask[None, :]
    else:
        out_ptrs = out_ptr + row[:, None] + cols[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
    tl.store(out_ptrs, hidden.to(out_dtype), mask=mask)


@triton.jit
def _v4_w2_kernel(
    a_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, topk_w_ptr, acc_ptr, out_ptr, count_ptr,
    ids_ptr, sorted_ptr, expert_ids_ptr, max_padded, num_routes, num_tokens, num_experts,
    hidden, stride_am, stride_qe, stride_qn, stride_se, stride_sn, stride_ze, stride_zn,
    stride_be, stride_accm, stride_om,
    K: tl.constexpr, TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
    HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_SPAN: tl.constexpr,
    SPLIT_K: tl.constexpr, REDUCE: tl.constexpr, SWAP_AB: tl.constexpr,
    SCALE_AFTER: tl.constexpr, FUSED: tl.constexpr, BLOCK_E: tl.constexpr,
    R_PAD: tl.constexpr, FLUSH_M: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """weight·(inter·w2ᵀ + b) for one expert's routes, BLOCK_N columns of H and one K split.

    REDUCE 0: one writer per output row, stored in 16 bits. 1: float32 atomic adds into
    `acc_ptr` (zeroed and cast by the caller). 2 (FUSED): atomic adds into the persistent
    workspace, then the last program of the column tile writes the output and zeroes it.
    """
    if FUSED:
        expert, route, n_chunks = _fused_routes(
            ids_ptr, num_routes, num_experts, BLOCK_M, BLOCK_E, R_PAD
        )
        # With no valid route at all, program 0 still counts in (and writes zeros).
        n_programs = tl.maximum(n_chunks, 1)
        if tl.program_id(0) >= n_programs:
            return
    else:
        expert, route = _block_routes(expert_ids_ptr, sorted_ptr, max_padded, num_routes, BLOCK_M)
        if expert < 0:
            return
    expert = expert.to(tl.int64)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < hidden
    q_e = q_ptr + expert * stride_qe
    s_e = s_ptr + expert * stride_se
    z_e = z_ptr + expert * stride_ze
    a_dtype = a_ptr.dtype.element_ty
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = pid_k * K_SPAN
    m_mask = route < num_routes
    token = (route // TOP_K).to(tl.int64)
    row = route.to(tl.int64) * stride_am
    if SWAP_AB:
        a_ptrs = a_ptr + row[None, :] + offs_k[:, None]
        a_mask = m_mask[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        a_ptrs = a_ptr + row[:, None] + offs_k[None, :]
        a_mask = m_mask[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + K_SPAN, K), BLOCK_K):
        a = tl.load(a_ptrs + k0, mask=a_mask, other=0.0)
        acc = _step(
            a, acc, q_e, s_e, z_e, cols, n_mask, k0, stride_qn, stride_sn, stride_zn,
            BITS, GROUP, HAS_ZP, BLOCK_N, BLOCK_K, SCALE_AFTER, SWAP_AB, a_dtype, DOT_F32,
        )  # fmt: skip
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_be + cols, mask=n_mask & (pid_k == 0), other=0.0)
        acc += _along_n(bias.to(tl.float32), SWAP_AB)
    acc *= _along_m(tl.load(topk_w_ptr + route, mask=m_mask, other=0.0), SWAP_AB)
    if REDUCE == 0:
        o_row = token * stride_om
        if SWAP_AB:
            o_ptrs = out_ptr + o_row[None, :] + cols[:, None]
            mask = n_mask[:, None] & m_mask[None, :]
        else:
            o_ptrs = out_ptr + o_row[:, None] + cols[None, :]
            mask = m_mask[:, None] & n_mask[None, :]
        out_dtype = out_ptr.dtype.element_ty
        tl.store(o_ptrs, _round16(acc, out_dtype, DOT_F32).to(out_dtype), mask=mask)
    else:
        a_row = token * stride_accm
        if SWAP_AB:
            s_ptrs = acc_ptr + a_row[None, :] + cols[:, None]
            mask = n_mask[:, None] & m_mask[None, :]
        else:
            s_ptrs = acc_ptr + a_row[:, None] + cols[None, :]
            mask = m_mask[:, None] & n_mask[None, :]
        tl.atomic_add(s_ptrs, acc, mask=mask, sem="relaxed")
    if REDUCE == 2:
        # Every thread's adds are issued before one thread's release-acquire count.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == n_programs * SPLIT_K - 1:
            _flush(acc_ptr, out_ptr, cols, n_mask, num_tokens, stride_accm, stride_om,
                   FLUSH_M, BLOCK_N, DOT_F32)  # fmt: skip
            tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed")


@triton.jit
def _flush(acc_ptr, out_ptr, cols, n_mask, num_tokens, stride_accm, stride_om,
           FLUSH_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):  # fmt: skip
    """Read the column tile's float32 sums back, zero them, write the 16-bit output."""
    out_dtype = out_ptr.dtype.element_ty
    for m0 in range(0, num_tokens, FLUSH_M):
        rows = (m0 + tl.arange(0, FLUSH_M)).to(tl.int64)
        mask = (rows[:, None] < num_tokens) & n_mask[None, :]
        ptrs = acc_ptr + rows[:, None] * stride_accm + cols[None, :]
        zero = tl.zeros([FLUSH_M, BLOCK_N], tl.float32)
        # An atomic read (at L2, after the other programs' adds), then the zeroing store: no
        # other program touches the tile any more in this forward.
        total = tl.atomic_add(ptrs, zero, mask=mask, sem="relaxed")
        tl.store(ptrs, zero, mask=mask)
        o_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
        tl.store(o_ptrs, _round16(total, out_dtype, DOT_F32).to(out_dtype), mask=mask)
