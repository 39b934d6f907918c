"""Tile helpers shared by the MLA Triton kernels.

Scores are kept in base 2 (exp2 is one instruction); LSEs leave the kernels in natural log.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # constexpr: jitted code may not read plain globals
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def load_rows(ptrs, rows_ok, cols, N: tl.constexpr, BLOCK: tl.constexpr):
    """[R, BLOCK] tile of rows_ok rows (others read 0). When the row is exactly BLOCK wide no column
    mask is applied: a mask that varies along a row would split each 16-byte load into 2-byte ones."""
    if N == BLOCK:
        x = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
    else:
        x = tl.load(ptrs, mask=rows_ok[:, None] & (cols[None, :] < N), other=0.0)
    return x


@triton.jit
def store_rows(ptrs, x, rows_ok, cols, N: tl.constexpr, BLOCK: tl.constexpr):
    if N == BLOCK:
        tl.store(ptrs, x, mask=rows_ok[:, None])
    else:
        tl.store(ptrs, x, mask=rows_ok[:, None] & (cols[None, :] < N))
