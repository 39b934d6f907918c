"""Pieces shared by the prefill and decode attention kernels.

Scores are kept in base 2 (the kernels call exp2, one instruction on the GPU): a natural-log
score s becomes s * log2(e), and the LSE goes back to natural log on the way out (* ln 2).
Every helper is inlined into its caller by Triton; flags are constexpr, so a disabled feature
costs nothing in the compiled kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Globals read inside kernels must be constexpr instances (Triton refuses plain floats).
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def load_kv_tile(
    base_ptr,  # K or V of the cache (paged) or of the sequence's first token (contiguous)
    bt_row_ptr,  # this sequence's block-table row (paged only)
    kp,  # [BLOCK_N] int32 key positions
    kv_head,
    d,  # [BLOCK_D] feature offsets
    tok_mask,  # [BLOCK_N] bool
    stride_b,
    stride_t,
    stride_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    PAGED: tl.constexpr,
    MASK_TOK: tl.constexpr,
):
    """[BLOCK_N, BLOCK_D] tile of keys (or values) in the cache's storage dtype; padding reads 0."""
    if PAGED:
        if MASK_TOK:
            blk = tl.load(bt_row_ptr + kp // PAGE, mask=tok_mask, other=0)
        else:
            blk = tl.load(bt_row_ptr + kp // PAGE)
        off = blk.to(tl.int64) * stride_b + (kp % PAGE).to(tl.int64) * stride_t
    else:
        off = kp.to(tl.int64) * stride_t
    ptrs = base_ptr + off[:, None] + kv_head * stride_h + d[None, :]
    if HEAD_DIM == BLOCK_D:
        if MASK_TOK:
            x = tl.load(ptrs, mask=tok_mask[:, None], other=0.0)
        else:
            x = tl.load(ptrs)
    else:
        dmask = d[None, :] < HEAD_DIM
        if MASK_TOK:
            x = tl.load(ptrs, mask=tok_mask[:, None] & dmask, other=0.0)
        else:
            x = tl.load(ptrs, mask=dmask, other=0.0)
    return x


@triton.jit
def local_count(g, dcp_rank, DCP: tl.constexpr):
    """How many of the global positions [0, g) (g >= 0) this DCP rank stores: it holds positions
    dcp_rank, dcp_rank + DCP, ... at local slots 0, 1, ... (g itself without DCP)."""
    if DCP == 1:
        return g
    return (g - dcp_rank + DCP - 1) // DCP


@triton.jit
def global_pos(local, dcp_rank, DCP: tl.constexpr):
    """The global position of this DCP rank's local slot `local` (any shape)."""
    if DCP == 1:
        return local
    return local * DCP + dcp_rank


@triton.jit
def scores_log2(
    qk,  # [R, BLOCK_N] fp32 raw dot products (R = query rows or heads)
    qk_scale,  # softmax scale * k dequant scale (natural units)
    softcap,
    slope,  # [R] fp32 ALiBi slopes (ignored unless USE_ALIBI)
    qp,  # [R] int32 query positions
    kp,  # [BLOCK_N] int32 key positions
    kv_len,
    window,
    num_sink_tokens,
    USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SINK_TOKENS: tl.constexpr,
):
    """Scale, soft-cap, ALiBi and mask, in AttentionSpec's order; result in base-2 units."""
    if USE_SOFTCAP:
        s = qk * qk_scale / softcap
        # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates cleanly to +-1 at both ends.
        s = softcap * (1.0 - 2.0 / (tl.exp2(s * (2.0 * LOG2E)) + 1.0))
        s = s * LOG2E
    else:
        s = qk * (qk_scale * LOG2E)
    if USE_ALIBI:
        s += (slope * LOG2E)[:, None] * (kp[None, :] - qp[:, None]).to(tl.float32)
    if MASKED:
        vis = kp[None, :] < kv_len
        if CAUSAL:
            vis = vis & (kp[None, :] <= qp[:, None])
            if USE_WINDOW:
                in_window = (qp[:, None] - kp[None, :]) < window
                if USE_SINK_TOKENS:
                    in_window = in_window | (kp[None, :] < num_sink_tokens)
                vis = vis & in_window
        s = tl.where(vis, s, float("-inf"))
    return s


@triton.jit
def online_softmax_step(s, m_i, l_i, acc, v, MAY_BE_EMPTY: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold one tile of base-2 scores s [R, BLOCK_N] and values v [BLOCK_N, BLOCK_DV] into (m, l, acc)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MAY_BE_EMPTY:
        # A row with no visible key yet keeps m = -inf; exp2(-inf - 0) = 0 keeps it NaN-free.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def finish_rows(acc, m_i, l_i, v_scale):
    """Normalised output [R, BLOCK_DV] fp32 and natural-log LSE [R] (-inf, output 0 where l = 0)."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc * (v_scale / l_safe)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    return out, lse
