"""The Triton kernel of `gpu_repack` (imported only when a kernel first runs).

One program builds BI x BJ output tiles of TOR x TOC int32 words. Output word w of a tile
is the sum (= the OR: the bits are disjoint) of its S fields of F bits; field s comes from
the input word the table names (row and column inside the input tile, bit offset),
shifted from that offset to s * F. Elements are ordered so that a warp's lanes read
neighbouring input words for each field (coalesced loads, S per word; a transposed
route then scatters its one store per word); every input byte comes from memory once.
"""

# Triton idiom: compile-time parameters are UPPER_CASE, kernels take many arguments. The
# runtime parameters carry no annotations: the compiler evaluates them as globals and
# rejects any but tl.constexpr (the interpreter does not; tests/formats/test_gpu_repack.py
# compiles every launched variant for sm_90a).
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# ruff: noqa: N803, N806, PLR0917

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def repack_kernel(
    src,
    dst,
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
    TRANSPOSED: tl.constexpr,
    WORD_TRANSPOSE: tl.constexpr,
):
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
        # Neighbouring elements (a warp's lanes) follow the innermost digit. A field's
        # input words lie along the output's columns (oc) when not transposed, along the
        # tile rows (ii) when transposed: that digit goes innermost and the field (s)
        # just outside it, so each of a word's S loads is coalesced (one transposed store
        # per word is the cheaper side to scatter).
        e = tl.arange(0, WORDS * S)
        if TRANSPOSED:  # e = ((((out row, jj), field), out column), ii)
            ii = e % BI
            t = e // BI
            oc = t % TOC
            t = t // TOC
            s = t % S
            t = t // S
            jj = t % BJ
            orow = t // BJ
        else:  # e = ((((ii, out row), jj), field), out column)
            oc = e % TOC
            t = e // TOC
            s = t % S
            t = t // S
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
            if TRANSPOSED:
                x = tl.sum(tl.reshape(x, (TOR * BJ, S, TOC * BI)), axis=1)
            else:
                x = tl.sum(tl.reshape(x, (BI * TOR * BJ, S, TOC)), axis=1)
            x = tl.reshape(x, (WORDS,))
        q = tl.arange(0, WORDS)  # the words in the elements' order, less the field
        if TRANSPOSED:
            qi = q % BI
            u = q // BI
            qc = u % TOC
            u = u // TOC
            qj = u % BJ
            qrow = u // BJ
        else:
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
