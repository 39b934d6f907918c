"""The decode path of the fused MoE: one (token, slot) row per program, no sorting, no padding.

For a handful of tokens the sort-and-pad step of fused_moe.py costs as much as a GEMM (its own
launch, and 16-row tiles that hold one real row), and the combine is one more launch. Here a
layer is two launches:

    gate_up  grid (T*k, I / BLOCK_N)  h[t*k+j] = act(x[t] @ W13[ids[t, j]]^T + b13)     [T*k, I]
    down     grid (T, H / BLOCK_N)    out[t]   = sum_j weights[t, j] (h[t*k+j] @ W2[ids[t, j]]^T + b2)

Each program is a GEMV: a [BLOCK_N, BLOCK_K] weight tile times a row, float32 accumulation.
Programs of the same weight columns run side by side (the row is the fastest grid axis), so
rows of one expert share its weight tiles through L2. The down kernel sums a token's k slots in
float32 and rounds once. A slot whose id is outside [0, E) (another rank's expert) is skipped.
The gate_up kernel also counts each expert's rows (load statistics) when given a counter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from meshserve.workers.models.expert_weights import ExpertWeights, GemmTiles


@triton.jit
def activate(acc_g, acc_u, alpha, limit, ACT: tl.constexpr):
    """ACT 0: silu(g) * u (exp of -|g| only, so that nothing overflows); 1: GPT-OSS's clamped SwiGLU."""
    if ACT == 0:
        e = tl.exp(-tl.abs(acc_g))
        return acc_g * tl.where(acc_g >= 0, 1.0 / (1.0 + e), e / (1.0 + e)) * acc_u
    g = tl.minimum(acc_g, limit)
    u = tl.minimum(tl.maximum(acc_u, -limit), limit)
    return (u + 1.0) * g * tl.sigmoid(alpha * g)


@triton.jit
def _gate_up_rows_kernel(
    x_ptr, ids_ptr, w_ptr, b_ptr, h_ptr, load_ptr,
    num_experts, hidden, inter, stride_x, stride_we, stride_wn, alpha, limit,
    TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, COUNT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    row, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(ids_ptr + row)
    if (expert < 0) | (expert >= num_experts):
        return
    if COUNT:
        if pid_n == 0:
            tl.atomic_add(load_ptr + expert, 1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    w_gate = w_ptr + expert * stride_we + cols[:, None] * stride_wn  # [BN, 1]: W13[e, col, :]
    w_up = w_gate + inter * stride_wn
    x_row = x_ptr + (row // TOP_K) * stride_x
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + ks
        k_ok = k < hidden
        a = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        wmask = col_ok[:, None] & k_ok[None, :]
        acc_g += tl.sum(tl.load(w_gate + k[None, :], mask=wmask, other=0.0).to(tl.float32) * a, axis=1)
        acc_u += tl.sum(tl.load(w_up + k[None, :], mask=wmask, other=0.0).to(tl.float32) * a, axis=1)
    if HAS_BIAS:
        acc_g += tl.load(b_ptr + expert * 2 * inter + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc_u += tl.load(b_ptr + expert * 2 * inter + inter + cols, mask=col_ok, other=0.0).to(tl.float32)
    h = activate(acc_g, acc_u, alpha, limit, ACT)
    tl.store(h_ptr + row * inter + cols, h.to(h_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _down_rows_kernel(
    h_ptr, ids_ptr, route_ptr, w_ptr, b_ptr, out_ptr,
    num_experts, hidden, inter, stride_we, stride_wn, stride_o,
    TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    token, pid_n = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = token * TOP_K + j
        expert = tl.load(ids_ptr + row)
        ok = (expert >= 0) & (expert < num_experts)
        w_cols = w_ptr + tl.where(ok, expert, 0) * stride_we + cols[:, None] * stride_wn  # W2[e, col, :]
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        k_end = tl.where(ok, inter, 0)  # a dropped slot loads nothing
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + ks
            k_ok = k < k_end
            a = tl.load(h_ptr + row * inter + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            w = tl.load(w_cols + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w * a, axis=1)
        if HAS_BIAS:
            b = tl.load(b_ptr + expert * hidden + cols, mask=cols < tl.where(ok, hidden, 0), other=0.0)
            acc += b.to(tl.float32)
        total += tl.where(ok, tl.load(route_ptr + row).to(tl.float32), 0.0) * acc
    tl.store(out_ptr + token * stride_o + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


@dataclass(frozen=True)
class RowsConfig:
    """Tiles of the two row kernels (block_m unused: one row per program)."""

    gate_up: GemmTiles
    down: GemmTiles


def fused_moe_rows(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: ExpertWeights,
                   config: RowsConfig, *, expert_load: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """fused_moe's result for x [T, H], (weights, ids) [T, k], in two launches (see the module).
    Slots with ids outside [0, E) contribute 0; expert_load [E] int64 (optional) counts rows."""
    T, k = ids.shape
    H, E, inter = x.shape[1], experts.num_experts, experts.intermediate
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids, route = ids.contiguous(), weights.contiguous()
    h = torch.empty((T * k, inter), dtype=x.dtype, device=x.device)
    w13, w2, act, gu, dn = experts.w13, experts.w2, experts.activation, config.gate_up, config.down
    _gate_up_rows_kernel[(T * k, triton.cdiv(inter, gu.block_n))](
        x, ids, w13, experts.b13 if experts.b13 is not None else w13, h,
        expert_load if expert_load is not None else ids, E, H, inter, x.stride(0), w13.stride(0),
        w13.stride(1), act.alpha, act.limit, TOP_K=k, HAS_BIAS=experts.b13 is not None, ACT=act.kind,
        COUNT=expert_load is not None, BLOCK_N=gu.block_n, BLOCK_K=gu.block_k,
        num_warps=gu.num_warps, num_stages=gu.num_stages,
    )  # fmt: skip
    _down_rows_kernel[(T, triton.cdiv(H, dn.block_n))](
        h, ids, route, w2, experts.b2 if experts.b2 is not None else w2, out, E, H, inter, w2.stride(0),
        w2.stride(1), out.stride(0), TOP_K=k, HAS_BIAS=experts.b2 is not None, BLOCK_N=dn.block_n,
        BLOCK_K=dn.block_k, num_warps=dn.num_warps, num_stages=dn.num_stages,
    )  # fmt: skip
    return out
