"""Triton kernels that merge partial attention results by their log-sum-exp.

One program merges a [BLOCK_H, BLOCK_D] tile of one token across all parts in a single pass
(online: running max, rescaled sum), so each partial output is read exactly once. The math is
in natural log (exp/log), the convention of every LSE meshserve passes around. The N-way merge
does not read the output of a part whose LSE is -inf (it weighs 0), so a split-KV kernel may leave
an empty split's output unwritten.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _merge_step(acc, total, m, o_part, lse_part):
    """Fold one part (o_part [BH, BD] fp32, lse_part [BH] fp32) into the running state."""
    m_new = tl.maximum(m, lse_part)
    # A head that has seen only empty parts keeps m = -inf; subtracting 0 keeps exp() finite.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    w = tl.exp(lse_part - m_safe)
    acc = acc * alpha[:, None] + w[:, None] * o_part
    total = total * alpha + w
    return acc, total, m_new


@triton.jit
def _merge_finish(out_ptrs, lse_ptrs, acc, total, m, mask_hd, mask_h, WRITE_LSE: tl.constexpr):
    empty = total == 0.0
    o = acc / tl.where(empty, 1.0, total)[:, None]
    tl.store(out_ptrs, o.to(out_ptrs.dtype.element_ty), mask=mask_hd)
    if WRITE_LSE:
        lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, total)))
        tl.store(lse_ptrs, lse, mask=mask_h)


@triton.jit
def merge_n_kernel(
    o_ptr,  # [N, T, H, D] partial outputs (any float dtype)
    lse_ptr,  # [N, T, H] float32
    out_ptr,  # [T, H, D]
    out_lse_ptr,  # [T, H] float32
    num_parts,
    num_heads,
    head_size,
    stride_on, stride_ot, stride_oh,
    stride_ln, stride_lt, stride_lh,
    stride_yt, stride_yh,
    stride_zt, stride_zh,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask_h = h < num_heads
    mask_hd = mask_h[:, None] & (d[None, :] < head_size)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    for n in range(0, num_parts):
        lse_n = tl.load(lse_ptr + n * stride_ln + t * stride_lt + h * stride_lh, mask=mask_h,
                        other=float("-inf"))
        # An empty part (LSE -inf) weighs 0: its output is not read (its writer may leave it unset).
        o_n = tl.load(o_ptr + n * stride_on + t * stride_ot + h[:, None] * stride_oh + d[None, :],
                      mask=mask_hd & (lse_n != float("-inf"))[:, None], other=0.0).to(tl.float32)
        acc, total, m = _merge_step(acc, total, m, o_n, lse_n)
    _merge_finish(out_ptr + t * stride_yt + h[:, None] * stride_yh + d[None, :],
                  out_lse_ptr + t * stride_zt + h * stride_zh, acc, total, m, mask_hd, mask_h, WRITE_LSE)


@triton.jit
def merge_two_kernel(
    oa_ptr, lsea_ptr, ob_ptr, lseb_ptr,  # [T, H, D] and [T, H] each
    out_ptr, out_lse_ptr,
    num_heads,
    head_size,
    stride_at, stride_ah, stride_bt, stride_bh,
    stride_lat, stride_lah, stride_lbt, stride_lbh,
    stride_yt, stride_yh,
    stride_zt, stride_zh,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask_h = h < num_heads
    mask_hd = mask_h[:, None] & (d[None, :] < head_size)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    lse_a = tl.load(lsea_ptr + t * stride_lat + h * stride_lah, mask=mask_h, other=float("-inf"))
    o_a = tl.load(oa_ptr + t * stride_at + h[:, None] * stride_ah + d[None, :], mask=mask_hd, other=0.0)
    acc, total, m = _merge_step(acc, total, m, o_a.to(tl.float32), lse_a)
    lse_b = tl.load(lseb_ptr + t * stride_lbt + h * stride_lbh, mask=mask_h, other=float("-inf"))
    o_b = tl.load(ob_ptr + t * stride_bt + h[:, None] * stride_bh + d[None, :], mask=mask_hd, other=0.0)
    acc, total, m = _merge_step(acc, total, m, o_b.to(tl.float32), lse_b)
    _merge_finish(out_ptr + t * stride_yt + h[:, None] * stride_yh + d[None, :],
                  out_lse_ptr + t * stride_zt + h * stride_zh, acc, total, m, mask_hd, mask_h, WRITE_LSE)
