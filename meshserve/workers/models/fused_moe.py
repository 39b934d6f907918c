"""Fused mixture-of-experts for CUDA: tokens sorted by expert, two grouped-GEMM Triton launches.

For x [T, hidden] routed to k experts per token (ids, weights [T, k]), one layer is (at every T;
a one-row-per-program decode path lost to it on the H200 and was removed, docs/performance.md):

    align   (torch ops on the device)  the T*k (token, slot) rows sorted by expert, each expert's
            run padded to a multiple of the tile height BLOCK_M; one expert id per tile
    gate_up (one launch)   h[row] = act(x[row // k] @ W13[e]^T + b13[e])        [T*k, I]
    down    (one launch)   y[row] = (h[row] @ W2[e]^T + b2[e]) * weights[row]   [T*k, hidden]
    combine (torch sum)    out[t] = sum_j y[t*k + j]                            [T, hidden]

Nothing here reads a value back to the host: every buffer is sized by the worst case (each
non-empty expert pads at most BLOCK_M - 1 rows) and tiles past the used ones exit at once, so a
CUDA graph can capture the whole layer. Empty experts own no tile; a token whose id is outside
[0, E) (expert parallelism: an expert another rank holds; a row padding a CUDA-graph bucket)
is dropped and contributes 0.

Weights use the kernel's layout, built once at load time by the model (`ExpertWeights`): both
projections row-major with the reduction dimension contiguous, gate rows before up rows. The
readable torch code of each model (moe.py, gptoss_moe.py) stays the CPU path and the oracle.
Quantised experts (FP8 block scales, MXFP4) would add their scales to `ExpertWeights` and a
dequantising load to the two kernels; nothing else changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from meshserve.errors import check
from meshserve.workers.models.expert_weights import (  # noqa: F401 (re-exported: the kernels' interface)
    ACT_SILU,
    ACT_SWIGLU_CLAMP,
    ExpertActivation,
    ExpertWeights,
    GemmTiles,
)


@triton.jit
def activate(acc_g, acc_u, alpha, limit, ACT: tl.constexpr):
    """ACT 0: silu(g) * u (exp of -|g| only, so that nothing overflows); 1: GPT-OSS's clamped SwiGLU."""
    if ACT == 0:
        e = tl.exp(-tl.abs(acc_g))
        return acc_g * tl.where(acc_g >= 0, 1.0 / (1.0 + e), e / (1.0 + e)) * acc_u
    g = tl.minimum(acc_g, limit)
    u = tl.minimum(tl.maximum(acc_u, -limit), limit)
    return (u + 1.0) * g * tl.sigmoid(alpha * g)


@dataclass(frozen=True)
class Alignment:
    """Rows sorted by expert and padded to BLOCK_M (all on the device, fixed sizes).

    sorted_rows: [max_padded] int32, flat row t*k + j of each sorted position (T*k = padding);
    block_expert: [max_padded // BLOCK_M] int32 expert of each tile (-1: unused tile);
    tokens_per_expert: [E] int64, rows routed to each expert (load statistics).
    """

    sorted_rows: torch.Tensor
    block_expert: torch.Tensor
    tokens_per_expert: torch.Tensor
    block_m: int


ALIGN_KERNEL_MAX_ROWS = 2048  # up to here (decode batches) one Triton program aligns; torch ops beyond


def align_rows(ids: torch.Tensor, num_experts: int, block_m: int, *, use_triton: bool | None = None,
               expert_load: torch.Tensor | None = None) -> Alignment:  # fmt: skip
    """Sort the T*k rows of ids [T, k] by expert, each expert's rows padded to block_m; ids
    outside [0, num_experts) are dropped. Graph-safe: no host sync, sizes from T, k, E only.

    use_triton None: on CUDA, for at most ALIGN_KERNEL_MAX_ROWS rows, one single-program kernel
    (a decode step's alignment in one launch instead of about fifteen); otherwise torch ops.
    Both give the same result (rows of an expert in their original order). expert_load [E]
    int64, when given, gets each expert's row count added (the kernel adds them itself: no
    launch of its own).
    """
    flat = ids.reshape(-1)
    n = flat.numel()
    max_padded = triton.cdiv(n + min(num_experts, n) * (block_m - 1), block_m) * block_m
    if n > 0 and (use_triton if use_triton is not None else (ids.is_cuda and n <= ALIGN_KERNEL_MAX_ROWS)):
        return _align_with_kernel(flat, num_experts, block_m, max_padded, expert_load)
    align = _align_with_torch(flat, num_experts, block_m, max_padded)
    if expert_load is not None:
        expert_load += align.tokens_per_expert
    return align


def _align_with_torch(flat: torch.Tensor, num_experts: int, block_m: int, max_padded: int) -> Alignment:
    n = flat.numel()
    dropped = (flat < 0) | (flat >= num_experts)
    bucket = torch.where(dropped, num_experts, flat)  # dropped rows sort last, into bucket E
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    start = counts.cumsum(0) - counts
    order = torch.argsort(bucket, stable=True)
    expert = bucket[order]
    safe = expert.clamp(max=num_experts - 1)
    dest = padded_start[safe] + torch.arange(n, device=flat.device) - start[safe]
    dest = torch.where(expert == num_experts, max_padded, dest)  # dropped rows land past the end
    sorted_rows = torch.full((max_padded + 1,), n, dtype=torch.int32, device=flat.device)
    sorted_rows.scatter_(0, dest, order.to(torch.int32))
    tile_start = torch.arange(0, max_padded, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, tile_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return Alignment(sorted_rows[:max_padded], block_expert, counts, block_m)


@triton.jit
def _align_kernel(
    ids_ptr, rows_ptr, block_expert_ptr, counts_ptr, load_ptr, n, num_experts, max_padded, num_tiles,
    BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr, ADD_LOAD: tl.constexpr,
):  # fmt: skip
    # One program. Rows are matched against every expert as a [CHUNK, E] one-hot, so counts,
    # ranks among an expert's rows and tile owners are sums and prefix sums of it.
    experts = tl.arange(0, E_POW2)
    e_ok = experts < num_experts
    counts = tl.zeros([E_POW2], dtype=tl.int32)
    for start in range(0, n, CHUNK):
        r = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + r, mask=r < n, other=-1)
        counts += tl.sum(((e[:, None] == experts[None, :]) & e_ok[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    tl.store(counts_ptr + experts, counts.to(tl.int64), mask=e_ok)
    if ADD_LOAD:  # the layer's load counters (one program: no other writer)
        tl.store(load_ptr + experts, tl.load(load_ptr + experts, mask=e_ok, other=0) + counts.to(tl.int64), mask=e_ok)
    for start in range(0, max_padded, FILL):  # padding everywhere, then the rows over it
        p = start + tl.arange(0, FILL)
        tl.store(rows_ptr + p, tl.zeros([FILL], dtype=tl.int32) + n, mask=p < max_padded)
    tl.debug_barrier()
    seen = tl.zeros([E_POW2], dtype=tl.int32)  # rows of each expert placed so far
    for start in range(0, n, CHUNK):
        r = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + r, mask=r < n, other=-1)
        hit = ((e[:, None] == experts[None, :]) & e_ok[None, :]).to(tl.int32)  # [CHUNK, E]
        earlier = tl.cumsum(hit, axis=0) - hit  # rows of the same expert before it in this chunk
        dest = tl.sum(hit * ((padded_start + seen)[None, :] + earlier), axis=1)
        tl.store(rows_ptr + dest, r.to(tl.int32), mask=tl.sum(hit, axis=1) > 0)
        seen += tl.sum(hit, axis=0)
    for start in range(0, num_tiles, FILL):  # a tile's expert: how many padded runs end at or before it
        t = start + tl.arange(0, FILL)
        ended = (padded_end[None, :] <= (t * BLOCK_M)[:, None]) & e_ok[None, :]
        owner = tl.sum(ended.to(tl.int32), axis=1)
        tl.store(block_expert_ptr + t, tl.where(owner < num_experts, owner, -1), mask=t < num_tiles)


def _align_with_kernel(flat: torch.Tensor, num_experts: int, block_m: int, max_padded: int,
                       expert_load: torch.Tensor | None) -> Alignment:  # fmt: skip
    device = flat.device
    rows = torch.empty(max_padded, dtype=torch.int32, device=device)
    tiles = max_padded // block_m
    block_expert = torch.empty(tiles, dtype=torch.int32, device=device)
    counts = torch.empty(num_experts, dtype=torch.int64, device=device)
    e_pow2 = triton.next_power_of_2(num_experts)
    # [width, E] one-hot tiles of at most 8192 entries, and no wider than the rows need: a decode
    # step's few rows (k at bs 1) take [16, E] tiles, not [8192 / E, E] ones mostly masked.
    width = max(16, min(triton.next_power_of_2(max(flat.numel(), tiles)), 8192 // e_pow2))
    if expert_load is not None:
        check(tuple(expert_load.shape) == (num_experts,) and expert_load.dtype == torch.int64, "expert_load",
              f"{tuple(expert_load.shape)} {expert_load.dtype}", f"[{num_experts}] int64")  # fmt: skip
    load = expert_load if expert_load is not None else counts  # (not read without ADD_LOAD)
    _align_kernel[(1,)](flat.contiguous(), rows, block_expert, counts, load, flat.numel(), num_experts, max_padded,
                        tiles, BLOCK_M=block_m, E_POW2=e_pow2, CHUNK=width, FILL=width,
                        ADD_LOAD=expert_load is not None, num_warps=4)  # fmt: skip
    return Alignment(rows, block_expert, counts, block_m)


@triton.jit
def _tile(rows_ptr, block_expert_ptr, num_rows, num_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (m, n)'s expert (-1: unused tile), its BLOCK_M sorted rows and BLOCK_N columns."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, rows, rows < num_rows, cols, cols < num_cols


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, b_ptr, h_ptr, rows_ptr, block_expert_ptr,
    num_rows, hidden, inter, stride_x, stride_we, stride_wn, alpha, limit,
    TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # Program (m, n): tile m of the sorted rows (one expert), intermediate columns n*BLOCK_N...
    expert, rows, row_ok, cols, col_ok = _tile(rows_ptr, block_expert_ptr, num_rows, inter, BLOCK_M, BLOCK_N)
    if expert < 0:
        return
    token = rows // TOP_K
    ks = tl.arange(0, BLOCK_K)
    w_gate = w_ptr + expert * stride_we + cols[None, :] * stride_wn  # [1, BN]: W13[e, col, :]
    w_up = w_gate + inter * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + ks
        k_ok = k < hidden
        a = tl.load(x_ptr + token[:, None] * stride_x + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wmask = k_ok[:, None] & col_ok[None, :]
        g = tl.load(w_gate + k[:, None], mask=wmask, other=0.0)  # [BK, BN]
        u = tl.load(w_up + k[:, None], mask=wmask, other=0.0)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
    if HAS_BIAS:
        acc_g += tl.load(b_ptr + expert * 2 * inter + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptr + expert * 2 * inter + inter + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    h = activate(acc_g, acc_u, alpha, limit, ACT)
    tl.store(h_ptr + rows[:, None] * inter + cols[None, :], h.to(h_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


@triton.jit(do_not_specialize=["num_tiles", "top_k"])  # (read only with ZERO_PADDING: no variants)
def _down_kernel(
    h_ptr, w_ptr, b_ptr, route_ptr, y_ptr, rows_ptr, block_expert_ptr, real_ptr,
    num_rows, hidden, inter, stride_we, stride_wn, num_tiles, top_k,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, ZERO_PADDING: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # Program (m, n): tile m of the sorted rows, output columns n*BLOCK_N...; y[row] is weighted.
    if ZERO_PADDING:
        if tl.program_id(0) == num_tiles:  # the extra programs: the padding tokens' rows (no tile) get 0
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=y_ptr.dtype.element_ty)
            for r0 in range(tl.load(real_ptr).to(tl.int32) * top_k, num_rows, BLOCK_M):
                r = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)
                tl.store(y_ptr + r[:, None] * hidden + cols[None, :], zeros,
                         mask=(r < num_rows)[:, None] & (cols < hidden)[None, :])  # fmt: skip
            return
    expert, rows, row_ok, cols, col_ok = _tile(rows_ptr, block_expert_ptr, num_rows, hidden, BLOCK_M, BLOCK_N)
    if expert < 0:
        return
    ks = tl.arange(0, BLOCK_K)
    w_cols = w_ptr + expert * stride_we + cols[None, :] * stride_wn  # W2[e, col, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + ks
        k_ok = k < inter
        a = tl.load(h_ptr + rows[:, None] * inter + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * hidden + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(route_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + rows[:, None] * hidden + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


@dataclass(frozen=True)
class TileConfig:
    """The sorted path's tiles: block_m rows per tile (the alignment pads to it), then each GEMM's."""

    block_m: int
    gate_up: GemmTiles
    down: GemmTiles


# The tile choices, in one place (`python -m bench.moe_layer --sweep` prints a replacement).
# Sorted path, by rows per expert (T * k / E): decode-like sizes stream weights through narrow
# tiles, GEMV-like, many programs in flight; prefill takes tall tiles so that each weight tile
# serves many rows (gate_up holds 2 * block_m * block_n float32 accumulators per program).
TILE_TABLE: tuple[tuple[float, TileConfig], ...] = (
    (16, TileConfig(16, GemmTiles(32, 128), GemmTiles(64, 128))),
    (64, TileConfig(32, GemmTiles(64, 64), GemmTiles(128, 64))),
    (float("inf"), TileConfig(64, GemmTiles(64, 64, 8), GemmTiles(128, 64, 8))),
)


def tile_config(num_rows: int, num_experts: int) -> TileConfig:
    """The sorted path's tiles for num_rows = T * k rows over num_experts experts (TILE_TABLE)."""
    per_expert = num_rows / max(num_experts, 1)
    return next(cfg for limit, cfg in TILE_TABLE if per_expert <= limit)


def fused_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: ExpertWeights, *,
              config: TileConfig | None = None, alignment: Alignment | None = None,
              may_drop: bool = False, expert_load: torch.Tensor | None = None,
              sum_rows: bool = True, num_real_tokens: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t, in two grouped GEMMs.

    x: [T, H] (fp32/fp16/bf16); weights: [T, k] (any float dtype); ids: [T, k] int64 in
    [0, E), or anything else for a slot to drop when may_drop (expert parallelism: the expert
    lives on another rank). Returns [T, H] in x's dtype. Rows are sorted by expert
    (`alignment`, from align_rows with config.block_m, may be passed). expert_load [E] int64,
    when given, gets each expert's row count added (load statistics, from the alignment).
    sum_rows False: the weighted rows [T, k, H] unsummed (torch.sum over k is the caller's, or
    fused_ops.add_rms_norm's given them as a DeferredSum: one launch less).
    num_real_tokens ([1] int32/int64 on the device, or None): tokens at and after it pad a
    CUDA-graph bucket, their ids all dropped (the router's doing): no tile computes them and
    one extra row of down-projection programs writes their rows as 0 (no launch of its own, and
    no memset of y), so that the sum, or the norm summing a DeferredSum, reads zeros there.
    """
    T, k = ids.shape
    H, E, inter = x.shape[1], experts.num_experts, experts.intermediate
    check(tuple(weights.shape) == (T, k), "weights", tuple(weights.shape), f"[{T}, {k}] like ids")
    check(x.shape[0] == T and experts.w13.shape[2] == H, "x", tuple(x.shape), f"[{T}, {experts.w13.shape[2]}]")
    check(experts.w13.dtype == x.dtype, "x", x.dtype, f"the experts' dtype {experts.w13.dtype}")
    cfg = config or tile_config(T * k, E)
    if alignment is None:
        align = align_rows(ids, E, cfg.block_m, expert_load=expert_load)
    else:
        align = alignment
        if expert_load is not None:
            expert_load += align.tokens_per_expert
    check(align.block_m == cfg.block_m, "alignment", align.block_m, f"block_m={cfg.block_m} of the tile config")
    n = T * k
    if n == 0:
        return torch.empty((T, H) if sum_rows else (T, k, H), dtype=x.dtype, device=x.device)
    x = x if x.stride(-1) == 1 else x.contiguous()
    precision = "ieee" if x.dtype == torch.float32 else None  # fp32: exact, as the reference
    h = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    tiles = align.block_expert.numel()
    w13, w2 = experts.w13, experts.w2
    act = experts.activation
    gu, dn = cfg.gate_up, cfg.down
    _gate_up_kernel[(tiles, triton.cdiv(inter, gu.block_n))](
        x, w13, experts.b13 if experts.b13 is not None else w13, h, align.sorted_rows, align.block_expert,
        n, H, inter, x.stride(0), w13.stride(0), w13.stride(1), act.alpha, act.limit,
        TOP_K=k, HAS_BIAS=experts.b13 is not None, ACT=act.kind, PRECISION=precision,
        BLOCK_M=cfg.block_m, BLOCK_N=gu.block_n, BLOCK_K=gu.block_k,
        num_warps=gu.num_warps, num_stages=gu.num_stages,
    )  # fmt: skip
    # Rows of dropped slots are never written: zeros, so that the sum ignores them.
    y = (torch.zeros if may_drop else torch.empty)((n, H), dtype=x.dtype, device=x.device)
    route = weights.reshape(-1).contiguous()
    zero_padding = num_real_tokens is not None and not may_drop  # (may_drop: y is zeros already)
    _down_kernel[(tiles + zero_padding, triton.cdiv(H, dn.block_n))](
        h, w2, experts.b2 if experts.b2 is not None else w2, route, y, align.sorted_rows, align.block_expert,
        num_real_tokens if zero_padding else align.block_expert, n, H, inter, w2.stride(0), w2.stride(1), tiles, k,
        HAS_BIAS=experts.b2 is not None, PRECISION=precision, ZERO_PADDING=zero_padding,
        BLOCK_M=cfg.block_m, BLOCK_N=dn.block_n, BLOCK_K=dn.block_k,
        num_warps=dn.num_warps, num_stages=dn.num_stages,
    )  # fmt: skip
    return torch.sum(y.view(T, k, H), dim=1) if sum_rows else y.view(T, k, H)

