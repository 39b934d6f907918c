"""MLA prefill: flash attention over the expanded per-head K/V of each prefill sequence.

Prefill has many queries per key, so the expanded form (128 + 64 wide scores, 128 wide values)
costs far less arithmetic than the latent one (512 + 64 both ways). The expanded keys and
values of the sequences' cached rows are packed one sequence after another:

    k_nope [N, H, DN], v [N, H, DV]  (W_UK c and W_UV c, per head)
    k_pe   [N, DR]                   (shared by every head: read, never copied per head)

score = (q_nope . k_nope + q_pe . k_pe) * scale: two dot products of power-of-two widths, no
padding of the 192-wide head to 256. One program computes BLOCK_M queries of one head.

Positions: the key at local index j of a sequence sits at global position j * DCP + DCP_RANK
(DCP-sharded caches; 1 and 0 without DCP) and is visible to the query at position qp when that
is <= qp. The keys every row of a tile sees go through an unmasked loop; the diagonal through a
masked one.
"""

from __future__ import annotations

import triton
import triton.language as tl

from meshserve.attention.kernels.mla_tiles import LN2, LOG2E, load_rows, store_rows


@triton.jit
def _prefill_range(
    q_nope, q_pe, k_nope_ptr, k_pe_ptr, v_ptr, k_start, head, lo, hi, kv_len, qp, dcp_size, dcp_rank,
    m_i, l_i, acc, qk_scale,
    stride_kt, stride_kh, stride_pt, stride_vt, stride_vh,
    DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DN: tl.constexpr,
    BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    dn = tl.arange(0, BLOCK_DN)
    dr = tl.arange(0, BLOCK_DR)
    dv = tl.arange(0, BLOCK_DV)
    for start_n in range(lo, hi, BLOCK_N):
        j = start_n + tl.arange(0, BLOCK_N)
        tok = (k_start + j).to(tl.int64)
        tok_mask = j < kv_len
        kn = load_rows(k_nope_ptr + tok[:, None] * stride_kt + head * stride_kh + dn[None, :], tok_mask, dn, DN,
                       BLOCK_DN)
        kr = load_rows(k_pe_ptr + tok[:, None] * stride_pt + dr[None, :], tok_mask, dr, DR, BLOCK_DR)
        qk = tl.dot(q_nope, tl.trans(kn), input_precision=DOT_PRECISION)
        qk = tl.dot(q_pe, tl.trans(kr), qk, input_precision=DOT_PRECISION)
        s = qk * qk_scale
        if MASKED:
            kp = j * dcp_size + dcp_rank
            vis = tok_mask[None, :] & (kp[None, :] <= qp[:, None])
            s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key keeps m = -inf; subtracting 0 keeps exp2 NaN-free.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        prob = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(prob, 1)
        v = load_rows(v_ptr + tok[:, None] * stride_vt + head * stride_vh + dv[None, :], tok_mask, dv, DV, BLOCK_DV)
        acc = tl.dot(prob.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def mla_prefill_kernel(
    q_ptr,  # [T, H, DN + DR] queries of the prefill tokens: nope, then rope
    k_nope_ptr,  # [N, H, DN]
    k_pe_ptr,  # [N, DR]
    v_ptr,  # [N, H, DV]
    out_ptr,  # [T, H, DV]
    lse_ptr,  # [T, H] float32
    tile_seq_ptr, tile_q0_ptr,  # [num_tiles] int32: sequence and first query of each program
    qsl_ptr,  # [S + 1] int32 query start offsets
    kv_start_ptr,  # [S + 1] int32 offsets of each sequence's keys in the packed K/V
    seq_len_ptr,  # [S] int32 global lengths: the queries sit at [seq_len - q_len, seq_len)
    sm_scale, dcp_size, dcp_rank,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_pt, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_lt, stride_lh,
    DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr, RETURN_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)
    tile = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    k_start = tl.load(kv_start_ptr + seq)
    kv_len = tl.load(kv_start_ptr + seq + 1) - k_start
    context = tl.load(seq_len_ptr + seq) - q_len

    rows = q0 + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    qp = context + rows
    dn = tl.arange(0, BLOCK_DN)
    dr = tl.arange(0, BLOCK_DR)
    dv = tl.arange(0, BLOCK_DV)
    q_row = q_ptr + (q_start + rows).to(tl.int64)[:, None] * stride_qt + head * stride_qh
    q_nope = load_rows(q_row + dn[None, :], row_mask, dn, DN, BLOCK_DN)
    q_pe = load_rows(q_row + DN + dr[None, :], row_mask, dr, DR, BLOCK_DR)

    # Local keys visible to position x: j * dcp + rank <= x, i.e. j < (x - rank + dcp) // dcp.
    qp_lo = context + q0
    qp_hi = context + tl.minimum(q0 + BLOCK_M, q_len) - 1
    full = tl.minimum((qp_lo - dcp_rank + dcp_size) // dcp_size, kv_len)
    kv_end = tl.minimum((qp_hi - dcp_rank + dcp_size) // dcp_size, kv_len)
    split = full // BLOCK_N * BLOCK_N

    qk_scale = sm_scale * LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i, l_i, acc = _prefill_range(
        q_nope, q_pe, k_nope_ptr, k_pe_ptr, v_ptr, k_start, head, 0, split, kv_len, qp, dcp_size, dcp_rank,
        m_i, l_i, acc, qk_scale, stride_kt, stride_kh, stride_pt, stride_vt, stride_vh,
        DN, DR, DV, BLOCK_N, BLOCK_DN, BLOCK_DR, BLOCK_DV, False, DOT_PRECISION,
    )  # fmt: skip
    m_i, l_i, acc = _prefill_range(
        q_nope, q_pe, k_nope_ptr, k_pe_ptr, v_ptr, k_start, head, split, kv_end, kv_len, qp, dcp_size,
        dcp_rank, m_i, l_i, acc, qk_scale, stride_kt, stride_kh, stride_pt, stride_vt, stride_vh,
        DN, DR, DV, BLOCK_N, BLOCK_DN, BLOCK_DR, BLOCK_DV, True, DOT_PRECISION,
    )  # fmt: skip

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_ptrs = out_ptr + (q_start + rows).to(tl.int64)[:, None] * stride_ot + head * stride_oh + dv[None, :]
    store_rows(o_ptrs, out.to(out_ptr.dtype.element_ty), row_mask, dv, DV, BLOCK_DV)
    if RETURN_LSE:
        lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
        tl.store(lse_ptr + (q_start + rows).to(tl.int64) * stride_lt + head * stride_lh, lse, mask=row_mask)
