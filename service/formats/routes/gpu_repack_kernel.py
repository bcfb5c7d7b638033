"""The Triton kernels of `gpu_repack` (imported only when a kernel first runs).

Each launch converts every stored tensor of one projection (all experts, gate and up):
grid axis 2 is the slab (one stored tensor and its output rows), whose two pointers the
kernel reads from `ptrs` ([2, slabs] int64: sources, then targets). One launch per
projection instead of one per stored tensor: at Mixtral's size a tensor is 15-30 MB, a
few microseconds of bandwidth, less than a launch costs the host.

Five kernels, none of which reduces across threads (a cross-lane sum over a reshaped
field axis went through shared memory in the first version):
- `transpose_kernel`: a word transpose (GPTQ -> TRITON), a 2-D block loaded along the
  input's rows and stored along the output's, the compiler turning it round in shared
  memory.
- `awq_triton_kernel`: AWQ int4 -> TRITON, an 8 x 8 nibble transpose inside each block of
  8 rows x 1 word: 8 coalesced 2-D loads (one per input row t of a block), every output
  word assembled in registers with constant shifts, one store along the output's rows.
- `table_kernel`: any tile-periodic permutation (the int8 Marlin routes): per output word,
  S fields of F bits, field s from the input word the table names (row, column, bit
  offset inside the input tile); a static loop over the fields ORs them into the word (the
  bits are disjoint), and whole words are stored along the output row. The input tile is
  read S times, from L1 after the first.
- `marlin4_gptq_kernel`, `marlin4_awq_kernel`: int4 -> Marlin, a block of whole 16 x 64
  tiles (see the comment above them).
"""

# Triton idiom: compile-time parameters are UPPER_CASE, kernels take many arguments. The
# runtime parameters carry no annotations: the compiler evaluates them as globals and
# rejects any but tl.constexpr (the interpreter does not; tests/formats/routes/test_gpu_repack.py
# compiles every launched variant for sm_90a).
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# ruff: noqa: N803, N806, PLR0917

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _slab(ptrs, slabs, ALIGNED: tl.constexpr):
    """This program's source and target int32 pointers (16-byte aligned when ALIGNED, which
    lets the compiler vectorize contiguous accesses)."""
    slab = tl.program_id(2)
    src = tl.load(ptrs + slab).to(tl.pointer_type(tl.int32))
    dst = tl.load(ptrs + slabs + slab).to(tl.pointer_type(tl.int32))
    if ALIGNED:
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
    return src, dst


@triton.jit
def transpose_kernel(
    ptrs,
    slabs,
    src_stride,
    dst_stride,
    rows,
    cols,
    BI: tl.constexpr,
    BJ: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """out[rows, cols] = src[cols, rows] transposed, whole int32 words."""
    src, dst = _slab(ptrs, slabs, ALIGNED)
    oi = tl.program_id(0) * BI + tl.arange(0, BI)  # output rows = input columns
    oj = tl.program_id(1) * BJ + tl.arange(0, BJ)  # output columns = input rows
    inside = (oj[:, None] < cols) & (oi[None, :] < rows)
    block = tl.load(src + oj[:, None] * src_stride + oi[None, :], mask=inside, other=0)
    tl.store(
        dst + oi[:, None] * dst_stride + oj[None, :],
        tl.trans(block),
        mask=(oi[:, None] < rows) & (oj[None, :] < cols),
    )


@triton.jit
def awq_triton_kernel(
    ptrs,
    slabs,
    src_stride,
    dst_stride,
    kw_count,
    nw_count,
    BK: tl.constexpr,
    BN: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """AWQ int4 [K, N/8] (word (k, nw): column 8 nw + c in nibble c // 2 + 4 (c % 2)) ->
    TRITON words [N, K/8] (word (n, kw): row 8 kw + t in nibble t). A program takes BN
    input word columns x BK blocks of 8 input rows."""
    src, dst = _slab(ptrs, slabs, ALIGNED)
    kw = tl.program_id(0) * BK + tl.arange(0, BK)
    nw = tl.program_id(1) * BN + tl.arange(0, BN)
    c = tl.arange(0, 8)
    shift = 4 * ((c % 2) * 4 + c // 2)  # the nibble holding column c of a word
    inside = (nw[:, None] < nw_count) & (kw[None, :] < kw_count)  # [BN, BK]
    first = src + (kw[None, :] * 8) * src_stride + nw[:, None]
    word = tl.zeros([BN, 8, BK], dtype=tl.int32)  # output rows (nw, c), columns kw
    for t in tl.static_range(8):
        x = tl.load(first + t * src_stride, mask=inside, other=0)
        word |= ((x[:, None, :] >> shift[None, :, None]) & 0xF) << (4 * t)
    n = nw[:, None, None] * 8 + c[None, :, None]
    tl.store(
        dst + n * dst_stride + kw[None, None, :],
        word,
        mask=(nw[:, None, None] < nw_count) & (kw[None, None, :] < kw_count),
    )


@triton.jit
def table_kernel(
    ptrs,
    slabs,
    table,
    src_stride,
    dst_stride,
    tile_rows,
    tile_cols,
    TIR: tl.constexpr,
    TIC: tl.constexpr,
    TOR: tl.constexpr,
    TOC: tl.constexpr,
    S: tl.constexpr,
    F: tl.constexpr,
    BI: tl.constexpr,
    BJ: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """BI x BJ output tiles of TOR x TOC words; output tile (i, j) from input tile (i, j)
    of TIR x TIC words. `table[s, w]` = row << 16 | column << 8 | bit offset of output
    word w's field s inside the input tile."""
    src, dst = _slab(ptrs, slabs, ALIGNED)
    WORDS: tl.constexpr = BI * TOR * BJ * TOC
    q = tl.arange(0, WORDS)  # ((ii, output row), jj, output column): stores run along rows
    oc = q % TOC
    u = q // TOC
    jj = u % BJ
    u = u // BJ
    orow = u % TOR
    ii = u // TOR
    i = tl.program_id(0) * BI + ii
    j = tl.program_id(1) * BJ + jj
    inside = (i < tile_rows) & (j < tile_cols)
    base = src + (i * TIR) * src_stride + j * TIC
    w = orow * TOC + oc
    word = tl.zeros([WORDS], dtype=tl.int32)
    for s in tl.static_range(S):
        entry = tl.load(table + s * (TOR * TOC) + w)
        x = tl.load(base + (entry >> 16) * src_stride + ((entry >> 8) & 0xFF), mask=inside, other=0)
        if S == 1:
            word = x
        else:
            word |= ((x >> (entry & 0xFF)) & ((1 << F) - 1)) << (s * F)
    tl.store(dst + (i * TOR + orow) * dst_stride + j * TOC + oc, word, mask=inside)


# Marlin int4 (16-bit activations), one 16 k x 64 n tile = 128 output words, contiguous in
# the output row of its k tile: k = 8a + 2q + b, n = 16j + 8c + r; word w = 16r + 4q + j
# holds the code of (a, b, c) in nibble 4b + 2c + a. A program takes BI k tiles x BJ n
# tiles, built as one [BI, BJ, r, q, j] block (stored whole: 128 contiguous words per tile)
# from 8 block loads that each read 1/8 of the input tiles' words once, every output word
# ORed from 8 nibbles with constant shifts (no table, no gather).


@triton.jit
def _marlin_index(kt_count, nt_count, BI: tl.constexpr, BJ: tl.constexpr):
    """This program's tile indices broadcast over [BI, BJ, r, q, j] and its mask."""
    kt = tl.program_id(0) * BI + tl.arange(0, BI)
    nt = tl.program_id(1) * BJ + tl.arange(0, BJ)
    kt5 = kt[:, None, None, None, None]
    nt5 = nt[None, :, None, None, None]
    r5 = tl.arange(0, 8)[None, None, :, None, None]
    q5 = tl.arange(0, 4)[None, None, None, :, None]
    j5 = tl.arange(0, 4)[None, None, None, None, :]
    inside = (kt5 < kt_count) & (nt5 < nt_count)
    return kt5, nt5, r5, q5, j5, inside


@triton.jit
def _marlin_store(dst, dst_stride, word, kt5, nt5, r5, q5, j5, inside):
    tl.store(dst + kt5 * dst_stride + nt5 * 128 + r5 * 16 + q5 * 4 + j5, word, mask=inside)


@triton.jit
def marlin4_gptq_kernel(
    ptrs,
    slabs,
    src_stride,
    dst_stride,
    kt_count,
    nt_count,
    BI: tl.constexpr,
    BJ: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """GPTQ int4 [K/8, N] (word (kw, n): k = 8 kw + i in nibble i) -> Marlin words
    [K/16, N * 2]. Input word (2 kt + a, 64 nt + 16 j + 8 c + r) holds (q, b) in nibble
    2q + b: per (a, c) one load of [BI, BJ, r, 1, j] words (runs of 8 along r), spread
    over q by the shift."""
    src, dst = _slab(ptrs, slabs, ALIGNED)
    kt5, nt5, r5, q5, j5, inside = _marlin_index(kt_count, nt_count, BI, BJ)
    column = nt5 * 64 + j5 * 16 + r5  # [1, BJ, 8, 1, 4]
    word = tl.zeros([BI, BJ, 8, 4, 4], dtype=tl.int32)
    for a in tl.static_range(2):
        row = src + (kt5 * 2 + a) * src_stride + column
        for c in tl.static_range(2):
            x = tl.load(row + 8 * c, mask=inside, other=0)
            for b in tl.static_range(2):
                word |= ((x >> (q5 * 8 + 4 * b)) & 0xF) << (4 * (4 * b + 2 * c + a))
    _marlin_store(dst, dst_stride, word, kt5, nt5, r5, q5, j5, inside)


@triton.jit
def marlin4_awq_kernel(
    ptrs,
    slabs,
    src_stride,
    dst_stride,
    kt_count,
    nt_count,
    BI: tl.constexpr,
    BJ: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """AWQ int4 [K, N/8] (word (k, nw): column 8 nw + r in nibble r // 2 + 4 (r % 2)) ->
    Marlin words [K/16, N * 2]. Input word (16 kt + 8a + 2q + b, 8 nt + 2j + c) holds
    column r: per (a, b) one load of [BI, BJ, 1, q, 8 words (j, c)] (contiguous, so int32
    x 4 vectors), split into c = 0, 1 in registers, spread over r by the shift."""
    src, dst = _slab(ptrs, slabs, ALIGNED)
    kt5, nt5, r5, q5, j5, inside = _marlin_index(kt_count, nt_count, BI, BJ)
    shift = 4 * ((r5 % 2) * 4 + r5 // 2)  # [1, 1, 8, 1, 1]
    w8 = tl.arange(0, 8)[None, None, None, None, :]  # the 8 words (j, c) of an n tile
    first = src + (kt5 * 16 + q5 * 2) * src_stride + nt5 * 8 + w8  # [BI, BJ, 1, 4, 8]
    word = tl.zeros([BI, BJ, 8, 4, 4], dtype=tl.int32)
    for a in tl.static_range(2):
        for b in tl.static_range(2):
            x = tl.load(first + (8 * a + b) * src_stride, mask=inside, other=0)
            x0, x1 = tl.split(tl.reshape(x, [BI, BJ, 1, 4, 4, 2]))
            word |= ((x0 >> shift) & 0xF) << (4 * (4 * b + a))
            word |= ((x1 >> shift) & 0xF) << (4 * (4 * b + 2 + a))
    _marlin_store(dst, dst_stride, word, kt5, nt5, r5, q5, j5, inside)
