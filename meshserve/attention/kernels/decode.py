"""Split-KV decode attention (flash-decoding) over the paged cache.

Grid (decode sequence, KV head, split). Each program loads one tile of keys and values at a time
for one KV head and uses it for all the query heads of that GQA group at once (rows of the dot
product are query heads, padded to BLOCK_H >= 16 for the tensor cores), so each KV byte is read
once per step, as TensorRT-LLM's XQA does. The visible keys of a sequence ([window start, end),
plus StreamingLLM sink tokens on split 0) are cut into partitions of `partition` keys (or, when
`partition` is 0, into as many equal whole-tile parts as there are splits, per sequence: the
form a CUDA graph replays at any length); a program handles one partition and writes its
partial (o, lse), which the LSE merge combines. With one
split the program writes the final output directly.

Decode is memory bound: every key tile is loaded with a mask (the cost is a predicate, not a
byte), which keeps one code path for the partition tail, the window edge and the sink tokens.
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


@triton.jit
def _decode_range(
    k_ptr, v_ptr, bt_row, kv_head, q, d, dv, start, end,
    m_i, l_i, acc, qk_scale, softcap, slope, qp_rows,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, dcp_rank,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, PAGE: tl.constexpr, USE_ALIBI: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DCP: tl.constexpr,
):  # fmt: skip
    for start_n in range(start, end, BLOCK_N):
        kp = start_n + tl.arange(0, BLOCK_N)
        tok_mask = kp < end
        k = load_kv_tile(k_ptr, bt_row, kp, kv_head, d, tok_mask, stride_kb, stride_kt, stride_kh,
                         HEAD_D, BLOCK_D, PAGE, True, True)
        v = load_kv_tile(v_ptr, bt_row, kp, kv_head, dv, tok_mask, stride_vb, stride_vt, stride_vh,
                         HEAD_DV, BLOCK_DV, PAGE, True, True)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
        # Every key of [start, end) is visible to the decode query; only the tail is masked.
        s = scores_log2(qk, qk_scale, softcap, slope, qp_rows, global_pos(kp, dcp_rank, DCP),
                        global_pos(end, dcp_rank, DCP), 0, 0, USE_SOFTCAP, USE_ALIBI, True, False, False, False)
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, v.to(q.dtype), True, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def decode_kernel(
    q_ptr, k_ptr, v_ptr,
    out_ptr, lse_ptr,  # [NS, num_decodes, H, DV] / [NS, num_decodes, H] partials, or final rows
    qsl_ptr, kv_len_ptr, pos_ptr, bt_ptr,
    sinks_ptr, alibi_ptr, k_scale_ptr, v_scale_ptr,
    first_seq, sm_scale, softcap, window, num_sink_tokens, partition, dcp_rank,
    stride_qt, stride_qh, stride_on, stride_ot, stride_oh, stride_ln, stride_lt, stride_lh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    QUERIES_PER_KV: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGE: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SINK_TOKENS: tl.constexpr,
    USE_SINKS: tl.constexpr, USE_ALIBI: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr, FP8_AS_F16: tl.constexpr, WRITE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DCP: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)  # index among the decode sequences
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = first_seq + i
    tok = tl.load(qsl_ptr + seq)
    kv_len = local_count(tl.load(kv_len_ptr + seq), dcp_rank, DCP)  # keys this rank stores
    qp = tl.load(pos_ptr + seq) - 1  # the decode query's absolute (global) position

    g = tl.arange(0, BLOCK_H)
    head_mask = g < QUERIES_PER_KV
    heads = kv_head * QUERIES_PER_KV + g
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + tok.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=head_mask[:, None] & (d[None, :] < HEAD_D), other=0.0)
    if FP8_AS_F16:
        q = q.to(tl.float16)  # K/V tiles follow q's dtype in the products

    qk_scale = sm_scale
    v_scale = 1.0
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    slope = tl.zeros([BLOCK_H], dtype=tl.float32)
    if USE_ALIBI:
        slope = tl.load(alibi_ptr + heads, mask=head_mask, other=0.0)
    qp_rows = tl.zeros([BLOCK_H], dtype=tl.int32) + qp
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if USE_SINKS:
        if split == 0:
            m_i = tl.load(sinks_ptr + heads, mask=head_mask, other=0.0) * LOG2E
            l_i += 1.0
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt

    lo = 0  # first visible local slot
    if USE_WINDOW:
        lo = local_count(tl.maximum(qp - window + 1, 0), dcp_rank, DCP)
    if partition <= 0:
        # Partition from this sequence's own length (a CUDA graph fixes the number of splits, not
        # the lengths it will replay with): the splits share the visible keys in whole tiles.
        partition = tl.cdiv(tl.cdiv(kv_len - lo, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    start = lo + split * partition
    end = tl.minimum(start + partition, kv_len)
    if USE_SINK_TOKENS:
        if split == 0:
            m_i, l_i, acc = _decode_range(
                k_ptr, v_ptr, bt_row, kv_head, q, d, dv, 0, tl.minimum(local_count(num_sink_tokens, dcp_rank, DCP), lo),
                m_i, l_i, acc, qk_scale, softcap, slope, qp_rows,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, dcp_rank,
                HEAD_D, HEAD_DV, BLOCK_N, BLOCK_D, BLOCK_DV, PAGE, USE_ALIBI, USE_SOFTCAP, DOT_PRECISION, DCP,
            )  # fmt: skip
    m_i, l_i, acc = _decode_range(
        k_ptr, v_ptr, bt_row, kv_head, q, d, dv, start, end,
        m_i, l_i, acc, qk_scale, softcap, slope, qp_rows,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, dcp_rank,
        HEAD_D, HEAD_DV, BLOCK_N, BLOCK_D, BLOCK_DV, PAGE, USE_ALIBI, USE_SOFTCAP, DOT_PRECISION, DCP,
    )  # fmt: skip

    out, lse = finish_rows(acc, m_i, l_i, v_scale)
    o_ptrs = out_ptr + split * stride_on + i * stride_ot + heads[:, None] * stride_oh + dv[None, :]
    # A split past the sequence's keys (not split 0, which holds the sinks) writes its LSE (-inf)
    # only: the merge does not read an empty part's output.
    if (start < end) | (split == 0) | (tl.num_programs(2) == 1):
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None] & (dv[None, :] < HEAD_DV))
    if WRITE_LSE:
        tl.store(lse_ptr + split * stride_ln + i * stride_lt + heads * stride_lh, lse, mask=head_mask)
