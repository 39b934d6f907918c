"""Prefill attention over packed variable-length sequences and the paged KV cache.

One program computes BLOCK_M consecutive queries of one sequence for one query head, with an
online softmax over key tiles of BLOCK_N. Query j of sequence s sits at absolute position
context_len[s] + j, so chunked prefill (earlier chunks already cached) needs nothing special:
the keys come from the cache, which write_kv has already filled with this chunk's tokens.

The key range of a query tile is cut into up to four tile-aligned pieces so that only tiles
that can hold an invisible key pay for a mask:
    [0, sink_end)            StreamingLLM sink tokens left of the window      (masked)
    [start, full_lo)         left edge of the sliding window                   (masked)
    [full_lo, full_hi)       keys every query of the tile sees                 (no mask)
    [full_hi, kv_end)        the causal diagonal, or the ragged end            (masked)

Programs come from a host-built tile list (sequence, first query) ordered longest-first, so the
expensive causal tiles start early and the grid needs no per-sequence padding. The grid is
(head, tile): the heads of one tile run side by side and share their K/V tiles through L2.

Variants (PrefillConfig, kernels/config.py; docs/performance.md has the sm_90 analysis and the
H200 sweep): KV_DESC reads K/V pages through TMA descriptors (kernels/kv_pages.py) instead of
pointer gathers (the default on Hopper for pages of 64 or more). Not PAGED, the keys are the
step's own contiguous K/V (encoder-only attention, and "fresh" prefills with no cached context
under PrefillConfig.fresh_kv), by pointers or, with KV_DESC, by row descriptors (kernels/kv_rows.py).
The pipelined-QK loop and lazy (FA4-style) rescaling lost to the plain loop at every case of
that sweep and were removed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from meshserve.attention.kernels.attn_common import (
    LOG2E,
    finish_rows,
    global_pos,
    load_kv_tile,
    local_count,
    online_softmax_step,
    scores_log2,
)
from meshserve.attention.kernels.kv_pages import load_kv_pages
from meshserve.attention.kernels.kv_rows import load_kv_rows


@triton.jit
def _tile(
    ptr, kv_loc, start_n, kv_len, kv_head, offs, stride_b, stride_t, stride_h,
    HEAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr,
    MASKED: tl.constexpr, KV_DESC: tl.constexpr,
):
    """[BLOCK_N, BLOCK] keys or values [start_n, start_n + BLOCK_N) in the cache's storage dtype.

    kv_loc: where the sequence's keys are: its block-table row (PAGED), its first token row of
    the step's K/V (KV_DESC, not PAGED), unused for pointers to its first key (neither)."""
    kp = start_n + tl.arange(0, BLOCK_N)
    tok_mask = kp < kv_len
    if KV_DESC:  # ptr is a tensor descriptor (kernels/kv_pages.py, kernels/kv_rows.py)
        if PAGED:
            x = load_kv_pages(ptr, kv_loc, start_n, kv_len, kv_head * stride_h, stride_b // stride_t, BLOCK_N, PAGE)
        else:
            x = load_kv_rows(ptr, kv_loc, start_n, kv_head * stride_h)
        if MASKED:  # rows past the end may hold anything, and 0 * NaN is NaN
            x = tl.where(tok_mask[:, None], x, 0.0)
    else:
        x = load_kv_tile(ptr, kv_loc, kp, kv_head, offs, tok_mask, stride_b, stride_t, stride_h,
                         HEAD, BLOCK, PAGE, PAGED, MASKED)  # fmt: skip
    return x


@triton.jit
def _fold_tile(
    qk, q, v_ptr, kv_loc, start_n, kv_head, dv, stride_vb, stride_vt, stride_vh,
    m_i, l_i, acc, qk_scale, softcap, slope, qp, kv_len, window, num_sink_tokens, dcp_rank,
    HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    PAGED: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SINK_TOKENS: tl.constexpr, USE_ALIBI: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DCP: tl.constexpr, KV_DESC: tl.constexpr,
):  # fmt: skip
    """Fold the raw products qk [BLOCK_M, BLOCK_N] of keys from start_n, with their values, into (m, l, acc)."""
    v = _tile(v_ptr, kv_loc, start_n, kv_len, kv_head, dv, stride_vb, stride_vt, stride_vh,
              HEAD_DV, BLOCK_DV, BLOCK_N, PAGE, PAGED, MASKED, KV_DESC).to(q.dtype)  # fmt: skip
    kp = start_n + tl.arange(0, BLOCK_N)
    s = scores_log2(qk, qk_scale, softcap, slope, qp, global_pos(kp, dcp_rank, DCP),
                    global_pos(kv_len, dcp_rank, DCP), window, num_sink_tokens,
                    USE_SOFTCAP, USE_ALIBI, MASKED, CAUSAL, USE_WINDOW, USE_SINK_TOKENS)  # fmt: skip
    m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, v, MASKED, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _key_range(
    k_ptr, v_ptr, kv_loc, kv_head, q, d, dv, start, end,
    m_i, l_i, acc, qk_scale, softcap, slope, qp, kv_len, window, num_sink_tokens,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, dcp_rank,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SINK_TOKENS: tl.constexpr,
    USE_ALIBI: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, DCP: tl.constexpr,
    KV_DESC: tl.constexpr,
):
    # start, end, kv_len count local slots; masks and ALiBi read global positions (kpg).
    for start_n in range(start, end, BLOCK_N):
        k = _tile(k_ptr, kv_loc, start_n, kv_len, kv_head, d, stride_kb, stride_kt, stride_kh,
                  HEAD_D, BLOCK_D, BLOCK_N, PAGE, PAGED, MASKED, KV_DESC)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
        m_i, l_i, acc = _fold_tile(
            qk, q, v_ptr, kv_loc, start_n, kv_head, dv, stride_vb, stride_vt, stride_vh, m_i, l_i, acc, qk_scale,
            softcap, slope, qp, kv_len, window, num_sink_tokens, dcp_rank, HEAD_DV, BLOCK_DV, BLOCK_N, PAGE,
            PAGED, MASKED, CAUSAL, USE_WINDOW, USE_SINK_TOKENS, USE_ALIBI, USE_SOFTCAP, DOT_PRECISION, DCP,
            KV_DESC,
        )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,
    tile_seq_ptr, tile_q0_ptr,  # [num_tiles] int32: sequence and first query of each program
    qsl_ptr,  # [S + 1] int32 query_start_loc
    kv_len_ptr,  # [S] int32 keys per sequence (seq_lens, encoder lens, or query lens)
    pos_ptr,  # [S] int32 seq_lens: the new queries sit at positions [seq_len - q_len, seq_len)
    bt_ptr,  # [S, max_blocks] int32 block table (paged only)
    sinks_ptr, alibi_ptr, k_scale_ptr, v_scale_ptr,
    sm_scale, softcap, window, num_sink_tokens, dcp_rank,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    QUERIES_PER_KV: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGE: tl.constexpr, PAGED: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SINK_TOKENS: tl.constexpr, USE_SINKS: tl.constexpr, USE_ALIBI: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr, FP8_AS_F16: tl.constexpr, RETURN_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DCP: tl.constexpr,
    # k_ptr, v_ptr are descriptors: over the cache's page rows (PAGED, kernels/kv_pages.py) or over
    # the step's K/V rows (not PAGED, kernels/kv_rows.py)
    KV_DESC: tl.constexpr = False,
):  # fmt: skip
    head = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = head // QUERIES_PER_KV
    seq = tl.load(tile_seq_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    kv_len = local_count(tl.load(kv_len_ptr + seq), dcp_rank, DCP)  # keys this rank stores
    context = tl.load(pos_ptr + seq) - q_len  # absolute position of the sequence's first new query

    rows = q0 + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    qp = context + rows
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_ptrs = q_ptr + (q_start + rows).to(tl.int64)[:, None] * stride_qt + head * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None] & (d[None, :] < HEAD_D), other=0.0)
    if FP8_AS_F16:
        q = q.to(tl.float16)  # K/V tiles follow q's dtype in the products

    qk_scale = sm_scale
    v_scale = 1.0
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_ALIBI:
        slope += tl.load(alibi_ptr + head)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_SINKS:
        # The learned sink joins the denominator as one more logit with a zero value vector.
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(sinks_ptr + head) * LOG2E
        l_i += 1.0
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    if PAGED:
        kv_loc = bt_ptr + seq.to(tl.int64) * stride_bt
        k_base = k_ptr
        v_base = v_ptr
    elif KV_DESC:  # the step's own K/V rows (fresh sequences): descriptors count rows themselves
        kv_loc = q_start
        k_base = k_ptr
        v_base = v_ptr
    else:
        kv_loc = bt_ptr
        k_base = k_ptr + q_start.to(tl.int64) * stride_kt
        v_base = v_ptr + q_start.to(tl.int64) * stride_vt

    # Key ranges (see the module docstring).
    q_last = tl.minimum(q0 + BLOCK_M, q_len) - 1
    qp_lo = context + q0
    qp_hi = context + q_last
    # Bounds are global positions, turned into this rank's local slots (identity without DCP).
    if CAUSAL:
        kv_end = local_count(qp_hi + 1, dcp_rank, DCP)
        full_hi = local_count(qp_lo + 1, dcp_rank, DCP)
    else:
        kv_end = kv_len
        full_hi = kv_len
    kv_start = 0
    full_lo = 0
    if USE_WINDOW:
        kv_start_g = tl.maximum(qp_lo - window + 1, 0)
        kv_start = local_count(kv_start_g, dcp_rank, DCP)
        full_lo = local_count(tl.maximum(qp_hi - window + 1, kv_start_g), dcp_rank, DCP)
    start = kv_start // BLOCK_N * BLOCK_N
    f0 = tl.minimum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, kv_end)
    f1 = tl.maximum(full_hi // BLOCK_N * BLOCK_N, f0)

    if USE_SINK_TOKENS:
        sink_end = tl.minimum(tl.cdiv(local_count(num_sink_tokens, dcp_rank, DCP), BLOCK_N) * BLOCK_N, start)
        m_i, l_i, acc = _key_range(
            k_base, v_base, kv_loc, kv_head, q, d, dv, 0, sink_end,
            m_i, l_i, acc, qk_scale, softcap, slope, qp, kv_len, window, num_sink_tokens,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, dcp_rank,
            HEAD_D, HEAD_DV, BLOCK_N, BLOCK_D, BLOCK_DV, PAGE, PAGED, True,
            CAUSAL, USE_WINDOW, USE_SINK_TOKENS, USE_ALIBI, USE_SOFTCAP, DOT_PRECISION, DCP, KV_DESC,
        )  # fmt: skip
    if USE_WINDOW:
        m_i, l_i, acc = _key_range(
            k_base, v_base, kv_loc, kv_head, q, d, dv, start, f0,
            m_i, l_i, acc, qk_scale, softcap, slope, qp, kv_len, window, num_sink_tokens,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, dcp_rank,
            HEAD_D, HEAD_DV, BLOCK_N, BLOCK_D, BLOCK_DV, PAGE, PAGED, True,
            CAUSAL, USE_WINDOW, USE_SINK_TOKENS, USE_ALIBI, USE_SOFTCAP, DOT_PRECISION, DCP, KV_DESC,
        )  # fmt: skip
    m_i, l_i, acc = _key_range(
        k_base, v_base, kv_loc, kv_head, q, d, dv, f0, f1,
        m_i, l_i, acc, qk_scale, softcap, slope, qp, kv_len, window, num_sink_tokens,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, dcp_rank,
        HEAD_D, HEAD_DV, BLOCK_N, BLOCK_D, BLOCK_DV, PAGE, PAGED, False,
        CAUSAL, USE_WINDOW, USE_SINK_TOKENS, USE_ALIBI, USE_SOFTCAP, DOT_PRECISION, DCP, KV_DESC,
    )  # fmt: skip
    m_i, l_i, acc = _key_range(
        k_base, v_base, kv_loc, kv_head, q, d, dv, f1, kv_end,
        m_i, l_i, acc, qk_scale, softcap, slope, qp, kv_len, window, num_sink_tokens,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, dcp_rank,
        HEAD_D, HEAD_DV, BLOCK_N, BLOCK_D, BLOCK_DV, PAGE, PAGED, True,
        CAUSAL, USE_WINDOW, USE_SINK_TOKENS, USE_ALIBI, USE_SOFTCAP, DOT_PRECISION, DCP, KV_DESC,
    )  # fmt: skip

    out, lse = finish_rows(acc, m_i, l_i, v_scale)
    o_ptrs = out_ptr + (q_start + rows).to(tl.int64)[:, None] * stride_ot + head * stride_oh + dv[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & (dv[None, :] < HEAD_DV))
    if RETURN_LSE:
        tl.store(lse_ptr + (q_start + rows).to(tl.int64) * stride_lt + head * stride_lh, lse, mask=row_mask)
