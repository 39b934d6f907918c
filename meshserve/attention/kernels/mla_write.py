"""Triton kernel that writes new tokens' latent and rope key into the latent cache.

One program per token: it reads the slot, and when the slot is not -1 stores the latent row and
the rope row side by side (quantised to FP8 when the cache is). No host synchronisation, so the
write can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def mla_write_kernel(
    latent_ptr,  # [T, R]
    pe_ptr,  # [T, P]
    cache_ptr,  # [num_blocks * PAGE, R + P] rows
    slot_ptr,  # [T] int64
    scale_ptr,  # [] float32
    stride_lt, stride_pt, stride_row,
    R: tl.constexpr, P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    FP8: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        r = tl.arange(0, BLOCK_R)
        p = tl.arange(0, BLOCK_P)
        lat = tl.load(latent_ptr + t.to(tl.int64) * stride_lt + r, mask=r < R).to(tl.float32)
        pe = tl.load(pe_ptr + t.to(tl.int64) * stride_pt + p, mask=p < P).to(tl.float32)
        if FP8:
            scale = tl.load(scale_ptr)  # divide, not multiply by 1/scale: the same rounding as torch
            lat = tl.clamp(lat / scale, -FP8_MAX, FP8_MAX)
            pe = tl.clamp(pe / scale, -FP8_MAX, FP8_MAX)
        row = cache_ptr + slot * stride_row
        tl.store(row + r, lat.to(cache_ptr.dtype.element_ty), mask=r < R)
        tl.store(row + R + p, pe.to(cache_ptr.dtype.element_ty), mask=p < P)


def write_latent_kv_triton(latent: torch.Tensor, k_pe: torch.Tensor, cache, slot_mapping: torch.Tensor) -> None:
    """See meshserve.attention.mla.cache.write_latent_kv (shapes checked there)."""
    tokens = slot_mapping.shape[0]
    if tokens == 0:
        return
    latent = latent if latent.stride(-1) == 1 else latent.contiguous()
    k_pe = k_pe if k_pe.stride(-1) == 1 else k_pe.contiguous()
    rows = cache.data.view(-1, cache.data.shape[2])
    r, p = cache.kv_lora_rank, cache.rope_dim
    fp8_max = float(torch.finfo(cache.data.dtype).max) if cache.is_fp8 else 0.0
    scale = cache.scale.to(device=rows.device, dtype=torch.float32)
    mla_write_kernel[(tokens,)](
        latent, k_pe, rows, slot_mapping, scale,
        latent.stride(0), k_pe.stride(0), rows.stride(0),
        R=r, P=p, BLOCK_R=triton.next_power_of_2(r), BLOCK_P=triton.next_power_of_2(p),
        FP8=cache.is_fp8, FP8_MAX=fp8_max,
    )  # fmt: skip
