"""Prefill of fresh sequences in Gluon for Hopper: a TMA loader warp and two consumer warpgroups.

Triton's compiler gives the portable prefill (kernels/prefill.py) no warp specialisation on
sm_90: each program waits for every `wgmma` group before its softmax, so the tensor cores sit
idle while the exponentials run (docs/performance.md: 0.70x FlashInfer 0.7's FA3-style prefill
on an H100). Gluon, Triton's lower-level dialect, states the schedule instead: one CTA holds
128 queries of one head as two consumer warpgroups of 64 rows each, and one loader warp streams
the key and value tiles of 128 keys into a ring of shared-memory stages by TMA. The warpgroups
run their QK^T and PV products as asynchronous `wgmma` from shared memory (P from registers) and
drift apart, so one's softmax overlaps the other's products (FlashAttention-3's ping-pong without
its named barriers); with `overlap` each also issues the next tile's QK^T before this tile's
softmax (FA3's intra-warpgroup overlap, 64 more registers); the loader runs ahead by the ring's
depth.

Scope: sequences with no cached context (their keys are the step's own K/V rows, one 2-D TMA box
per tile: kernels/kv_rows.py explains the view), 16-bit Q/K/V, head sizes 64 and 128, causal
or full attention, no sliding window, sinks, ALiBi or soft cap, no DCP. The backend falls back
to the portable kernel for everything else (`gluon_prefill_reasons`).

Gluon does not run in the Triton interpreter: this kernel is checked on the GPU only
(tests/gpu/test_fresh_prefill_gpu.py, kind triton_fresh_gluon, against the reference), and on CPU only that it
compiles for sm_90 (tests/unit/attention/test_prefill_gluon.py). docs/architecture.md
records that departure from the CPU-tested rule.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from meshserve.attention.kernels.host_plans import row_descriptor_reasons

# Gluon renamed its TMA load (async_copy_global_to_shared before Triton 3.7, async_load after).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)
HALF_M = 64  # query rows per consumer warpgroup (a wgmma's M)
BLOCK_M = 2 * HALF_M  # query rows per CTA: the tile list's block_m
BLOCK_N = 128  # keys per stage
STAGES = 2  # K and V tiles in flight by default: (2 x 32 KB) x 2 + Q 32 KB at head 128
MAX_STAGES = 3  # (3 x 32 KB) x 2 + Q 32 KB = 224 KB at head 128, under sm_90's 227 KB
LOADER_REGS = 24  # registers per thread of the loader warp (setmaxnreg)
CONSUMER_REGS = 208  # of the second consumer warpgroup


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_free, v_free,
            q_row, q_col, kv_row, kv_col, n_tiles,
            HALF: gl.constexpr, TILE_N: gl.constexpr, NUM_STAGES: gl.constexpr):  # fmt: skip
    """The loader warp: both warpgroups' queries, then K and V tiles into the ring. A stage is
    refilled once both warpgroups released it (k_free / v_free count two arrivals)."""
    for c in gl.static_range(2):
        mbarrier.expect(q_bar.index(c), q_desc.block_type.nbytes)
        _tma_load(q_desc, [q_row + c * HALF, q_col], q_bar.index(c), q_smem.index(c))
    for j in range(n_tiles):
        s = j % NUM_STAGES
        free_phase = ((j // NUM_STAGES) & 1) ^ 1  # a fresh barrier's "previous" phase passes at once
        mbarrier.wait(k_free.index(s), free_phase)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        _tma_load(k_desc, [kv_row + j * TILE_N, kv_col], k_ready.index(s), k_smem.index(s))
        mbarrier.wait(v_free.index(s), free_phase)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        _tma_load(v_desc, [kv_row + j * TILE_N, kv_col], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _issue_qk(q, k_smem, k_ready, j, s_layout: gl.constexpr, HALF: gl.constexpr, TILE_N: gl.constexpr,
              NUM_STAGES: gl.constexpr):  # fmt: skip
    """S = Q K^T of key tile j, issued (asynchronous: wait before reading it, then free its stage)."""
    mbarrier.wait(k_ready.index(j % NUM_STAGES), (j // NUM_STAGES) & 1)
    zero = gl.zeros([HALF, TILE_N], gl.float32, s_layout)
    return warpgroup_mma(q, k_smem.index(j % NUM_STAGES).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _softmax_pv(q, qk, v_smem, v_ready, j, m_i, l_i, acc, scale_log2, qp, kv_len, s_layout: gl.constexpr,
                o_layout: gl.constexpr, TILE_N: gl.constexpr, NUM_STAGES: gl.constexpr, MASKED: gl.constexpr,
                CAUSAL: gl.constexpr):  # fmt: skip
    """The online softmax of key tile j's scores qk, then acc += P V issued (asynchronous: wait
    before reading acc, then free the value stage). Returns (m, l, acc)."""
    sc = qk * scale_log2
    if MASKED:  # the diagonal tile and the ragged end
        kp = j * TILE_N + gl.arange(0, TILE_N, layout=gl.SliceLayout(0, s_layout))
        vis = kp[None, :] < kv_len
        if CAUSAL:
            vis = vis & (kp[None, :] <= qp[:, None])
        sc = gl.where(vis, sc, float("-inf"))
    # Every row sees key 0 in tile 0, so m is finite from the first tile on.
    m_new = gl.maximum(m_i, gl.max(sc, 1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(sc - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p_op = gl.convert_layout(p.to(q.dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    mbarrier.wait(v_ready.index(j % NUM_STAGES), (j // NUM_STAGES) & 1)
    acc = warpgroup_mma(p_op, v_smem.index(j % NUM_STAGES), acc, is_async=True)
    return m_new, l_i, acc


@gluon.jit
def _consume(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_free, v_free, out_ptr, lse_ptr,
             c: gl.constexpr, q0, q_len, q_start, head, n_tiles, scale_log2, stride_ot, stride_oh, stride_lt, stride_lh,
             HALF: gl.constexpr, HEAD_D: gl.constexpr, TILE_N: gl.constexpr, NUM_STAGES: gl.constexpr,
             CAUSAL: gl.constexpr, RETURN_LSE: gl.constexpr, OVERLAP: gl.constexpr):  # fmt: skip
    """Consumer warpgroup c: query rows [q0 + c * HALF, q0 + (c + 1) * HALF) of the sequence,
    over every key tile the loader brings (the last one masked), then its output rows."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, TILE_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    rows = q0 + c * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
    m_i = gl.full([HALF], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([HALF], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([HALF, HEAD_D], gl.float32, o_layout)
    mbarrier.wait(q_bar.index(c), 0)
    q = q_smem.index(c)
    # Tiles before the last need no mask (a fresh sequence's tile of 128 queries ends on the
    # diagonal tile, which is the last one; without a causal mask the last holds the ragged end).
    last = n_tiles - 1
    if OVERLAP:  # FA3's intra-warpgroup overlap: tile j + 1's Q K^T runs during tile j's softmax
        qk = warpgroup_mma_wait(0, deps=[_issue_qk(q, k_smem, k_ready, 0, s_layout, HALF, TILE_N, NUM_STAGES)])
        mbarrier.arrive(k_free.index(0), count=1)
        for j in range(last):
            nxt = _issue_qk(q, k_smem, k_ready, j + 1, s_layout, HALF, TILE_N, NUM_STAGES)
            m_i, l_i, acc = _softmax_pv(q, qk, v_smem, v_ready, j, m_i, l_i, acc, scale_log2, rows, q_len, s_layout,
                                        o_layout, TILE_N, NUM_STAGES, False, CAUSAL)  # fmt: skip
            qk, acc = warpgroup_mma_wait(0, deps=[nxt, acc])
            mbarrier.arrive(k_free.index((j + 1) % NUM_STAGES), count=1)
            mbarrier.arrive(v_free.index(j % NUM_STAGES), count=1)
    else:  # one tile at a time: Q K^T, softmax, P V
        for j in range(last):
            qk = warpgroup_mma_wait(0, deps=[_issue_qk(q, k_smem, k_ready, j, s_layout, HALF, TILE_N, NUM_STAGES)])
            mbarrier.arrive(k_free.index(j % NUM_STAGES), count=1)
            m_i, l_i, acc = _softmax_pv(q, qk, v_smem, v_ready, j, m_i, l_i, acc, scale_log2, rows, q_len, s_layout,
                                        o_layout, TILE_N, NUM_STAGES, False, CAUSAL)  # fmt: skip
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(v_free.index(j % NUM_STAGES), count=1)
        qk = warpgroup_mma_wait(0, deps=[_issue_qk(q, k_smem, k_ready, last, s_layout, HALF, TILE_N, NUM_STAGES)])
        mbarrier.arrive(k_free.index(last % NUM_STAGES), count=1)
    m_i, l_i, acc = _softmax_pv(q, qk, v_smem, v_ready, last, m_i, l_i, acc, scale_log2, rows, q_len, s_layout,
                                o_layout, TILE_N, NUM_STAGES, True, CAUSAL)  # fmt: skip
    acc = warpgroup_mma_wait(0, deps=[acc])
    mbarrier.arrive(v_free.index(last % NUM_STAGES), count=1)

    o_rows = q0 + c * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, o_layout))
    d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    o_ptrs = out_ptr + (q_start + o_rows).to(gl.int64)[:, None] * stride_ot + head * stride_oh + d[None, :]
    gl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=(o_rows < q_len)[:, None])
    if RETURN_LSE:
        lse = (m_i + gl.log2(l_i)) * LN2
        gl.store(lse_ptr + (q_start + rows).to(gl.int64) * stride_lt + head * stride_lh, lse, mask=rows < q_len)


@gluon.jit
def gluon_fresh_prefill_kernel(
    q_desc, k_desc, v_desc,  # over the step's rows: Q [T, H * D], K and V [T, KVH * D]; boxes [HALF, D], [TILE_N, D]
    out_ptr, lse_ptr,
    tile_seq_ptr, tile_q0_ptr,  # [num_tiles] int32: sequence and first query of each CTA (block_m = 2 * HALF)
    qsl_ptr,  # [S + 1] int32 query_start_loc
    scale_log2,  # softmax scale * log2(e)
    stride_ot, stride_oh, stride_lt, stride_lh,
    QUERIES_PER_KV: gl.constexpr, HEAD_D: gl.constexpr, HALF: gl.constexpr, TILE_N: gl.constexpr,
    NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, RETURN_LSE: gl.constexpr, OVERLAP: gl.constexpr,
    LOADER_NUM_REGS: gl.constexpr, CONSUMER_NUM_REGS: gl.constexpr,
):  # fmt: skip
    head = gl.program_id(0)
    tile = gl.program_id(1)
    seq = gl.load(tile_seq_ptr + tile)
    q0 = gl.load(tile_q0_ptr + tile)
    q_start = gl.load(qsl_ptr + seq)
    q_len = gl.load(qsl_ptr + seq + 1) - q_start
    # Keys [0, kv_end): up to the CTA's last query under a causal mask (a fresh sequence's keys
    # are its queries: position p sees keys 0..p).
    kv_end = gl.minimum(q0 + 2 * HALF, q_len) if CAUSAL else q_len
    n_tiles = gl.cdiv(kv_end, TILE_N)

    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, TILE_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, TILE_N, HEAD_D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_free = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(2):
        mbarrier.init(q_bar.index(c), count=1)
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_free.index(s), count=2)  # both warpgroups release a stage
        mbarrier.init(v_free.index(s), count=2)

    q_row = (q_start + q0).to(gl.int32)
    q_col = head * HEAD_D
    kv_row = q_start.to(gl.int32)
    kv_col = (head // QUERIES_PER_KV) * HEAD_D
    # (each partition's arguments written out: a tuple held in a variable loses its constexprs)
    gl.warp_specialize(
        [
            (_consume, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_free, v_free, out_ptr, lse_ptr, 0, q0,
                        q_len, q_start, head, n_tiles, scale_log2, stride_ot, stride_oh, stride_lt, stride_lh, HALF,
                        HEAD_D, TILE_N, NUM_STAGES, CAUSAL, RETURN_LSE, OVERLAP)),
            (_consume, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_free, v_free, out_ptr, lse_ptr, 1, q0,
                        q_len, q_start, head, n_tiles, scale_log2, stride_ot, stride_oh, stride_lt, stride_lh, HALF,
                        HEAD_D, TILE_N, NUM_STAGES, CAUSAL, RETURN_LSE, OVERLAP)),
            (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_free, v_free,
                       q_row, q_col, kv_row, kv_col, n_tiles, HALF, TILE_N, NUM_STAGES)),
        ],
        [4, 1],
        [CONSUMER_NUM_REGS, LOADER_NUM_REGS],
    )


def row_descriptor(x: torch.Tensor, box_rows: int):
    """A Gluon descriptor over x [T, heads, D] seen as rows [T, heads * D], box [box_rows, D]."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    tokens, heads, head = x.shape
    layout = gl.NVMMASharedLayout.get_default_for([box_rows, head], _GL_DTYPES[x.dtype])
    return TensorDescriptor(x, [tokens, heads * head], [x.stride(0), 1], [box_rows, head], layout)


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def gluon_prefill_reasons(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          compute_capability: tuple[int, int] | None = None) -> list[str]:  # fmt: skip
    """Why these tensors cannot go through the Gluon kernel's row descriptors (empty: they can):
    16-bit, and rows a descriptor can read (host_plans.row_descriptor_reasons, kernels/kv_rows.py's
    rule); the attention problem's own limits are the backend's (TritonBackend.gluon_prefill_reasons)."""
    out = []
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.dtype not in _GL_DTYPES:
            out.append(f"{name} dtype {x.dtype} is not bfloat16 or float16")
        out += [f"{name}: {why}" for why in row_descriptor_reasons(x, x.shape[-1], x.shape[-1], compute_capability)]
    return out


def gluon_fresh_prefill(query, key, value, out, lse, tile_seq, tile_q0, query_start_loc, softmax_scale: float,
                        *, causal: bool, return_lse: bool, overlap: bool = True,
                        stages: int = STAGES) -> None:  # fmt: skip
    """out[rows of the tiles] (and lse) of the fresh sequences named by (tile_seq, tile_q0), tiles
    of BLOCK_M queries: attention of each query over its own sequence's rows of key/value.
    overlap: tile j + 1's Q K^T in flight during tile j's softmax (FA3's intra-warpgroup overlap);
    stages: the K/V ring's depth (2 or 3)."""
    heads, head = query.shape[1], query.shape[2]
    q_desc = row_descriptor(query, HALF_M)
    k_desc, v_desc = row_descriptor(key, BLOCK_N), row_descriptor(value, BLOCK_N)
    gluon_fresh_prefill_kernel[(heads, tile_seq.numel())](
        q_desc, k_desc, v_desc, out, lse, tile_seq, tile_q0, query_start_loc, softmax_scale * LOG2E.value,
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        QUERIES_PER_KV=heads // key.shape[1], HEAD_D=head, HALF=HALF_M, TILE_N=BLOCK_N, NUM_STAGES=stages,
        CAUSAL=causal, RETURN_LSE=return_lse, OVERLAP=overlap, LOADER_NUM_REGS=LOADER_REGS,
        CONSUMER_NUM_REGS=CONSUMER_REGS, num_warps=4,
    )  # fmt: skip
