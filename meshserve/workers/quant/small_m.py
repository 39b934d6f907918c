"""Weight-streaming GEMMs for decode-sized batches: y [M, N] = x [M, K] @ W^T (+ bias), M <= SMALL_M_MAX.

At a few rows a linear layer is a read of its weight matrix: 2 * M FLOPs per weight against
~165 FLOPs per byte of balance on an H200, so the kernel's only job is to stream W from HBM at
full bandwidth, in one launch, with nothing in front of it. Each program owns a slab of
BLOCK_N output columns and walks K, BLOCK_K at a time, loading a [BLOCK_N, BLOCK_K] weight tile
and the matching [16, BLOCK_K] activation tile (rows >= M are masked: they read nothing), and
multiplies on tensor cores (tl.dot pads M to 16 rows; the padding costs no bandwidth).

Weight formats (one kernel, chosen by constexprs):
- float8_e4m3fn with block scales [ceil(N / bn), ceil(K / bk)] (DeepSeek-V3 / Qwen3-FP8) or one
  scale per output channel [N] (online FP8). W8A16: activations are NOT quantized; FP8 values
  are converted in registers and products accumulate in float32. Block scales multiply each
  partial product of one scale block (a BLOCK_K step wider than bk is unrolled into bk-wide
  sub-steps, so no product straddles two scale blocks); per-channel scales multiply the
  finished sum once.
- bf16 / fp16 (dense models): the same streaming loop without scales, so that decode GEMMs need
  no cuBLAS split-K reduction kernel.
Dot operands: FP8 weights go to fp16 (every e4m3 value is exact in fp16, and Hopper converts
e4m3 -> fp16 two values per instruction, where e4m3 -> bf16 is a quarter-rate F2F). bf16
activations are scaled by 2**-8 on the way (exact; undone on the float32 sum) so that any value
up to 2**24 fits fp16: elements with |x| >= 2**-6 stay exact, smaller ones keep an absolute error
below 2**-17 (for |x| >= 2**-7 that is within bf16's own rounding). bf16/fp16 weights use their
own dtype. Under TRITON_INTERPRET (CPU tests) bf16 dots run in float32, because the
interpreter's bf16 dot is wrong (a known interpreter bug); fp16 dots run as on the GPU.

Determinism: no atomics. A program owns its output columns outright, so results are bitwise
identical run to run (CUDA-graph replay equals eager). Where ceil(N / 16) programs cannot fill
the GPU (narrow TP shards), K is split: each split writes a float32 partial to a scratch
[splits, M, N] and a second small kernel sums them in split order (then adds the bias and
casts) - deterministic, at the price of one more launch for those shapes only.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from meshserve.workers.quant.formats import SMALL_M_MAX

_NONE, _PER_CHANNEL, _BLOCK = 0, 1, 2
_X_SCALE = 2.0**-8  # bf16 activations -> fp16 operand range (see the module docstring)


@dataclass(frozen=True)
class StreamPlan:
    """How one GEMM is cut: BLOCK_N output columns per program, BLOCK_K per step, `splits`
    programs along K (each `k_per_split` long, a multiple of BLOCK_K), warps and pipeline stages."""

    block_n: int
    block_k: int
    splits: int = 1
    k_per_split: int = 0
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _stream_gemm(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_out, stride_split,
                 s_row_stride, k_per_split, SCALE: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, DOT: tl.constexpr, X_SCALE: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SUBS: tl.constexpr):  # fmt: skip
    # Each step of BK columns is SUBS unrolled sub-steps of BK // SUBS (= the scale block along K
    # when a step spans several): loads of every sub-step are in flight together, and each
    # partial product meets exactly one block scale.
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rm = tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK // SUBS)
    m_ok, n_ok = rm < M, rn < N
    k0 = split * k_per_split
    k1 = tl.minimum(k0 + k_per_split, K)
    x_ptrs = x_ptr + rm[:, None] * stride_x + (k0 + rk)[None, :]
    w_ptrs = w_ptr + rn[:, None] * stride_w + (k0 + rk)[None, :]
    s_rows = s_ptr + (rn // SCALE_N) * s_row_stride  # block scales of these columns (SCALE == _BLOCK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(k0, k1, BK):
        for j in tl.static_range(SUBS):
            kj = k + j * (BK // SUBS)
            k_ok = rk < k1 - kj
            x = tl.load(x_ptrs + j * (BK // SUBS), mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs + j * (BK // SUBS), mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            part = tl.dot((x.to(tl.float32) * X_SCALE).to(DOT), tl.trans(w.to(DOT)))
            if SCALE == 2:  # a sub-step past K (its part is 0) reads the row's last scale, not past it
                acc += part * tl.load(s_rows + tl.minimum(kj, k1 - 1) // SCALE_K, mask=n_ok, other=0.0)[None, :]
            else:
                acc += part
        x_ptrs += BK
        w_ptrs += BK
    if SCALE == 1:
        acc *= tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :] * (1.0 / X_SCALE)
    elif X_SCALE != 1.0:
        acc *= 1.0 / X_SCALE
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + split * stride_split + rm[:, None] * stride_out + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_splits(part_ptr, b_ptr, out_ptr, MN, N, SPLITS, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLITS):  # fixed order: the same bits every run
        acc += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def plan_stream(n: int, k: int, *, weight_bytes: int, scale_k: int | None, num_sms: int) -> StreamPlan:
    """The default cut for an [N, K] weight on a GPU of `num_sms` SMs (not tuned on the H200 yet:
    `bench/quant_gemm.py --sweep` times the alternatives).

    BLOCK_N: the widest of 64/32/16 that still gives two programs per SM (two resident programs
    keep several tiles in flight per SM: 4 TB/s over 132 SMs is ~30 GB/s each, ~30 KB in flight at
    ~1 us of latency), else 16 so that the weight spreads over as many SMs as it can. BLOCK_K: up
    to 512 bytes of each weight row per step, at most 8192 weights per tile (64 per thread at 4
    warps: no spills); a step wider than the scale block runs as unrolled scale-block sub-steps.
    Stages: as many as ~96 KB of shared memory holds (2..6), two programs per SM. Fewer than
    num_sms programs even at 16 columns: split K so that ~2 programs per SM run."""
    block_n = next((b for b in (64, 32) if triton.cdiv(n, b) >= 2 * num_sms), 16)
    block_k = min(512 // weight_bytes, 8192 // block_n)
    if scale_k is not None:  # at most two unrolled scale-block sub-steps: four spilled at 2 warps (sm_90)
        block_k = min(block_k, 2 * scale_k)
    stage_bytes = block_n * block_k * weight_bytes + SMALL_M_MAX * block_k * 2
    stages = max(2, min(6, (96 << 10) // stage_bytes))
    # One warp per 8 output columns (mma's n8), at most 4: more warps on a 16 x 16 output would
    # repeat the same products and activation conversions (seen in the sm_90 SASS).
    warps = min(4, block_n // 8)
    tiles = triton.cdiv(n, block_n)
    if tiles >= num_sms:
        return StreamPlan(block_n, block_k, num_warps=warps, num_stages=stages)
    unit = max(block_k, scale_k or 0)  # a split starts on a scale block
    splits = max(1, min(triton.cdiv(2 * num_sms, tiles), triton.cdiv(k, unit)))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), unit) * unit
    return StreamPlan(block_n, block_k, triton.cdiv(k, k_per_split), k_per_split, warps, stages)


def _dot_dtype(x: torch.Tensor, weight: torch.Tensor) -> tuple[tl.dtype, float]:
    """(tl.dot operand dtype, the factor x is scaled by on the way) for these operands."""
    if weight.dtype == torch.float8_e4m3fn:
        return tl.float16, (1.0 if x.dtype == torch.float16 else _X_SCALE)
    if weight.dtype == torch.float16:
        return tl.float16, 1.0
    return (tl.float32 if _interpreting() or weight.dtype == torch.float32 else tl.bfloat16), 1.0


def stream_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                  block: tuple[int, int] | None = None, bias: torch.Tensor | None = None, *,
                  plan: StreamPlan | None = None) -> torch.Tensor:
    """x [M, K] (M <= SMALL_M_MAX; bf16/fp16, fp32 only in tests) @ W^T (+ bias) -> [M, N] in x's dtype.

    weight [N, K]: float8_e4m3fn with `scale` = block scales [ceil(N / bn), ceil(K / bk)] (`block`
    = (bn, bk)) or per-channel scales [N] (`block` None); or bf16/fp16 with `scale` None.
    bias [N] or None. `plan` None: plan_stream's choice for this GPU."""
    m, k = x.shape
    n = weight.shape[0]
    if m > SMALL_M_MAX:
        raise ValueError(f"stream_linear takes x with 1..{SMALL_M_MAX} rows (x.shape[0]), not {m}")
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} features (x.shape[1]) but weight has {weight.shape[1]} (weight.shape[1])")
    is_fp8 = weight.dtype == torch.float8_e4m3fn
    if is_fp8 != (scale is not None):
        raise ValueError("scale must be given exactly when weight is float8_e4m3fn")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    kind = _NONE if scale is None else _PER_CHANNEL if block is None else _BLOCK
    scale_n, scale_k = block if kind == _BLOCK else (1, None)
    if plan is None:
        sms = 8 if _interpreting() else _num_sms(x.device.index or 0)
        plan = plan_stream(n, k, weight_bytes=weight.element_size(), scale_k=scale_k, num_sms=sms)
    subs = 1
    if scale_k is not None:
        if scale_k % plan.block_k and plan.block_k % scale_k:
            raise ValueError(f"plan.block_k={plan.block_k} must divide or be a multiple of the scale block "
                             f"along K ({scale_k})")
        subs = max(1, plan.block_k // scale_k)
    split = plan.splits > 1
    if split and plan.k_per_split % max(plan.block_k, scale_k or 1):
        raise ValueError(f"plan.k_per_split={plan.k_per_split} must be a multiple of block_k ({plan.block_k}) "
                         f"and of the scale block along K ({scale_k})")
    dest = torch.empty((plan.splits, m, n), dtype=torch.float32, device=x.device) if split else out
    dot, x_scale = _dot_dtype(x, weight)
    dummy = out  # never read: the pointer behind a constexpr-disabled operand
    _stream_gemm[(triton.cdiv(n, plan.block_n), plan.splits)](
        x, weight, dummy if scale is None else scale, dummy if bias is None or split else bias, dest,
        m, n, k, x.stride(0), weight.stride(0), n, m * n, scale.stride(0) if kind == _BLOCK else 0,
        plan.k_per_split if split else k, SCALE=kind, SCALE_N=scale_n, SCALE_K=scale_k or 1,
        HAS_BIAS=bias is not None and not split, DOT=dot, X_SCALE=x_scale, BM=16, BN=plan.block_n,
        BK=plan.block_k, SUBS=subs, num_warps=plan.num_warps, num_stages=plan.num_stages)
    if split:
        block_sum = 256
        _sum_splits[(triton.cdiv(m * n, block_sum),)](dest, dummy if bias is None else bias, out, m * n, n,
                                                      plan.splits, HAS_BIAS=bias is not None, BLOCK=block_sum)
    return out
