"""The Triton kernel of `gpu_repack` (imported only when a kernel first runs).

One program builds BI x BJ output tiles of TOR x TOC int32 words. Output word w of a tile
is the sum (= the OR: the bits are disjoint) of its S fields of F bits; field s comes from
the input word the table names (row and column inside the input tile, bit offset),
shifted from that offset to s * F. The elements are ordered so that one output row's
words are consecutive (coalesced stores); a tile's input words are re-read from L1 for
each field, so memory sees each input byte once.
"""

# Triton idiom: compile-time parameters are UPPER_CASE, kernels take many arguments.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# ruff: noqa: N803, N806, PLR0917

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl


@triton.jit
def repack_kernel(
    src: Any,
    dst: Any,
    table: Any,
    src_stride: Any,
    dst_stride: Any,
    tile_rows: Any,
    tile_cols: Any,
    TIR: tl.constexpr,
    TIC: tl.constexpr,
    TOR: tl.constexpr,
    TOC: tl.constexpr,
    S: tl.constexpr,
    F: tl.constexpr,
    BI: tl.constexpr,
    BJ: tl.constexpr,
    TRANSPOSED: tl.constexpr,
    WORD_TRANSPOSE: tl.constexpr,
) -> None:
    if WORD_TRANSPOSE:
        # 1 x 1 tiles of whole words, transposed (GPTQ -> TRITON): a 2-D block loaded
        # along the input's rows and stored along the output's, the compiler turning it
        # round through shared memory, so both sides stay coalesced.
        oi = tl.program_id(0) * BI + tl.arange(0, BI)  # output rows = input columns
        oj = tl.program_id(1) * BJ + tl.arange(0, BJ)  # output columns = input rows
        inside = (oj[:, None] < tile_cols) & (oi[None, :] < tile_rows)
        block = tl.load(src + oj[:, None] * src_stride + oi[None, :], mask=inside, other=0)
        tl.store(
            dst + oi[:, None] * dst_stride + oj[None, :],
            tl.trans(block),
            mask=(oi[:, None] < tile_rows) & (oj[None, :] < tile_cols),
        )
    else:
        WORDS: tl.constexpr = BI * TOR * BJ * TOC
        # element e = ((((ii, out row), jj), out column), field): consecutive output words
        # of one row are consecutive elements, so the stores are whole coalesced rows.
        e = tl.arange(0, WORDS * S)
        s = e % S
        t = e // S
        oc = t % TOC
        t = t // TOC
        jj = t % BJ
        t = t // BJ
        orow = t % TOR
        ii = t // TOR
        i = tl.program_id(0) * BI + ii
        j = tl.program_id(1) * BJ + jj
        mask = (i < tile_rows) & (j < tile_cols)
        entry = tl.load(table + (orow * TOC + oc) * S + s)
        r = entry >> 16
        c = (entry >> 8) & 0xFF
        if TRANSPOSED:
            offset = (j * TIR + r) * src_stride + i * TIC + c
        else:
            offset = (i * TIR + r) * src_stride + j * TIC + c
        x = tl.load(src + offset, mask=mask, other=0)
        if S > 1:
            shift = entry & 0xFF
            x = ((x >> shift) & ((1 << F) - 1)) << (s * F)
            # the fields' bits are disjoint: their sum is their OR, and has no carries
            x = tl.sum(tl.reshape(x, (WORDS, S)), axis=1)
        q = tl.arange(0, WORDS)
        qc = q % TOC
        u = q // TOC
        qj = u % BJ
        u = u // BJ
        qrow = u % TOR
        qi = u // TOR
        wi = tl.program_id(0) * BI + qi
        wj = tl.program_id(1) * BJ + qj
        store_mask = (wi < tile_rows) & (wj < tile_cols)
        tl.store(dst + (wi * TOR + qrow) * dst_stride + wj * TOC + qc, x, mask=store_mask)
