"""MLA decode in the latent space (absorbed weights), split-KV, over the paged latent cache.

The query of head h has been folded with W_UK (q_lat[h] = W_UK[h]^T q_nope[h], width
kv_lora_rank), so every head attends over the same cached rows [c | k_pe]:

    score[h, t] = (q_lat[h] . c_t + q_pe[h] . k_pe_t) * softmax_scale
    o_lat[h]    = sum_t p[h, t] c_t          (W_UV is applied afterwards, outside the kernel)

All heads share the one latent "KV head", so a program takes BLOCK_H heads as the rows of both
dot products and reads each cache row once for all of them: the latent tile is the key for the
scores and the value for the output. Grid (head block, decode sequence, split), head blocks
fastest so that the programs reading the same rows run together and share them through L2.
Each split writes a partial (o_lat, lse) that the LSE merge combines; with one split the
program writes the final o_lat directly. `partition` is the keys per split, or 0: each sequence
cut into as many equal whole-tile parts as there are splits (the form a CUDA graph replays at
any length). A split past a sequence's keys writes only its LSE (-inf): the Triton merge does
not read the output of an empty part, so a short row in a graph planned for a long
max_model_len moves no partial outputs ([heads, kv_lora_rank] float32 each) for its empty splits.

Scores are in base 2 (exp2); the LSE goes out in natural log.
"""

from __future__ import annotations

import triton
import triton.language as tl

from meshserve.attention.kernels.mla_tiles import LOG2E, latent_result, latent_tile, load_rows, store_rows


@triton.jit
def mla_decode_kernel(
    q_lat_ptr,  # [D, H, R] absorbed queries of the decode tokens
    q_pe_ptr,  # [D, H, P] rope part of the queries
    cache_ptr,  # [num_blocks, PAGE, R + P]
    out_ptr,  # [NS, D, H, R] partial outputs (or [1, D, H, R] final)
    lse_ptr,  # [NS, D, H] float32
    kv_len_ptr,  # [D] int32 keys this rank holds for each decode sequence
    bt_ptr,  # [D, max_blocks] int32 block table rows of the decode sequences
    scale_ptr,  # [] float32 FP8 dequantisation scale
    sm_scale, partition, num_heads,
    stride_qt, stride_qh, stride_pt, stride_ph,
    stride_cb, stride_ct,
    stride_on, stride_ot, stride_oh,
    stride_ln, stride_lt, stride_lh,
    stride_bt,
    R: tl.constexpr, P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, PAGE: tl.constexpr, KV_FP8: tl.constexpr,
    WRITE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    head_block = tl.program_id(0)
    i = tl.program_id(1)
    split = tl.program_id(2)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    q_lat = load_rows(q_lat_ptr + i.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + r[None, :],
                      head_mask, r, R, BLOCK_R)
    q_pe = load_rows(q_pe_ptr + i.to(tl.int64) * stride_pt + heads[:, None] * stride_ph + p[None, :],
                     head_mask, p, P, BLOCK_P)

    kv_scale = 1.0
    if KV_FP8:
        kv_scale = tl.load(scale_ptr)
    qk_scale = sm_scale * kv_scale * LOG2E
    kv_len = tl.load(kv_len_ptr + i)
    if partition <= 0:
        # A graph's plan (partition 0): this sequence's keys in as many equal whole-tile parts as
        # there are splits, so a graph captured for max_model_len spreads any length over them.
        partition = tl.cdiv(tl.cdiv(kv_len, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    start = split * partition
    end = tl.minimum(start + partition, kv_len)
    bt_row = bt_ptr + i.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        kp = start_n + tl.arange(0, BLOCK_N)
        tok_mask = kp < end
        if PAGE % BLOCK_N == 0:
            # Partitions are whole tiles, so a tile lies inside one page: one block id for it.
            blk = tl.load(bt_row + start_n // PAGE).to(tl.int64)
            rows = blk * stride_cb + (kp % PAGE).to(tl.int64) * stride_ct
        else:
            blk = tl.load(bt_row + kp // PAGE, mask=tok_mask, other=0).to(tl.int64)
            rows = blk * stride_cb + (kp % PAGE).to(tl.int64) * stride_ct
        m_i, l_i, acc = latent_tile(q_lat, q_pe, cache_ptr, rows, tok_mask, r, p, m_i, l_i, acc, qk_scale,
                                    R, P, BLOCK_R, BLOCK_P, DOT_PRECISION)  # fmt: skip

    out, lse = latent_result(m_i, l_i, acc, kv_scale)
    o_ptrs = out_ptr + split * stride_on + i.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + r[None, :]
    # An empty split of several writes its LSE (-inf) only: the merge never reads its output, and
    # a graph's splits for max_model_len leave most of them empty for a short row.
    if (start < kv_len) | (tl.num_programs(2) == 1):
        store_rows(o_ptrs, out.to(out_ptr.dtype.element_ty), head_mask, r, R, BLOCK_R)
    if WRITE_LSE:
        tl.store(lse_ptr + split * stride_ln + i.to(tl.int64) * stride_lt + heads * stride_lh, lse, mask=head_mask)
