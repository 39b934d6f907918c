"""MLA decode in FlashMLA's structure: 64 (or 128) heads as the rows of every product, latent tiles
copied several tiles ahead, the 512 output columns optionally split between two programs.
Prepared, not yet measured: the backend runs it only when its MLADecodeConfig asks
(`flashmla_decode_config`), never by default.

The same function as kernels/mla_decode.py (see there: absorbed queries, one latent "KV head",
split-KV with partial (o_lat, lse) merged by LSE, `partition` 0 for a CUDA graph's plan). What
differs is how a program's work is cut, after FlashMLA's sm90 kernel:

- A program owns BLOCK_H heads (64 on the GPU: wgmma's M) of one decode row and one KV split, and
  VALUE_SPLIT programs (1 or 2) share that (head block, split): each keeps the fp32 accumulator
  of R / VALUE_SPLIT output columns only. With 2, [64, 256] fp32 is 64 registers a thread at 8
  warps instead of 128, which leaves room for 64-key tiles (the 32-key tiles of the other kernel
  were forced by the registers; docs/performance.md, "MLA decode"). FlashMLA's two warpgroups
  split the columns inside one CTA and exchange the probabilities through shared memory; Triton
  has no such exchange, so here each of the two programs recomputes the scores (the QK product
  is 576 of the 1,088 flops a key and head costs: 1.53x the tensor work) and the pair reads
  each cache row twice, the second time from L2 (the parts are the fastest grid dimension, so
  the two run together).
- Each cache row is read once per program and used twice: its own columns are the value for
  P V and a part of the key for Q K^T; the other part's columns and the rope tail complete the
  key. Three loads of [BLOCK_N, 256 | 256 | 64] (576 is not a power of two), no second load
  for the value.
- Online softmax in registers (base 2), one rescale of the accumulator per tile.
- Copies run ahead of the work: a tile's block ids are loaded one tile early, so its address
  depends on no load of the iteration and Triton's pipeliner keeps num_stages - 1 tiles in
  flight (with the ids loaded in the iteration, as kernels/mla_decode.py does, it issues each
  copy at the end of the previous tile and waits for it at the start of the next, at any
  num_stages). PREFETCH (with num_stages 1) loads the next tile into registers instead.

Both parts compute the same scores up to the order of the fp32 sums (own columns first), so
their softmax statistics agree to rounding; part 0 writes the split's LSE.
"""

from __future__ import annotations

import triton
import triton.language as tl

from meshserve.attention.kernels.mla_tiles import LOG2E, latent_result, load_rows, softmax_fold


@triton.jit
def _load_cols(ptrs, rows_ok, cols_ok, EVEN: tl.constexpr):
    """A [rows, cols] tile; rows not ok and (unless EVEN: every column valid) columns not ok read 0."""
    if EVEN:
        x = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
    else:
        x = tl.load(ptrs, mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
    return x


@triton.jit
def _block_ids(bt_row, first, end, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Block ids of the tile of keys [first, first + BLOCK_N): one (a tile inside a page: tiles
    are whole and pages a multiple of them) or one a key; 0 past `end` (never read there)."""
    if PAGE % BLOCK_N == 0:
        blk = tl.load(bt_row + first // PAGE, mask=first < end, other=0).to(tl.int64)
    else:
        kp = first + tl.arange(0, BLOCK_N)
        blk = tl.load(bt_row + kp // PAGE, mask=kp < end, other=0).to(tl.int64)
    return blk


@triton.jit
def _row_ptrs(cache_ptr, blk, first, stride_cb, stride_ct, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_N] pointers to the cache rows of the tile's keys."""
    kp = first + tl.arange(0, BLOCK_N)
    return cache_ptr + blk * stride_cb + (kp % PAGE).to(tl.int64) * stride_ct


@triton.jit
def mla_decode_fm_kernel(
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
    BLOCK_V: tl.constexpr, BLOCK_P: tl.constexpr, VALUE_SPLIT: tl.constexpr, PAGE: tl.constexpr,
    KV_FP8: tl.constexpr, WRITE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    # Grid (head block x value part, decode row, split): the parts of one head block fastest, so
    # the programs that read the same cache rows run side by side and share them through L2.
    head_block = tl.program_id(0) // VALUE_SPLIT
    part = tl.program_id(0) % VALUE_SPLIT
    i = tl.program_id(1)
    split = tl.program_id(2)
    R_PART: tl.constexpr = (R + VALUE_SPLIT - 1) // VALUE_SPLIT
    EVEN: tl.constexpr = (R_PART == BLOCK_V) and (R % VALUE_SPLIT == 0)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    v = tl.arange(0, BLOCK_V)
    own = part * R_PART + v  # the output columns this program accumulates
    own_ok = (v < R_PART) & (own < R)
    p = tl.arange(0, BLOCK_P)
    q_row = q_lat_ptr + i.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q_own = _load_cols(q_row + own[None, :], head_mask, own_ok, EVEN)
    if VALUE_SPLIT == 2:
        other = (1 - part) * R_PART + v  # the rest of the key: scores need every column
        other_ok = (v < R_PART) & (other < R)
        q_other = _load_cols(q_row + other[None, :], head_mask, other_ok, EVEN)
    q_pe = load_rows(q_pe_ptr + i.to(tl.int64) * stride_pt + heads[:, None] * stride_ph + p[None, :],
                     head_mask, p, P, BLOCK_P)

    kv_scale = 1.0
    if KV_FP8:
        kv_scale = tl.load(scale_ptr)
    qk_scale = sm_scale * kv_scale * LOG2E
    kv_len = tl.load(kv_len_ptr + i)
    if partition <= 0:
        # A graph's plan: this row's keys in as many equal whole-tile parts as there are splits.
        partition = tl.cdiv(tl.cdiv(kv_len, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    start = split * partition
    end = tl.minimum(start + partition, kv_len)
    bt_row = bt_ptr + i.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], dtype=tl.float32)
    if PREFETCH:
        # The next tile is loaded into registers one tile ahead, and its block ids two tiles
        # ahead, so no load waits on the block table and the copy overlaps a whole tile's work.
        blk = _block_ids(bt_row, start, end, PAGE, BLOCK_N)
        rows_n = _row_ptrs(cache_ptr, blk, start, stride_cb, stride_ct, PAGE, BLOCK_N)
        ok_n = start + tl.arange(0, BLOCK_N) < end
        lat_n = _load_cols(rows_n[:, None] + own[None, :], ok_n, own_ok, EVEN)
        if VALUE_SPLIT == 2:
            rest_n = _load_cols(rows_n[:, None] + other[None, :], ok_n, other_ok, EVEN)
        pe_n = load_rows(rows_n[:, None] + R + p[None, :], ok_n, p, P, BLOCK_P)
        blk_n = _block_ids(bt_row, start + BLOCK_N, end, PAGE, BLOCK_N)
    else:
        # Block ids one tile ahead: the tile's address then depends on no load of the same
        # iteration, and Triton's pipeliner keeps num_stages - 1 tiles in flight (with the ids
        # loaded in the iteration, the copies run one tile ahead at any num_stages).
        blk_c = _block_ids(bt_row, start, end, PAGE, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        ok = start_n + tl.arange(0, BLOCK_N) < end
        if PREFETCH:
            lat = lat_n.to(q_own.dtype)
            if VALUE_SPLIT == 2:
                rest = rest_n.to(q_own.dtype)
            pe = pe_n.to(q_pe.dtype)
            nxt = start_n + BLOCK_N
            rows_n = _row_ptrs(cache_ptr, blk_n, nxt, stride_cb, stride_ct, PAGE, BLOCK_N)
            ok_n = nxt + tl.arange(0, BLOCK_N) < end
            lat_n = _load_cols(rows_n[:, None] + own[None, :], ok_n, own_ok, EVEN)
            if VALUE_SPLIT == 2:
                rest_n = _load_cols(rows_n[:, None] + other[None, :], ok_n, other_ok, EVEN)
            pe_n = load_rows(rows_n[:, None] + R + p[None, :], ok_n, p, P, BLOCK_P)
            blk_n = _block_ids(bt_row, nxt + BLOCK_N, end, PAGE, BLOCK_N)
        else:
            rows = _row_ptrs(cache_ptr, blk_c, start_n, stride_cb, stride_ct, PAGE, BLOCK_N)
            blk_c = _block_ids(bt_row, start_n + BLOCK_N, end, PAGE, BLOCK_N)
            lat = _load_cols(rows[:, None] + own[None, :], ok, own_ok, EVEN).to(q_own.dtype)  # key part + value
            if VALUE_SPLIT == 2:
                rest = _load_cols(rows[:, None] + other[None, :], ok, other_ok, EVEN).to(q_own.dtype)
            pe = load_rows(rows[:, None] + R + p[None, :], ok, p, P, BLOCK_P).to(q_pe.dtype)
        qk = tl.dot(q_own, tl.trans(lat), input_precision=DOT_PRECISION)
        if VALUE_SPLIT == 2:
            qk = tl.dot(q_other, tl.trans(rest), qk, input_precision=DOT_PRECISION)
        qk = tl.dot(q_pe, tl.trans(pe), qk, input_precision=DOT_PRECISION)
        m_i, l_i, acc = softmax_fold(qk, ok, qk_scale, lat, m_i, l_i, acc, DOT_PRECISION)

    out, lse = latent_result(m_i, l_i, acc, kv_scale)
    o_ptrs = out_ptr + split * stride_on + i.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + own[None, :]
    # An empty split of several writes its LSE (-inf) only: the merge never reads its output.
    if (start < kv_len) | (tl.num_programs(2) == 1):
        if EVEN:
            tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None])
        else:
            tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None] & own_ok[None, :])
    if WRITE_LSE:
        if part == 0:
            tl.store(lse_ptr + split * stride_ln + i.to(tl.int64) * stride_lt + heads * stride_lh, lse,
                     mask=head_mask)
