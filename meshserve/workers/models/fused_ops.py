"""Fused decoder-layer kernels for CUDA: fewer launches per layer, the same math as the torch ops.

Launches removed per decoder layer (eager torch, Llama-style layer without q/k norm):
- `add_rms_norm`: the residual add before each of the layer's two norms joins the norm: -2
  (the final norm too, once per model). Gemma's unit-offset norms also lose the float32 casts
  of x and weight, the 1 + weight and the cast back: 5 launches become 1 per norm;
- `act_and_mul`: act(gate) and the multiply by up become one kernel: -1;
- `rotary_qk_write_kv`: apply_rotary (negate, cat, two multiplies, add) and the separate
  write_kv launch become one kernel: -5.
`rms_norm` is a norm without a residual (layer 0's input norm, q/k norms) as one kernel.

Each function takes `use_triton`: None (the default) asks `runs_triton` (on CUDA); on a CPU,
float32 contiguous inputs then go through meshserve's compiled CPU ops when they are built
(attention/backends/cpu_step_ops.py: the same fusions in C++; the rotation and the K/V write
bit for bit, the norms and SiLU within float32 rounding of the torch ops), since their torch ops
cost a decode step more in dispatch than in arithmetic. `use_triton=False` runs exactly the
unfused torch ops the model ran before (the reference the tests compare with); tests pass
`use_triton=True` to run the kernels in the Triton interpreter. Kernels load in the activation
dtype, compute in float32 and round once when they store.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from meshserve.attention.backend import KVCache
from meshserve.attention.backends import cpu_step_ops
from meshserve.attention.kernels.write_kv import fp8_grid, round_to_fp8_grid, scales_on
from meshserve.errors import check

# Activation names (arch.ACTIVATIONS) -> the torch function, and the kernel's constexpr code.
TORCH_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
_ACT_CODE = {"silu": 0, "gelu": 1, "gelu_pytorch_tanh": 2}
MAX_HIDDEN = 32768  # rms_norm keeps one row in registers


def runs_triton(x: torch.Tensor) -> bool:
    """Whether the fused ops take the Triton path for x by default: when x is on CUDA."""
    return x.is_cuda


def _on_triton(use_triton: bool | None, x: torch.Tensor) -> bool:
    return runs_triton(x) if use_triton is None else use_triton


def _cpu_ops(use_triton: bool | None, x: torch.Tensor):
    """meshserve's compiled CPU ops (cpu_step_ops.py) when they take x: the default path (use_triton
    None), x float32, contiguous and on the CPU, and the ops built; else None. The ops check the
    rest of their inputs themselves (shapes, dtypes: a clear error naming the input). Kept to a
    few attribute reads: it runs about 25 times per decode step, on the step's critical path."""
    if use_triton is None and x.is_cpu and x.dtype == torch.float32 and x.is_contiguous():
        return cpu_step_ops.step_ops()
    return None


def fuses_rotary_write(qkv: torch.Tensor, kv_cache: KVCache | None) -> bool:
    """Whether `rotary_qk_write_kv` (use_triton None) runs fused for this projection and cache:
    the Triton kernel on CUDA, the compiled CPU op for a float32 projection and cache on a CPU.
    (Elsewhere it would run the unfused torch ops: the model's own path is as good.)"""
    if kv_cache is None:
        return False
    if runs_triton(qkv):
        return True
    data = kv_cache.data
    return data.dtype == torch.float32 and data.is_contiguous() and _cpu_ops(None, qkv) is not None


@dataclass(frozen=True)
class DeferredSum:
    """A layer output not yet formed: sum_j parts[:, j] (+ extra), in the activation dtype.

    parts: [T, k, N] (an MoE layer's weighted expert rows, fused_moe(sum_rows=False));
    extra: [T, N] or None (DeepSeek's shared experts). `total()` forms it as the MoE did,
    torch.sum over k (float32 accumulation, rounded) then `+ extra` (rounded); `add_rms_norm`
    on CUDA forms it inside its kernel instead, saving those launches.
    """

    parts: torch.Tensor
    extra: torch.Tensor | None = None

    def total(self) -> torch.Tensor:
        out = torch.sum(self.parts, dim=1)
        return out if self.extra is None else out + self.extra


# ------------------------------------------------------------------------------------ rms_norm
@triton.jit
def _rms_norm_kernel(
    x_ptr, extra_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, float_ptr,
    stride_x_outer, stride_x_inner, rows_inner, stride_res, stride_extra,
    n, eps,
    HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK: tl.constexpr,
    NUM_PARTS: tl.constexpr, HAS_EXTRA: tl.constexpr, FLOAT_OUT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    # Row `row` of x viewed as [outer, inner, n]: a q/k norm reads heads of a strided qkv view.
    x_row = x_ptr + (row // rows_inner) * stride_x_outer + (row % rows_inner) * stride_x_inner
    if NUM_PARTS > 0:  # a DeferredSum: x = round(sum_j parts[row, j]) (+ extra, rounded), as torch forms it
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(NUM_PARTS):  # parts [T, k, n]: rows_inner == 1, part j at j * n
            acc += tl.load(x_row + j * n + cols, mask=mask, other=0.0).to(tl.float32)
        x = acc.to(out_ptr.dtype.element_ty)
        if HAS_EXTRA:
            e = tl.load(extra_ptr + row * stride_extra + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + e.to(tl.float32)).to(out_ptr.dtype.element_ty)
    else:
        x = tl.load(x_row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = x.to(tl.float32) + r.to(tl.float32)
        x = x.to(sum_ptr.dtype.element_ty)  # the sum is rounded to the activation dtype, as `x + r`
        tl.store(sum_ptr + row * n + cols, x, mask=mask)
    x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        w = w + 1.0
    y = (x * rstd * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * n + cols, y, mask=mask)
    if FLOAT_OUT:  # the rounded output once more, in float32 (out.float(), for a float32 consumer)
        tl.store(float_ptr + row * n + cols, y.to(tl.float32), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, unit_offset: bool = False,
             use_triton: bool | None = None) -> torch.Tensor:
    """x [..., N] normalised over N, times weight [N] (unit_offset: times 1 + weight, Gemma).

    Plain: as F.rms_norm(x, (N,), weight) in x's dtype. unit_offset: as F.rms_norm in float32
    with scale 1 + weight.float(), cast back. Returns a new tensor shaped and typed as x.
    """
    if not unit_offset and _cpu_ops(use_triton, x) is not None:
        return cpu_step_ops.add_rms_norm(x, None, weight, eps)[0]
    if not _on_triton(use_triton, x):
        if unit_offset:
            return F.rms_norm(x.float(), (x.shape[-1],), 1.0 + weight.float(), eps).to(x.dtype)
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            return _rms_norm_float32(x, weight, eps)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return _launch_norm(x, None, weight, eps, unit_offset)[0]


def _rms_norm_float32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm for float32, the same math in 6 top-level ops and 14 dispatches instead of its
    31 (pow, mean as sum and div_, Python scalars wrapped and copied to tensors, add_, rsqrt,
    two muls, type_as): x * rsqrt(mean(x * x) + eps) * w, with N and eps as cached float32
    0-dim tensors. On the CPU every dispatch between two GEMVs pays for cold caches (about 36
    against 8 us warm for one F.rms_norm of [1, 256] on the 2-core machine); 13 norms run per
    decode step."""
    n, eps_t = _norm_constants(x.shape[-1], eps, x.device)
    mean_square = torch.linalg.vecdot(x, x).unsqueeze_(-1).div_(n)  # [..., 1]
    return x * mean_square.add_(eps_t).rsqrt_() * weight


@functools.lru_cache(maxsize=64)
def _norm_constants(n: int, eps: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """N and eps as float32 0-dim tensors (exactly what the Python numbers become in float32
    math), made outside inference mode so that autograd-enabled callers may use them too."""
    with torch.inference_mode(False):
        return (torch.tensor(float(n), dtype=torch.float32, device=device),
                torch.tensor(eps, dtype=torch.float32, device=device))


def add_rms_norm(x: torch.Tensor | DeferredSum, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 unit_offset: bool = False, use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual (both [T, N], in their dtype); returns (rms_norm(s, weight), s).

    x may be a DeferredSum (an MoE layer's unsummed output): the Triton kernel forms it as
    DeferredSum.total() would, bit for bit, before the add; elsewhere total() runs first."""
    if isinstance(x, DeferredSum):
        if _on_triton(use_triton, x.parts):
            return _launch_norm(x.parts, residual, weight, eps, unit_offset, deferred=x)
        x = x.total()
    if not unit_offset and _cpu_ops(use_triton, x) is not None and residual.is_contiguous():
        return cpu_step_ops.add_rms_norm(x, residual, weight, eps)
    if not _on_triton(use_triton, x):
        s = x + residual
        return rms_norm(s, weight, eps, unit_offset=unit_offset, use_triton=False), s
    return _launch_norm(x, residual, weight, eps, unit_offset)


def add_rms_norm_float(x: torch.Tensor | DeferredSum, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                       use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """add_rms_norm's (out, s), and out in float32 too (exactly out.float()) for a consumer that
    computes in float32 (DeepSeek's MoE router): the Triton kernel stores it beside out, which
    saves the cast's launch; elsewhere it is out.float() (out itself for a float32 out)."""
    parts = x.parts if isinstance(x, DeferredSum) else x
    if parts.dtype != torch.float32 and _on_triton(use_triton, parts):
        float_out = torch.empty((parts.shape[0], parts.shape[-1]), dtype=torch.float32, device=parts.device)
        if isinstance(x, DeferredSum):
            out, total = _launch_norm(x.parts, residual, weight, eps, False, deferred=x, float_out=float_out)
        else:
            out, total = _launch_norm(x, residual, weight, eps, False, float_out=float_out)
        return out, total, float_out
    out, total = add_rms_norm(x, residual, weight, eps, use_triton=use_triton)
    return out, total, out.float()


def _launch_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 unit_offset: bool, *, deferred: DeferredSum | None = None, float_out: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """x [..., N] (q/k norms: [T, heads, N], strided); `deferred` given: x is its parts [T, k, N]
    and the normed rows are their sums [T, N] (+ deferred.extra). float_out (float32, shaped as
    the output) receives the output again in float32."""
    n = x.shape[-1]
    check(0 < n <= MAX_HIDDEN, "hidden size", n, f"1..{MAX_HIDDEN} for the fused rms_norm")
    check(tuple(weight.shape) == (n,), "weight", tuple(weight.shape), f"shape [{n}]")
    parts, extra = 0, None
    if deferred is not None:  # the parts [T, k, N] read whole
        check(x.dim() == 3, "parts", tuple(x.shape), "[T, k, N]")
        parts, extra = x.shape[1], deferred.extra
        x = x.contiguous()
        rows, rows_inner, stride_outer, stride_inner = x, 1, x.stride(0), 0
        shape = (x.shape[0], n)
        if extra is not None:
            check(tuple(extra.shape) == shape and extra.dtype == x.dtype, "extra",
                  f"{tuple(extra.shape)} {extra.dtype}", f"shape {list(shape)} and dtype {x.dtype}")  # fmt: skip
            extra = extra if extra.stride(-1) == 1 else extra.contiguous()
    else:
        x = x if x.stride(-1) == 1 else x.contiguous()
        if x.dim() == 3:  # [T, heads, D]: a strided view of qkv (q/k norm) is read in place
            rows, rows_inner, stride_outer, stride_inner = x, x.shape[1], x.stride(0), x.stride(1)
        else:
            rows = x.reshape(-1, n)
            rows_inner, stride_outer, stride_inner = 1, rows.stride(0), 0
        shape = x.shape
    num_rows = math.prod(shape) // n
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    total = None
    if residual is not None:
        check(tuple(residual.shape) == tuple(shape) and residual.dtype == x.dtype, "residual",
              f"{tuple(residual.shape)} {residual.dtype}", f"shape {list(shape)} and dtype {x.dtype}")
        residual = residual.reshape(-1, n)
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
        total = torch.empty(shape, dtype=x.dtype, device=x.device)
    if float_out is not None:
        ok = tuple(float_out.shape) == tuple(shape) and float_out.dtype == torch.float32 and float_out.is_contiguous()
        check(ok, "float_out", f"{tuple(float_out.shape)} {float_out.dtype}", f"a contiguous float32 {list(shape)}")
    if num_rows == 0:
        return out, total
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(num_rows,)](
        rows, extra if extra is not None else rows, residual if residual is not None else rows, weight, out,
        total if total is not None else out, float_out if float_out is not None else out,
        stride_outer, stride_inner, rows_inner, residual.stride(0) if residual is not None else 0,
        extra.stride(0) if extra is not None else 0, n, eps,
        HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset, BLOCK=block,
        NUM_PARTS=parts, HAS_EXTRA=extra is not None, FLOAT_OUT=float_out is not None,
        num_warps=min(max(block // 512, 1), 16),
    )  # fmt: skip
    return out, total


# ---------------------------------------------------------------------------------- act_and_mul
@triton.jit
def _exact_exp(x, INTERPRETED: tl.constexpr):
    """expf as CUDA's math library computes it (libdevice; tl.exp is ex2.approx on the GPU). The
    interpreter (CPU tensors) has no libdevice: numpy's exp there."""
    if INTERPRETED:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def _act_and_mul_kernel(gu_ptr, out_ptr, stride_gu, inter, ACT: tl.constexpr, ROUND_ACT: tl.constexpr,
                        INTERPRETED: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gu_ptr + t * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + t * stride_gu + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if ROUND_ACT:  # torch's F.silu(gate) * up: x / (1 + expf(-x)) (IEEE division), rounded, times up, rounded
        act = tl.math.div_rn(gate, 1.0 + _exact_exp(-gate, INTERPRETED))
        act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    elif ACT == 0:  # silu; exp of -|gate| only, so that nothing overflows
        e = tl.exp(-tl.abs(gate))
        act = gate * tl.where(gate >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    elif ACT == 1:  # gelu, erf form
        act = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    else:  # gelu, tanh approximation; tanh(u) = sign(u) (1 - e) / (1 + e) with e = exp(-2|u|)
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        e = tl.exp(-2.0 * tl.abs(u))
        tanh = (1.0 - e) / (1.0 + e)
        act = 0.5 * gate * (1.0 + tl.where(u >= 0, tanh, -tanh))
    tl.store(out_ptr + t * inter + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def act_and_mul(gate_up: torch.Tensor, act: str, *, round_act: bool = False,
                use_triton: bool | None = None) -> torch.Tensor:  # fmt: skip
    """gate_up [T, 2I] (gate, then up) -> act(gate) * up [T, I] in gate_up's dtype.

    act: one of TORCH_ACTIVATIONS. The kernel computes in float32 and rounds once; the torch
    path rounds act(gate) and the product separately, as the unfused MLP did. round_act (silu
    only): the kernel too rounds silu(gate) before the product, with torch's CUDA formula
    (x / (1 + expf(-x)), IEEE division), so that it gives F.silu(gate) * up bit for bit on the
    GPU; the CPU takes the torch ops (the compiled CPU op is not bit-exact).
    """
    if act not in _ACT_CODE:  # (the message is built on failure only: this runs per layer per step)
        check(False, "act", act, f"one of {sorted(_ACT_CODE)}")
    if round_act and act != "silu":
        check(False, "act", act, "'silu' with round_act")
    if act == "silu" and not round_act and _cpu_ops(use_triton, gate_up) is not None:
        return cpu_step_ops.silu_and_mul(gate_up)
    if not _on_triton(use_triton, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return TORCH_ACTIVATIONS[act](gate) * up
    width = gate_up.shape[-1]
    check(width % 2 == 0, "gate_up", tuple(gate_up.shape), "an even last dimension (gate, then up)")
    gu = gate_up.reshape(-1, width)
    gu = gu if gu.stride(-1) == 1 else gu.contiguous()
    inter = width // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    if gu.shape[0] == 0 or inter == 0:
        return out
    block = min(triton.next_power_of_2(inter), 1024)
    grid = (gu.shape[0], triton.cdiv(inter, block))
    _act_and_mul_kernel[grid](gu, out, gu.stride(0), inter, ACT=_ACT_CODE[act], ROUND_ACT=round_act,
                              INTERPRETED=not gu.is_cuda, BLOCK=block, num_warps=4)  # fmt: skip
    return out


# ------------------------------------------------------------------------- rotary_qk_write_kv
@triton.jit
def _rotary_qk_write_kv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, fp8_max,
    stride_qkv, stride_cos, stride_sin, stride_cb, stride_ckv, stride_ct, stride_ch,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, PAGE: tl.constexpr, KV_FP8: tl.constexpr,
    FP8_MANTISSA_BITS: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr, FP8_SUB_ULP: tl.constexpr,
):  # fmt: skip
    # Program (t, g): token t, heads [g * BLOCK_H, (g + 1) * BLOCK_H) of the H + 2 Hkv heads of
    # qkv (q heads, k heads, v heads, in that order). Each head is processed as its two halves.
    HALF: tl.constexpr = HEAD_D // 2
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    in_d = d < HALF
    mask = (h < NUM_HEADS + 2 * NUM_KV_HEADS)[:, None] & in_d[None, :]
    src = qkv_ptr + t * stride_qkv + h[:, None] * HEAD_D + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    cos1 = tl.load(cos_ptr + t * stride_cos + d, mask=in_d, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + t * stride_cos + HALF + d, mask=in_d, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + t * stride_sin + d, mask=in_d, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + t * stride_sin + HALF + d, mask=in_d, other=0.0).to(tl.float32)[None, :]
    is_v = (h >= NUM_HEADS + NUM_KV_HEADS)[:, None]
    # x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1); v heads pass through.
    out1 = tl.where(is_v, x1, x1 * cos1 - x2 * sin1).to(q_ptr.dtype.element_ty)
    out2 = tl.where(is_v, x2, x2 * cos2 + x1 * sin2).to(q_ptr.dtype.element_ty)

    is_q = (h < NUM_HEADS)[:, None]
    q_dst = q_ptr + t * (NUM_HEADS * HEAD_D) + h[:, None] * HEAD_D + d[None, :]
    tl.store(q_dst, out1, mask=mask & is_q)
    tl.store(q_dst + HALF, out2, mask=mask & is_q)
    is_k = (h >= NUM_HEADS)[:, None] & ~is_v
    k_dst = k_ptr + t * (NUM_KV_HEADS * HEAD_D) + (h - NUM_HEADS)[:, None] * HEAD_D + d[None, :]
    tl.store(k_dst, out1, mask=mask & is_k)
    tl.store(k_dst + HALF, out2, mask=mask & is_k)

    # The paged cache: K heads to index 0, V heads to index 1 of the token's slot (-1: skip).
    slot = tl.load(slot_ptr + t)
    kv_head = tl.where(is_v, h[:, None] - NUM_HEADS - NUM_KV_HEADS, h[:, None] - NUM_HEADS)
    dst = (cache_ptr + (slot // PAGE) * stride_cb + is_v.to(tl.int64) * stride_ckv + (slot % PAGE) * stride_ct
           + kv_head * stride_ch + d[None, :])
    c1, c2 = out1.to(tl.float32), out2.to(tl.float32)  # quantise the values q/k/v hold
    if KV_FP8:
        # Stored = real / scale, saturated at the format's largest finite value (as write_kv).
        scale = tl.where(is_v, tl.load(v_scale_ptr), tl.load(k_scale_ptr))
        c1 = round_to_fp8_grid(tl.clamp(c1 / scale, -fp8_max, fp8_max),
                               FP8_MANTISSA_BITS, FP8_MIN_NORMAL, FP8_SUB_ULP)
        c2 = round_to_fp8_grid(tl.clamp(c2 / scale, -fp8_max, fp8_max),
                               FP8_MANTISSA_BITS, FP8_MIN_NORMAL, FP8_SUB_ULP)
    to_cache = (h >= NUM_HEADS) & (tl.zeros([BLOCK_H], dtype=tl.int64) + slot >= 0)  # K/V heads, kept slot
    cache_mask = mask & to_cache[:, None]
    tl.store(dst, c1.to(cache_ptr.dtype.element_ty), mask=cache_mask)
    tl.store(dst + HALF, c2.to(cache_ptr.dtype.element_ty), mask=cache_mask)


def rotary_qk_write_kv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, num_heads: int, num_kv_heads: int,
    head_dim: int, kv_cache: KVCache, slot_mapping: torch.Tensor, use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotate q and k of a fused qkv projection and store k, v in the paged cache, in one kernel.

    qkv: [T, (H + 2 Hkv) * D] (q heads, k heads, v heads); cos, sin: [T, 1, D] or [T, D] as
    RotaryEmbedding returns them (full width, neox half rotation); kv_cache.data: [blocks, 2,
    block_size, Hkv, D], FP8 caches quantised with the cache's scales as write_kv does;
    slot_mapping: [T] int64 (-1 skips). Returns q [T, H, D] and k [T, Hkv, D] (new tensors) and
    v [T, Hkv, D] (a view of qkv), all in qkv's dtype.

    The kernel rotates in float32 and rounds once (HF rounds x * cos and rotate_half(x) * sin to
    the activation dtype before adding them: at most an ulp apart in fp16/bf16, equal in fp32).
    The cache receives the rounded k, so it holds exactly what write_kv(k, v) would store. The
    torch path (use_triton False) is the unfused apply_rotary + TORCH reference write.
    """
    data = kv_cache.data
    if (_cpu_ops(use_triton, qkv) is not None and data.dtype == torch.float32 and data.is_contiguous()
            and cos.is_contiguous() and sin.is_contiguous() and slot_mapping.dtype == torch.int64):
        # (the op checks the shapes itself, each error naming its input; head_dim is the cache's)
        return cpu_step_ops.rotary_write_kv(qkv, cos, sin, data, slot_mapping, num_heads, num_kv_heads)
    T, H, Hkv, D = qkv.shape[0], num_heads, num_kv_heads, head_dim
    check(tuple(qkv.shape) == (T, (H + 2 * Hkv) * D), "qkv", tuple(qkv.shape), f"shape [{T}, {(H + 2 * Hkv) * D}]")
    check(D % 2 == 0, "head_dim", D, "an even number (half rotation)")
    cos, sin = cos.reshape(T, -1), sin.reshape(T, -1)
    check(cos.shape == (T, D) and sin.shape == (T, D), "cos/sin", tuple(cos.shape), f"[{T}, 1, {D}] or [{T}, {D}]")
    want = (2, data.shape[2], Hkv, D)
    check(tuple(data.shape[1:]) == want, "kv_cache.data", tuple(data.shape), f"shape [num_blocks, {list(want)}]")
    check(tuple(slot_mapping.shape) == (T,), "slot_mapping", tuple(slot_mapping.shape), f"[{T}]")
    check(data.stride(-1) == 1, "kv_cache.data", tuple(data.stride()), "unit stride in the head dimension")
    v = qkv[:, (H + Hkv) * D :].view(T, Hkv, D)
    if not _on_triton(use_triton, qkv):
        from meshserve.attention.backends.torch_ref import scatter_kv
        from meshserve.workers.models.rope import apply_rotary

        qk = qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D)
        q, k = apply_rotary(qk, cos[:, None], sin[:, None]).split([H, Hkv], dim=1)
        scatter_kv(k, v, kv_cache, slot_mapping)
        return q, k, v
    qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    q = torch.empty((T, H, D), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((T, Hkv, D), dtype=qkv.dtype, device=qkv.device)
    check(kv_cache.is_fp8 or data.dtype == qkv.dtype, "kv_cache.data", data.dtype, f"{qkv.dtype} or an FP8 dtype")
    if T == 0:
        return q, k, v
    k_scale, v_scale = scales_on(kv_cache, data.device)
    block_half = triton.next_power_of_2(D // 2)
    heads = H + 2 * Hkv
    block_h = min(triton.next_power_of_2(heads), max(1, 2048 // block_half))
    _rotary_qk_write_kv_kernel[(T, triton.cdiv(heads, block_h))](
        qkv, cos, sin, q, k, data, slot_mapping, k_scale, v_scale,
        torch.finfo(data.dtype).max if kv_cache.is_fp8 else 0.0,
        qkv.stride(0), cos.stride(0), sin.stride(0),
        data.stride(0), data.stride(1), data.stride(2), data.stride(3),
        NUM_HEADS=H, NUM_KV_HEADS=Hkv, HEAD_D=D, BLOCK_H=block_h, BLOCK_HALF=block_half,
        PAGE=kv_cache.block_size, KV_FP8=kv_cache.is_fp8, **fp8_grid(data.dtype),
        num_warps=4,
    )  # fmt: skip
    return q, k, v
