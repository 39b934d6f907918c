"""Sparse MLA in the latent space (absorbed weights): each query token attends to its own chosen rows.

The lightning indexer gives every query token t a list of cache rows (this rank's local rows,
-1 = none); the query of head h has been folded with W_UK, so all heads score the same rows:

    score[h, j] = (q_lat[t, h] . c_{rows[t, j]} + q_pe[t, h] . k_pe_{rows[t, j]}) * softmax_scale
    o_lat[t, h] = sum_j p[h, j] c_{rows[t, j]}      (W_UV is applied afterwards, outside the kernel)

Prefill and decode tokens are the same problem here (a query token and its index list; no
causal mask: the indexer chose only visible rows), so one kernel serves both, as DeepSeek's
FlashMLA sparse kernels attend in the latent space for prefill too: expanding K/V per query token
would cost k x heads x (nope + v) values per token. Grid (head block, token); each program reads
its token's rows once for BLOCK_H heads, gathering them through the block table tile by tile.
A token with no chosen row (a DCP rank that stores none of them) writes o = 0, lse = -inf.
"""

from __future__ import annotations

import triton
import triton.language as tl

from meshserve.attention.kernels.mla_tiles import LOG2E, latent_result, latent_tile, load_rows, store_rows


@triton.jit
def mla_sparse_kernel(
    q_lat_ptr,  # [T, H, R] absorbed queries
    q_pe_ptr,  # [T, H, P] rope part of the queries
    cache_ptr,  # [num_blocks, PAGE, R + P]
    rows_ptr,  # [T, K] int32 chosen local cache rows (-1: none)
    seq_ptr,  # [T] int32 block-table row (sequence) of each token
    bt_ptr,  # [S, max_blocks] int32
    out_ptr,  # [T, H, R]
    lse_ptr,  # [T, H] float32
    scale_ptr,  # [] float32 FP8 dequantisation scale
    sm_scale, num_heads, topk,
    stride_qt, stride_qh, stride_pt, stride_ph,
    stride_cb, stride_ct, stride_rt, stride_bt,
    stride_ot, stride_oh, stride_lt, stride_lh,
    R: tl.constexpr, P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, PAGE: tl.constexpr, KV_FP8: tl.constexpr,
    WRITE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    head_block = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    q_lat = load_rows(q_lat_ptr + t * stride_qt + heads[:, None] * stride_qh + r[None, :], head_mask, r, R, BLOCK_R)
    q_pe = load_rows(q_pe_ptr + t * stride_pt + heads[:, None] * stride_ph + p[None, :], head_mask, p, P, BLOCK_P)

    kv_scale = 1.0
    if KV_FP8:
        kv_scale = tl.load(scale_ptr)
    qk_scale = sm_scale * kv_scale * LOG2E
    bt_row = bt_ptr + tl.load(seq_ptr + t).to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for start_n in range(0, topk, BLOCK_N):
        j = start_n + tl.arange(0, BLOCK_N)
        row = tl.load(rows_ptr + t * stride_rt + j, mask=j < topk, other=-1)
        ok = row >= 0
        row = tl.where(ok, row, 0)
        blk = tl.load(bt_row + row // PAGE, mask=ok, other=0).to(tl.int64)
        at = blk * stride_cb + (row % PAGE).to(tl.int64) * stride_ct
        m_i, l_i, acc = latent_tile(q_lat, q_pe, cache_ptr, at, ok, r, p, m_i, l_i, acc, qk_scale,
                                    R, P, BLOCK_R, BLOCK_P, DOT_PRECISION)  # fmt: skip

    out, lse = latent_result(m_i, l_i, acc, kv_scale)
    store_rows(out_ptr + t * stride_ot + heads[:, None] * stride_oh + r[None, :], out.to(out_ptr.dtype.element_ty),
               head_mask, r, R, BLOCK_R)  # fmt: skip
    if WRITE_LSE:
        tl.store(lse_ptr + t * stride_lt + heads * stride_lh, lse, mask=head_mask)
