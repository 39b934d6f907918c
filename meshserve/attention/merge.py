"""Merge partial attention results computed over disjoint key sets (split-KV decode, DCP).

For parts i with output o_i [T, H, D] and log-sum-exp lse_i [T, H] over disjoint key sets:

    lse = log sum_i exp(lse_i)          o = sum_i exp(lse_i - lse) * o_i

computed with the maximum subtracted. An empty part (lse_i = -inf) contributes nothing; a row
whose parts are all empty gives o = 0 and lse = -inf.

LSE convention: natural log, float32, layout [tokens, heads]. Kernels that work in base 2
(exp2/log2, as the Triton attention kernels do) convert on the way out: lse = lse2 * ln(2).

Each operation has a torch reference (`*_torch`, any device) and a Triton kernel (`*_triton`:
CUDA, or the CPU interpreter under TRITON_INTERPRET=1). The plain names pick Triton on CUDA and
the torch reference elsewhere.
"""

from __future__ import annotations

import torch

from meshserve.attention.kernels.host_plans import merge_block_sizes
from meshserve.core.arith import cdiv
from meshserve.errors import check


def _check_parts(os: torch.Tensor, lses: torch.Tensor) -> None:
    check(os.dim() == 4, "os", tuple(os.shape), "a [N, T, H, D] tensor")
    check(
        tuple(lses.shape) == tuple(os.shape[:3]),
        "lses",
        tuple(lses.shape),
        f"shape [N, T, H] = {tuple(os.shape[:3])} matching os",
    )
    check(lses.dtype == torch.float32, "lses.dtype", lses.dtype, "torch.float32")


def merge_attn_states_n_torch(os: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """N-way merge. os [N, T, H, D], lses [N, T, H] float32 -> (o [T, H, D] in os.dtype, lse [T, H])."""
    _check_parts(os, lses)
    m = lses.max(dim=0).values  # [T, H]
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(lses - m_safe)  # [N, T, H]; empty parts give exactly 0
    total = w.sum(dim=0)
    empty = total == 0
    lse = torch.where(empty, torch.full_like(m, float("-inf")), m_safe + torch.log(total))
    weights = w / torch.where(empty, torch.ones_like(total), total)
    o = (weights[..., None] * os.float()).sum(dim=0)
    return o.to(os.dtype), lse


def merge_attn_states_torch(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-way merge: o_* [T, H, D], lse_* [T, H] float32 -> (o [T, H, D] in o_a.dtype, lse [T, H])."""
    return merge_attn_states_n_torch(torch.stack([o_a, o_b.to(o_a.dtype)]), torch.stack([lse_a, lse_b]))


def merge_attn_states_n_triton(
    os: torch.Tensor,
    lses: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """N-way merge with the Triton kernel; `out` [T, H, D] may have another dtype (e.g. fp32 -> bf16).

    os may have any strides whose last dimension is contiguous; the output of a part whose LSE is
    -inf is never read (it may hold anything, NaN included). Returns (out, lse or None).
    """
    from meshserve.attention.kernels.lse_merge import merge_n_kernel

    _check_parts(os, lses)
    n, t, h, d = os.shape
    os = os if os.stride(-1) == 1 else os.contiguous()
    out = torch.empty((t, h, d), dtype=os.dtype, device=os.device) if out is None else out
    if out_lse is None:
        out_lse = torch.empty((t, h), dtype=torch.float32, device=os.device) if return_lse else lses[0]
    if t == 0:
        return out, out_lse if return_lse else None
    block_h, block_d = merge_block_sizes(h, d)
    grid = (t, cdiv(h, block_h))
    merge_n_kernel[grid](
        os, lses, out, out_lse, n, h, d,
        os.stride(0), os.stride(1), os.stride(2),
        lses.stride(0), lses.stride(1), lses.stride(2),
        out.stride(0), out.stride(1),
        out_lse.stride(0), out_lse.stride(1),
        BLOCK_H=block_h, BLOCK_D=block_d, WRITE_LSE=return_lse,
    )  # fmt: skip
    return out, out_lse if return_lse else None


def merge_attn_states_triton(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-way merge with the Triton kernel (no stacking copy). Shapes as merge_attn_states_torch."""
    from meshserve.attention.kernels.lse_merge import merge_two_kernel

    check(o_a.shape == o_b.shape, "o_b", tuple(o_b.shape), f"the shape of o_a {tuple(o_a.shape)}")
    check(o_a.dim() == 3, "o_a", tuple(o_a.shape), "a [T, H, D] tensor")
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        want = tuple(o_a.shape[:2])
        check(tuple(lse.shape) == want, name, tuple(lse.shape), f"shape {want}")
        check(lse.dtype == torch.float32, f"{name}.dtype", lse.dtype, "torch.float32")
    o_a = o_a if o_a.stride(-1) == 1 else o_a.contiguous()
    o_b = o_b if o_b.stride(-1) == 1 else o_b.contiguous()
    t, h, d = o_a.shape
    out = torch.empty_like(o_a, memory_format=torch.contiguous_format)
    out_lse = torch.empty((t, h), dtype=torch.float32, device=o_a.device)
    if t == 0:
        return out, out_lse
    block_h, block_d = merge_block_sizes(h, d)
    merge_two_kernel[(t, cdiv(h, block_h))](
        o_a, lse_a, o_b, lse_b, out, out_lse, h, d,
        o_a.stride(0), o_a.stride(1), o_b.stride(0), o_b.stride(1),
        lse_a.stride(0), lse_a.stride(1), lse_b.stride(0), lse_b.stride(1),
        out.stride(0), out.stride(1), out_lse.stride(0), out_lse.stride(1),
        BLOCK_H=block_h, BLOCK_D=block_d, WRITE_LSE=True,
    )  # fmt: skip
    return out, out_lse


def merge_attn_states(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-way merge: Triton on CUDA, the torch reference elsewhere."""
    if o_a.is_cuda:
        return merge_attn_states_triton(o_a, lse_a, o_b, lse_b)
    return merge_attn_states_torch(o_a, lse_a, o_b, lse_b)


def merge_attn_states_n(os: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """N-way merge (os [N, T, H, D], lses [N, T, H]): Triton on CUDA, the torch reference elsewhere."""
    if os.is_cuda:
        o, lse = merge_attn_states_n_triton(os, lses)
        return o, lse
    return merge_attn_states_n_torch(os, lses)
