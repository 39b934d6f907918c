"""MoE routing in one Triton launch: logits -> scores -> bias -> best groups -> top-k -> weights.

Computes exactly moe_routing.route_torch (the oracle; see there for the semantics and the tie
rule). One program takes BLOCK_T tokens with all their experts in registers ([BLOCK_T, E]):
the scores, the group scores ([BLOCK_T, G]) and the k picks are reductions over that tile.
Each pick is the largest remaining choice, the lowest expert index among equal values, so the
ids come out by descending choice as the stable sort gives them. Nothing is read back to the
host: a decode graph holds it. A decode step's routing is one launch instead of the seven to
fifteen small torch ops (softmax, add, view/max, topk, scatter, masked_fill, topk, gather, sum,
div, mul) that route_torch issues.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshserve.workers.models.moe_routing import DROPPED, GROUP_BY, SCORINGS, RoutingSpec

_TILE = 4096  # experts x tokens per program
_DROPPED = tl.constexpr(DROPPED)


@triton.jit
def _pick(values, taken, index, valid, SIZE: tl.constexpr):
    """Per row of values [B, N]: the largest value not taken and its index (lowest among ties)."""
    cand = tl.where(taken, float("-inf"), values)
    best = tl.max(cand, axis=1)
    at = tl.min(tl.where((cand == best[:, None]) & ~taken & valid, index, SIZE), axis=1)
    return best, at


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, real_ptr, T, stride_t, scale,
    NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_REAL: tl.constexpr,
    GROUP_BY: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr, RENORM: tl.constexpr,
    E_POW2: tl.constexpr, G_POW2: tl.constexpr, K_POW2: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    e = tl.arange(0, E_POW2)
    e_ok = (e < NUM_EXPERTS)[None, :]  # [1, E]
    logits = tl.load(logits_ptr + t[:, None] * stride_t + e[None, :], mask=t_ok[:, None] & e_ok, other=0.0)
    logits = tl.where(e_ok, logits.to(tl.float32), float("-inf"))  # [BT, E]; padding experts never win
    if SCORING == 0:  # softmax
        p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        scores = p / tl.sum(p, axis=1)[:, None]
    elif SCORING == 1:  # sigmoid
        scores = tl.sigmoid(logits)
    else:  # topk_softmax: choose by the logits, softmax over the chosen ones
        scores = logits
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + e, mask=e < NUM_EXPERTS, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(e_ok, choice, float("-inf"))
    if GROUP_BY != 0:
        gid = (e // (NUM_EXPERTS // NUM_GROUPS))[None, :]  # [1, E] group of each expert
        g = tl.arange(0, G_POW2)[None, :]
        group_score = tl.full([BLOCK_T, G_POW2], float("-inf"), tl.float32)
        for i in tl.static_range(NUM_GROUPS):
            member = (gid == i) & e_ok
            vals = tl.where(member, choice, float("-inf"))
            best, at = _pick(vals, ~member, e[None, :], member, E_POW2)
            if GROUP_BY == 2:  # the sum of the group's best two (a tied best counts twice)
                best += tl.max(tl.where(e[None, :] == at[:, None], float("-inf"), vals), axis=1)
            group_score = tl.where(g == i, best[:, None], group_score)
        kept = tl.zeros([BLOCK_T, G_POW2], dtype=tl.int32) != 0
        for _ in tl.static_range(TOPK_GROUPS):
            _, at = _pick(group_score, kept, g, g < NUM_GROUPS, G_POW2)
            kept = kept | (g == at[:, None])
        keep = tl.zeros([BLOCK_T, E_POW2], dtype=tl.int32) != 0
        for i in tl.static_range(NUM_GROUPS):
            chosen = tl.max(tl.where(g == i, kept.to(tl.int32), 0), axis=1) > 0  # [BT]
            keep = keep | ((gid == i) & chosen[:, None])
        if SCORING == 0:  # masked softmax scores are 0 (they stay eligible, as in torch)
            choice = tl.where(keep | ~e_ok, choice, 0.0)
        else:
            choice = tl.where(keep | ~e_ok, choice, float("-inf"))
    k = tl.arange(0, K_POW2)[None, :]
    taken = tl.zeros([BLOCK_T, E_POW2], dtype=tl.int32) != 0
    weight = tl.zeros([BLOCK_T, K_POW2], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, K_POW2], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best, at = _pick(choice, taken, e[None, :], e_ok, E_POW2)
        hit = e[None, :] == at[:, None]
        taken = taken | hit
        if SCORING == 1:  # sigmoid: the score, without the correction bias
            best = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        weight = tl.where(k == j, best[:, None], weight)
        ids = tl.where(k == j, at.to(tl.int64)[:, None], ids)
    k_ok = k < TOP_K
    if SCORING == 2:
        p = tl.where(k_ok, tl.exp(weight - tl.max(tl.where(k_ok, weight, float("-inf")), axis=1)[:, None]), 0.0)
        weight = p / tl.sum(p, axis=1)[:, None]
    if RENORM:
        weight = weight / (tl.sum(tl.where(k_ok, weight, 0.0), axis=1)[:, None] + 1e-20)
    weight = weight * scale
    if HAS_REAL:  # rows at and after the real count pad a graph bucket: no expert, no weight
        real = (t < tl.load(real_ptr))[:, None]
        weight = tl.where(real, weight, 0.0)
        ids = tl.where(real, ids, _DROPPED)
    out = t[:, None] * TOP_K + k
    tl.store(weights_ptr + out, weight.to(weights_ptr.dtype.element_ty), mask=t_ok[:, None] & k_ok)
    tl.store(ids_ptr + out, ids, mask=t_ok[:, None] & k_ok)


def route_triton(logits: torch.Tensor, spec: RoutingSpec, bias: torch.Tensor | None = None, *,
                 num_real_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """route_torch(logits, spec, bias, num_real_tokens=...) in one launch: (weights [T, k] in
    logits' dtype, ids [T, k] int64). num_real_tokens: a [1] int32/int64 device tensor read by
    the kernel itself (padding rows' DROPPED ids cost no launch of their own)."""
    T, E = logits.shape
    weights = torch.empty((T, spec.top_k), dtype=logits.dtype, device=logits.device)
    ids = torch.empty((T, spec.top_k), dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    e_pow2 = triton.next_power_of_2(E)
    block_t = min(max(1, _TILE // e_pow2), 32, triton.next_power_of_2(T))
    grouped = spec.group_by != "none"
    _route_kernel[(triton.cdiv(T, block_t),)](
        logits, bias if bias is not None else logits, weights, ids,
        num_real_tokens if num_real_tokens is not None else ids, T, logits.stride(0),
        float(spec.routed_scaling_factor),
        NUM_EXPERTS=E, TOP_K=spec.top_k, SCORING=SCORINGS.index(spec.scoring), HAS_BIAS=bias is not None,
        HAS_REAL=num_real_tokens is not None,
        GROUP_BY=GROUP_BY.index(spec.group_by), NUM_GROUPS=spec.num_groups if grouped else 1,
        TOPK_GROUPS=spec.topk_groups if grouped else 1, RENORM=spec.norm_topk_prob, E_POW2=e_pow2,
        G_POW2=triton.next_power_of_2(spec.num_groups if grouped else 1),
        K_POW2=triton.next_power_of_2(spec.top_k), BLOCK_T=block_t,
        num_warps=max(1, min(8, block_t * e_pow2 // 512)),  # about 16 registers per [BLOCK_T, E] tensor
    )  # fmt: skip
    return weights, ids
