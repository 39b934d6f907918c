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
    """[R, BLOCK] tile of the rows where rows_ok (others read 0), columns past N read 0."""
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
