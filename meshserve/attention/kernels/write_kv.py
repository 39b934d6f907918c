"""Scatter new tokens' K/V into the paged cache, quantising to FP8 when the cache is FP8.

One program stores one token: all its KV heads for K and for V. A slot of -1 skips the token
(padding, or a token whose K/V another rank owns).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshserve.attention.backend import KVCache
from meshserve.attention.spec import AttentionSpec
from meshserve.errors import check


@triton.jit
def round_to_fp8_grid(x, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, SUB_ULP: tl.constexpr):
    """Round fp32 x (already inside the format's range) to the nearest FP8 value, ties to even.

    The final cast is then exact. Done by hand because the Triton interpreter's fp32 -> fp8
    cast drops the carry when rounding up crosses a power of two (7.9 -> 4 instead of 8); the
    GPU's conversion is right, and agrees with this rounding.
    """
    SHIFT: tl.constexpr = 23 - MANTISSA_BITS
    bits = x.to(tl.int32, bitcast=True)
    sign = bits & -2147483648  # the sign bit, put back last so that -0 survives any simplification
    ax = tl.abs(x)
    mag = ax.to(tl.int32, bitcast=True)
    lsb = (mag >> SHIFT) & 1
    mag = (mag + ((1 << (SHIFT - 1)) - 1) + lsb) & ~((1 << SHIFT) - 1)
    normal = mag.to(tl.float32, bitcast=True)
    # Below the smallest normal the grid is uniform: round |x| / ulp to an integer (RNE through
    # the 1.5 * 2**23 trick, exact since the scaling is a power of two).
    r = ax * (1.0 / SUB_ULP)
    sub = ((r + 12582912.0) - 12582912.0) * SUB_ULP
    rounded = tl.where(ax < MIN_NORMAL, sub, normal)
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def write_kv_kernel(
    k_ptr, v_ptr,  # [T, Hkv, D], [T, Hkv, DV]
    cache_k_ptr, cache_v_ptr,  # cache.data[:, 0] and cache.data[:, 1] (same strides)
    slot_ptr,  # [T] int64
    k_scale_ptr, v_scale_ptr,
    fp8_max,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
    BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGE: tl.constexpr, KV_FP8: tl.constexpr,
    FP8_MANTISSA_BITS: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr, FP8_SUB_ULP: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        blk = slot // PAGE
        off = slot % PAGE
        h = tl.arange(0, BLOCK_HKV)
        dst = blk * stride_cb + off * stride_ct + h[:, None] * stride_ch
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_D)
        k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        dv = tl.arange(0, BLOCK_DV)
        mask_v = (h[:, None] < NUM_KV_HEADS) & (dv[None, :] < HEAD_DV)
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + dv[None, :], mask=mask_v)
        if KV_FP8:
            # Stored = real / scale, saturated at the format's largest finite value.
            k = tl.clamp(k.to(tl.float32) / tl.load(k_scale_ptr), -fp8_max, fp8_max)
            v = tl.clamp(v.to(tl.float32) / tl.load(v_scale_ptr), -fp8_max, fp8_max)
            k = round_to_fp8_grid(k, FP8_MANTISSA_BITS, FP8_MIN_NORMAL, FP8_SUB_ULP)
            v = round_to_fp8_grid(v, FP8_MANTISSA_BITS, FP8_MIN_NORMAL, FP8_SUB_ULP)
        tl.store(cache_k_ptr + dst + d[None, :], k.to(cache_k_ptr.dtype.element_ty), mask=mask)
        tl.store(cache_v_ptr + dst + dv[None, :], v.to(cache_v_ptr.dtype.element_ty), mask=mask_v)


def write_kv(
    spec: AttentionSpec, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor
) -> None:
    """Launch write_kv_kernel: key [T, Hkv, D], value [T, Hkv, Dv], slot_mapping [T] int64 (-1 skips)."""
    num_tokens = key.shape[0]
    want = (num_tokens, spec.num_kv_heads, spec.head_size)
    check(tuple(key.shape) == want, "key", tuple(key.shape), f"shape {list(want)}")
    want_v = (num_tokens, spec.num_kv_heads, spec.v_size)
    check(tuple(value.shape) == want_v, "value", tuple(value.shape), f"shape {list(want_v)}")
    shape = tuple(slot_mapping.shape)
    check(shape == (num_tokens,), "slot_mapping", shape, f"[{num_tokens}] (one slot per new token)")
    if num_tokens == 0:
        return
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    data = kv_cache.data
    fp8 = kv_cache.is_fp8
    k_scale, v_scale = scales_on(kv_cache, data.device)
    write_kv_kernel[(num_tokens,)](
        key, value, data[:, 0], data[:, 1], slot_mapping, k_scale, v_scale,
        torch.finfo(data.dtype).max if fp8 else 0.0,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        data.stride(0), data.stride(2), data.stride(3),
        NUM_KV_HEADS=spec.num_kv_heads, HEAD_D=spec.head_size, HEAD_DV=spec.v_size,
        BLOCK_HKV=triton.next_power_of_2(spec.num_kv_heads), BLOCK_D=triton.next_power_of_2(spec.head_size),
        BLOCK_DV=triton.next_power_of_2(spec.v_size), PAGE=kv_cache.block_size, KV_FP8=fp8,
        **fp8_grid(data.dtype),
    )  # fmt: skip


def scales_on(kv_cache: KVCache, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache's dequantisation scales as float32 tensors on `device` (no copy when already there)."""
    return (
        kv_cache.k_scale.to(device=device, dtype=torch.float32),
        kv_cache.v_scale.to(device=device, dtype=torch.float32),
    )


def fp8_grid(dtype: torch.dtype) -> dict[str, float]:
    """Mantissa bits, smallest normal and subnormal spacing of an FP8 format (unused otherwise)."""
    bits, min_exp = (2, -14) if dtype == torch.float8_e5m2 else (3, -6)
    return dict(FP8_MANTISSA_BITS=bits, FP8_MIN_NORMAL=2.0**min_exp, FP8_SUB_ULP=2.0 ** (min_exp - bits))
