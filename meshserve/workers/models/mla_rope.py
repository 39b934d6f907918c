"""MLA's rotary embedding for q and k_pe, and kv_a_layernorm of the latent, in one kernel
(CUDA): DeepSeek attention's rope and latent-norm step.

Unfused, each MLA layer rotates k_pe and q's rope part with YarnRotary.apply (per tensor: two
products and a difference, two products and a sum, a cat: 7 launches), joins q's nope and
rotated rope parts with one more cat (15 launches per layer), and normalises the latent
(kv_a_layernorm: fused_ops.rms_norm, one more launch). The kernel is one launch: it rotates q's
rope values in place, in the query projection's output (q's nope values are neither read nor
copied), and each token's last program writes k_pe as a new [T, rope] tensor from the
kv_a_proj_with_mqa output and the normalised latent as a new [T, kv_lora_rank] tensor from the
same row.

The rotation is the torch ops' (yarn_rope.rotate_pairs), bit for bit: each product, the
difference and the sum are rounded to the activation dtype as torch's elementwise ops round them
(a product of two bf16/fp16 values is exact in float32, so float32 math then rounding is what
torch computes), and the compiler may not contract a product and a sum into an FMA. The latent
norm is fused_ops.rms_norm's math (float32 statistics, x * rsqrt(mean(x^2) + eps) * w rounded
once to the activation dtype), but not its bits: that kernel lets the compiler contract the sum
of squares into FMAs and this one may not (the rotation forbids it for the whole kernel), so the
float32 sum of squares can differ in its last bits and an output value by one unit in the last
place of the activation dtype (tests/gpu/test_mla_rope_gpu.py holds it to that).

`use_triton`: None (the default) asks fused_ops.runs_triton (the kernel for CUDA tensors, the
torch ops elsewhere: the CPU's path and the tests' reference); True runs the kernel (the Triton
interpreter on CPU), False the torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshserve.errors import check
from meshserve.workers.models import fused_ops
from meshserve.workers.models.yarn_rope import rotate_pairs


@triton.jit
def _rotate(x1, x2, cos, sin, out_ptr):
    """(x1 cos - x2 sin, x2 cos + x1 sin), every product and sum rounded to out_ptr's element
    type (as torch's ops round them)."""
    dtype = out_ptr.dtype.element_ty
    a = (x1 * cos).to(dtype).to(tl.float32)
    b = (x2 * sin).to(dtype).to(tl.float32)
    c = (x2 * cos).to(dtype).to(tl.float32)
    d = (x1 * sin).to(dtype).to(tl.float32)
    return (a - b).to(dtype), (c + d).to(dtype)


@triton.jit
def _mla_rope_kernel(
    q_ptr, c_ptr, k_ptr, cos_ptr, sin_ptr, w_ptr, lat_ptr,
    stride_qt, stride_qh, stride_ct, stride_cos, stride_sin, num_heads, rank, eps,
    NOPE: tl.constexpr, RANK: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_RANK: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    # Program (t, g): token t, q heads [g * BLOCK_H, (g + 1) * BLOCK_H); the token's last program
    # (g * BLOCK_H >= num_heads) rotates its k_pe and normalises its latent instead. `rank` is
    # RANK again, as a run-time value: the mean divides by it as fused_ops' norm kernel does.
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    d = tl.arange(0, BLOCK_HALF)
    in_d = d < HALF
    cos = tl.load(cos_ptr + t * stride_cos + d, mask=in_d, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_sin + d, mask=in_d, other=0.0).to(tl.float32)
    # Pair i: values (2i, 2i + 1) interleaved, else (i, i + HALF); written as halves either way.
    if INTERLEAVED:
        first, second = 2 * d, 2 * d + 1
    else:
        first, second = d, HALF + d
    # (Names differ between the branches: the compiler wants one type per name across an if.)
    if g * BLOCK_H >= num_heads:
        k_src = c_ptr + t * stride_ct + RANK
        k1 = tl.load(k_src + first, mask=in_d, other=0.0).to(tl.float32)
        k2 = tl.load(k_src + second, mask=in_d, other=0.0).to(tl.float32)
        k_out1, k_out2 = _rotate(k1, k2, cos, sin, k_ptr)
        k_dst = k_ptr + t * (2 * HALF)
        tl.store(k_dst + d, k_out1, mask=in_d)
        tl.store(k_dst + HALF + d, k_out2, mask=in_d)
        # kv_a_layernorm of the latent values before k_pe (fused_ops._rms_norm_kernel's math)
        r = tl.arange(0, BLOCK_RANK)
        in_r = r < RANK
        x = tl.load(c_ptr + t * stride_ct + r, mask=in_r, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / rank + eps)
        w = tl.load(w_ptr + r, mask=in_r, other=0.0).to(tl.float32)
        tl.store(lat_ptr + t * RANK + r, (x * rstd * w).to(lat_ptr.dtype.element_ty), mask=in_r)
    else:
        h = g * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (h < num_heads)[:, None] & in_d[None, :]
        row = q_ptr + t * stride_qt + h[:, None].to(tl.int64) * stride_qh + NOPE
        q1 = tl.load(row + first[None, :], mask=mask, other=0.0).to(tl.float32)
        q2 = tl.load(row + second[None, :], mask=mask, other=0.0).to(tl.float32)
        q_out1, q_out2 = _rotate(q1, q2, cos[None, :], sin[None, :], q_ptr)
        if INTERLEAVED:
            # In place: a thread stores to values other threads loaded (2i, 2i + 1 -> i, i + HALF);
            # every load of the block is done before any store. (Halves: each thread stores
            # exactly the two values it loaded.)
            tl.debug_barrier()
        tl.store(row + d[None, :], q_out1, mask=mask)
        tl.store(row + HALF + d[None, :], q_out2, mask=mask)


def rotary_mla_qk(q: torch.Tensor, compressed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  norm_weight: torch.Tensor, *, kv_lora_rank: int, interleaved: bool, eps: float,
                  use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Rotate q's rope part and k_pe (YarnRotary.apply on both, then q's nope and rope parts
    joined) and normalise the latent (kv_a_layernorm: fused_ops.rms_norm with `norm_weight`, `eps`).

    q: [T, H, nope + rope] (a view of the query projection's output; unit stride in the last
    dimension); compressed: [T, kv_lora_rank + rope] (kv_a_proj_with_mqa's output, e.g. a view of
    the stacked q_kv_a_proj's; unit last stride: the latent is its first kv_lora_rank values and
    k_pe its last rope values); cos, sin: [T, 1, rope / 2] or [T, rope / 2] as YarnRotary returns
    them; norm_weight: [kv_lora_rank]; all in one dtype. interleaved: rotate pairs (2i, 2i + 1)
    (else (i, i + rope / 2)); the rotated values are stored as halves either way
    (yarn_rope.rotate_pairs).

    Returns (q, k_pe [T, rope], latent [T, kv_lora_rank]): on the kernel's path q is the same
    tensor, rotated in place, and k_pe and latent new contiguous tensors; on the torch path all
    three are new tensors (the latent by fused_ops.rms_norm).
    """
    rope_dim = compressed.shape[-1] - kv_lora_rank
    nope = q.shape[-1] - rope_dim
    if not (fused_ops.runs_triton(q) if use_triton is None else use_triton):
        latent = fused_ops.rms_norm(compressed[:, :kv_lora_rank], norm_weight, eps, use_triton=use_triton)
        k_pe = rotate_pairs(compressed[:, None, kv_lora_rank:], cos, sin, interleaved=interleaved)[:, 0]
        rotated = rotate_pairs(q[..., nope:], cos, sin, interleaved=interleaved)
        return torch.cat((q[..., :nope], rotated), dim=-1), k_pe, latent
    T = q.shape[0]
    check(q.dim() == 3 and q.stride(-1) == 1, "q", f"{tuple(q.shape)} strides {q.stride()}",
          "[T, heads, nope + rope] with unit stride in the last dimension")
    check(compressed.dim() == 2 and compressed.shape[0] == T and compressed.stride(-1) == 1, "compressed",
          f"{tuple(compressed.shape)} strides {compressed.stride()}",
          f"[{T}, kv_lora_rank + rope] with unit stride in the last dimension")
    check(rope_dim > 0 and rope_dim % 2 == 0 and nope >= 0, "rope dim", rope_dim,
          f"an even number in 2..{q.shape[-1]} (compressed width minus kv_lora_rank={kv_lora_rank})")
    check(0 < kv_lora_rank <= fused_ops.MAX_HIDDEN, "kv_lora_rank", kv_lora_rank,
          f"1..{fused_ops.MAX_HIDDEN} (the latent row is normalised in registers)")
    half = rope_dim // 2
    check(all(tuple(t.shape) in ((T, 1, half), (T, half)) for t in (cos, sin)), "cos/sin",
          f"{tuple(cos.shape)} {tuple(sin.shape)}", f"[{T}, 1, {half}] or [{T}, {half}]")
    check(tuple(norm_weight.shape) == (kv_lora_rank,) and norm_weight.stride(-1) == 1, "norm_weight",
          tuple(norm_weight.shape), f"a contiguous [{kv_lora_rank}] (kv_a_layernorm's weight)")
    cos, sin = cos.reshape(T, half), sin.reshape(T, half)
    dtypes = {q.dtype, compressed.dtype, cos.dtype, sin.dtype}
    check(len(dtypes) == 1, "q/compressed/cos/sin dtypes", sorted(map(str, dtypes)), "one dtype (the activations')")
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    k_pe = torch.empty((T, rope_dim), dtype=q.dtype, device=q.device)
    latent = torch.empty((T, kv_lora_rank), dtype=q.dtype, device=q.device)
    if T == 0:
        return q, k_pe, latent
    H = q.shape[1]
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(H), max(1, 2048 // block_half))
    _mla_rope_kernel[(T, triton.cdiv(H, block_h) + 1)](
        q, compressed, k_pe, cos, sin, norm_weight, latent,
        q.stride(0), q.stride(1), compressed.stride(0), cos.stride(0), sin.stride(0), H, kv_lora_rank, eps,
        NOPE=nope, RANK=kv_lora_rank, HALF=half, BLOCK_H=block_h, BLOCK_HALF=block_half,
        BLOCK_RANK=triton.next_power_of_2(kv_lora_rank), INTERLEAVED=interleaved, num_warps=4,
        enable_fp_fusion=False,
    )  # fmt: skip
    return q, k_pe, latent
