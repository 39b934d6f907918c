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


@triton.jit
def latent_tile(q_lat, q_pe, cache_ptr, rows, ok, r, p, m_i, l_i, acc, qk_scale,
                R: tl.constexpr, P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                DOT_PRECISION: tl.constexpr):  # fmt: skip
    """One tile of latent-space attention for a block of heads: the cache rows at element offsets
    `rows` [N] (those where `ok`), [c | k_pe] each, scored against q_lat [BH, R] and q_pe [BH, P]
    and folded into the online-softmax state (m_i, l_i, acc [BH, BLOCK_R]), base 2. The latent
    is the key and the value at once. A tile with no `ok` row leaves the state unchanged.
    Returns the new (m_i, l_i, acc)."""
    lat = load_rows(cache_ptr + rows[:, None] + r[None, :], ok, r, R, BLOCK_R).to(q_lat.dtype)
    pe = load_rows(cache_ptr + rows[:, None] + R + p[None, :], ok, p, P, BLOCK_P).to(q_pe.dtype)
    qk = tl.dot(q_lat, tl.trans(lat), input_precision=DOT_PRECISION)
    qk = tl.dot(q_pe, tl.trans(pe), qk, input_precision=DOT_PRECISION)
    return softmax_fold(qk, ok, qk_scale, lat, m_i, l_i, acc, DOT_PRECISION)


@triton.jit
def softmax_fold(qk, ok, qk_scale, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Fold one tile's raw scores qk [BH, N] (keys where `ok`) and values v [N, BV] into the
    online-softmax state (m_i, l_i, acc [BH, BV]), base 2; returns the new state. A tile with no
    `ok` key leaves it unchanged (a row still at -inf max rescales by exp2(-inf - 0) = 0 times 0)."""
    s = tl.where(ok[None, :], qk * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    prob = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(prob, 1)
    acc = tl.dot(prob.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def latent_result(m_i, l_i, acc, kv_scale):
    """The online-softmax state's result: o [BH, BLOCK_R] = acc / l (times the FP8 dequantisation
    scale) and the natural-log LSE [BH]; a head that saw no key gets o = 0, LSE = -inf."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    return acc * (kv_scale / l_safe)[:, None], lse
