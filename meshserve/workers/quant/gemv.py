"""Weight GEMV for decode rows: y [M, N] = x [M, K] @ W^T (+ bias), M <= SMALL_M_MAX, W in FP8
(with block or per-channel scales: dequant(W)) or in bf16/fp16 (no scale).

At M <= 16 a linear is a read of its weight: the kernel's job is to keep enough weight bytes in
flight on every SM to stream W at HBM speed, in ONE launch. What differs from small_m.py's
streaming kernel (which read 2.2 TB/s on the H200 in a decode graph):
- Swapped operands: the weight tile is the dot's wide M side, out^T [BLOCK_N, 16] =
  W [BLOCK_N, BLOCK_K] @ x^T [BLOCK_K, 16], with BLOCK_N 64..128 rows per program, so the
  activation tile each program loads and converts per step (16 x BLOCK_K, mostly masked rows)
  is small against the weight tile (small_m.py at 16 columns converted as many activation
  values as it streamed weights), and warps are not idle on a 16 x 16 output.
- Split-K in the same launch: narrow weights (qkv, o, down: 64..96 tiles of 64 rows on 132 SMs)
  are cut along K so that ~GemvConfig.programs_per_sm programs per SM stream; each split writes a float32
  partial, and the LAST split of a column tile to arrive (an acq_rel atomic counter per tile)
  sums all partials in split order, adds the bias, writes the output and resets its counter.
  No second launch, no float atomics: the bits are the same run to run and graph replay equals
  eager. (cuBLAS at M = 1 picks split-K GEMMs followed by a separate reduction kernel.)
- FP8 numerics as small_m.py (W8A16): FP8 -> fp16 in registers (exact), bf16 activations scaled by
  2**-8 into fp16 (exact for 2**-6 <= |x| < 2**24, docs/quantization.md: the scale is applied
  in float32 before the fp16 rounding, and a run-time argument so the compiler keeps that order),
  float32 accumulation; a block scale multiplies each partial product of its scale block, a
  per-channel scale the finished row.
- bf16/fp16 weights (no scale, `SCALE == _NONE`): the weight tile goes to the dot in its own
  dtype with x in the same dtype (bf16 with bf16, fp16 with fp16: no conversion, no 2**-8
  scaling), float32 accumulation, the same split-K epilogue and bias. Under TRITON_INTERPRET
  (CPU tests) a bf16 dot runs on the float32 values instead (the interpreter's bf16 dot is wrong,
  a known interpreter bug; the products of two bf16 values are exact in float32 either way).
- For ONE row, a second design (`_gemv_row`, GemvConfig.cores, GemmWay.GEMV_CORES): no tensor
  cores, 16-byte weight loads straight into registers (16 FP8 or 8 bf16/fp16 weights), float32
  FMAs, the same split-K epilogue.

The counters live in one zero-initialised int32 buffer per device (`_counters`), allocated on
first use outside CUDA-graph capture; every launch leaves it zeroed. Two GEMVs must not run at
the same time on one device from two streams (they would share counters): the model runs its
linears on one stream.

Configs (GemvConfig) are data; `DEFAULT_CONFIG` is the one the serving path uses (measured for FP8
weights on an H100, 2026-12-05; NOT for bf16/fp16 weights) and bench/kernels_device.py sweeps
CONFIGS (`--part gemv16`: on bf16 weights) and prints which wins per shape. A config is in weight
columns: a bf16 tile of block_n x block_k takes twice an FP8 tile's shared memory, so the widest
configs may not compile for 16-bit weights (the bench reports them as failed).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from meshserve.workers.quant.formats import SMALL_M_MAX

_NONE, _CHANNEL, _BLOCK = 0, 1, 2  # the weight's scales: none (bf16/fp16), per output channel, per block
DENSE = (torch.bfloat16, torch.float16)  # weight dtypes that take no scale
# bf16 activations -> fp16 operand range (as small_m.py). A run-time argument, not a constexpr: with
# a constant power of two, the sm_90 build (Triton 3.6) rounds x to fp16 FIRST and then scales
# (F2FP.F16.F32 + HMUL2 in the SASS), so |x| > 65504 would overflow to inf.
_X_SCALE = 2.0**-8
# Widest sub-step: a [128 rows, 256 columns] fp16 operand in registers spilled per-channel at 4 warps
# (sm_90, Triton 3.6); 128 columns keep 64-row tiles near 90-120 registers.
SUB_MAX = 128
PREFETCH_BYTES = 512  # bytes per weight row, prefetched into L2 before a pdl program waits for its predecessor
MAX_COUNTERS = 1 << 16  # column tiles one launch may split (N <= 4M at 64 rows a tile)


@dataclass(frozen=True)
class GemvConfig:
    """block_n weight rows per program (64 or 128: the dot's M side), block_k weight columns per
    step, warps, software-pipeline stages, and programs_per_sm: how many programs (splits x column
    tiles) the grid aims at per SM; K is split only when the column tiles alone fall short. tma:
    weight tiles arrive through a tensor descriptor (the copy engine, one request per tile;
    Hopper+; a weight whose row stride or address is not 16-byte aligned takes pointer loads).
    cores: the CUDA-core kernel for ONE row (`_gemv_row`: no tensor cores, no shared memory,
    float32 FMAs; latency hidden by resident programs, not by a software pipeline; num_stages
    unused); block_n may then be 4 or 8. pdl: programmatic dependent launch (sm_90+): the
    program prefetches its first PREFETCH_BYTES of weight rows into L2 and only then waits for
    the previous kernel (`griddepcontrol.wait`; every read of x and every write comes after it),
    and lets the next kernel launch once its K loop is done."""

    block_n: int = 64
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4
    programs_per_sm: int = 4
    tma: bool = False
    cores: bool = False
    pdl: bool = False

    def __post_init__(self) -> None:
        for name, low in (("block_n", 4 if self.cores else 16), ("block_k", 16)):
            value = getattr(self, name)
            if value < low or value & (value - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two >= {low}, not {value}")
        if self.cores and (self.tma or self.pdl):
            raise ValueError("GemvConfig.cores takes pointer loads and plain launches (tma and pdl must be False)")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"GemvConfig.num_warps must be 1, 2, 4 or 8, not {self.num_warps}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"GemvConfig.num_stages must be in 1..8, not {self.num_stages}")
        if self.programs_per_sm < 1:
            raise ValueError(f"GemvConfig.programs_per_sm must be >= 1, not {self.programs_per_sm}")


# Measured (2026-12-05, NVIDIA H100 80GB HBM3, one device call: `python3 bench/kernels_device.py
# --budget 220`; docs/performance.md, "FP8 weights at decode speed"): the sweep's best tensor-core
# config over every projection and M is 64 rows x 256 FP8 bytes a step, 3 stages, 4 programs per
# SM (the 32-layer decode graph of the Llama-3-8B projections at M = 1: 1.54x bf16 cuBLAS, against
# 1.38x with 4 stages); for one row the CUDA-core kernel with 8 rows x 1024 bytes per program and
# 8 programs per SM (1.75x, against 1.67x at 16 x 512).
# sm_90 compile (Triton 3.6, bench/kernel_report_gemm.py): wgmma (HGMMA.64x16x16) with the
# weight converted in registers, cp.async weight loads, 118 (block) / 156 (channel) registers, no
# stack. 512-column steps spill per-channel (88 bytes): not listed.
# The cores configs (CORES_CONFIG: what GemmWay.GEMV_CORES runs, one row only): 16-byte weight
# loads, 42-68 registers, no stack, no shared-memory pipeline; ~4 instructions per weight byte
# (F2FP + HADD2 + FFMA per weight), about half the sm_90's issue rate at 4 TB/s.
DEFAULT_CONFIG = GemvConfig(64, 256, 4, 3, 4)
CORES_CONFIG = GemvConfig(8, 1024, 4, 1, 8, cores=True)  # one row only: what GemmWay.GEMV_CORES runs
# bf16/fp16 weights: NOT measured on a GPU (2026-12-06); `bench/kernels_device.py --part gemv16` prints
# the best of CONFIGS for 16-bit weights. Chosen from the sm_90 compile (bench/kernel_report_gemm.py,
# Triton 3.7): DEFAULT_CONFIG on a bf16 weight streams 512 bytes a row per step and takes 120 KB of
# shared memory (one program per SM resident, where FP8's takes 60 KB: three); 128 bf16 columns a
# step are FP8's measured 256 bytes a row, 60 KB at 3 stages (three resident), 40 registers, no stack.
# The cores kernel keeps CORES_CONFIG (8 rows x 1024 columns: 2 KB a row per step, 48 registers).
DENSE_CONFIG = GemvConfig(64, 128, 4, 3, 4)  # what weight_gemv runs for a bf16/fp16 weight when config is None
DENSE_CORES_CONFIG = CORES_CONFIG  # one row of a bf16/fp16 weight (gemm_table's GEMV_CORES)
CONFIGS = (
    DEFAULT_CONFIG,
    DENSE_CONFIG,
    GemvConfig(64, 128, 4, 4, 4),
    GemvConfig(64, 256, 4, 4, 4),
    GemvConfig(64, 128, 4, 6, 4),
    GemvConfig(64, 512, 4, 3, 2),
    GemvConfig(128, 256, 8, 3, 2),
    GemvConfig(128, 128, 4, 4, 2),
    GemvConfig(64, 256, 4, 4, 8),
    GemvConfig(64, 256, 4, 4, 2),
    GemvConfig(64, 256, 4, 4, 4, tma=True),
    GemvConfig(128, 256, 8, 4, 2, tma=True),
    GemvConfig(64, 128, 4, 8, 4, tma=True),
    GemvConfig(64, 256, 4, 4, 4, pdl=True),
    GemvConfig(64, 256, 4, 4, 4, tma=True, pdl=True),
    CORES_CONFIG,
    GemvConfig(8, 512, 4, 1, 8, cores=True),  # FP8's CORES_CONFIG bytes a step, for 16-bit weights
    GemvConfig(32, 512, 8, 1, 4, cores=True),
    GemvConfig(16, 512, 4, 1, 8, cores=True),
)


@dataclass(frozen=True)
class GemvPlan:
    """One launch's cut: the config, `splits` programs along K, each `k_per_split` columns long
    (a multiple of block_k), and the unrolled sub-steps per step: block_k // min(block_k,
    SUB_MAX, scale block), so that a sub-step never straddles two scale blocks and its converted
    weight tile stays within SUB_MAX columns of registers."""

    config: GemvConfig
    splits: int
    k_per_split: int
    subs: int


@triton.jit
def _gemv(x_ptr, w_ptr, w_desc, s_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, stride_x, stride_w,
          stride_out, s_row_stride, k_per_split, splits, x_scale, SPLIT: tl.constexpr, SCALE: tl.constexpr,
          SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT: tl.constexpr,
          W_BYTES: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SUBS: tl.constexpr,
          W_DESC: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr):  # fmt: skip
    # SCALE: _NONE (a bf16/fp16 weight: the dot takes it and x in DOT, their own dtype), _CHANNEL or
    # _BLOCK (FP8: converted to fp16, x scaled by x_scale into fp16). W_BYTES: bytes per weight.
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    SUB: tl.constexpr = BK // SUBS
    rn = pid_n * BN + tl.arange(0, BN)
    rm = tl.arange(0, MP)
    rk = tl.arange(0, SUB)
    n_ok, m_ok = rn < N, rm < M
    k0 = split * k_per_split
    k1 = tl.minimum(k0 + k_per_split, K)
    w_rows = w_ptr + rn[:, None] * stride_w + rk[None, :]  # [BN, SUB]
    x_rows = x_ptr + rm[:, None] * stride_x + rk[None, :]  # [MP, SUB]
    s_rows = s_ptr + (rn // SCALE_N) * s_row_stride  # block scales of these rows (SCALE == _BLOCK)
    if PDL:  # weights never change: warm L2 with them while the previous kernel finishes
        lines = k0 + tl.arange(0, PREFETCH // 128) * (128 // W_BYTES)  # one address per 128-byte line of a row
        ok = (n_ok[:, None] & (lines < k1)[None, :]).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; } mov.u32 $0, 0;", "=r,l,r",
            [w_ptr + rn[:, None] * stride_w + lines[None, :], ok], dtype=tl.int32, is_pure=False, pack=1)
        gdc_wait()  # the previous kernel's writes (x) are visible, and nothing of ours overwrites its inputs
    acc = tl.zeros((BN, MP), dtype=tl.float32)
    for k in range(k0, k1, BK):
        for j in tl.static_range(SUBS):
            kj = k + j * SUB
            k_ok = rk < k1 - kj
            if W_DESC:  # rows past N and columns past K arrive as zeros (the descriptor's bounds)
                w = w_desc.load([pid_n * BN, kj])
            else:
                w = tl.load(w_rows + kj, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_rows + kj, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if SCALE == 0:  # the weight's own dtype on both sides (DOT: float32 only under the interpreter)
                part = tl.dot(w.to(DOT), tl.trans(x.to(DOT)))  # [BN, MP] float32
            else:
                xt = tl.trans((x.to(tl.float32) * x_scale).to(tl.float16))  # [SUB, MP]
                part = tl.dot(w.to(tl.float16), xt)  # [BN, MP] float32
            if SCALE == 2:  # a sub-step past K (its part is 0) reads the row's last scale, not past it
                acc += part * tl.load(s_rows + tl.minimum(kj, k1 - 1) // SCALE_K, mask=n_ok, other=0.0)[:, None]
            else:
                acc += part
    if PDL:
        gdc_launch_dependents()
    if SCALE == 1:
        acc *= tl.load(s_ptr + rn, mask=n_ok, other=0.0)[:, None] * (1.0 / x_scale)
    elif SCALE == 2:
        acc *= 1.0 / x_scale
    ok = n_ok[:, None] & m_ok[None, :]
    out = out_ptr + rm[None, :] * stride_out + rn[:, None]  # out [M, N] written as its transpose
    if not SPLIT:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        part_tile = rm[None, :] * N + rn[:, None]  # partials [splits, M, N] float32
        tl.store(part_ptr + split * M * N + part_tile, acc, mask=ok)
        tl.debug_barrier()  # every thread's partial is written before the counter moves (release)
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:  # the last split of this column tile: sum all, in split order
            total = tl.zeros((BN, MP), dtype=tl.float32)
            for s in range(splits):
                # .cg: from L2, where the other SMs' partials are (this SM's L1 may hold nothing older,
                # but never trust it).
                total += tl.load(part_ptr + s * M * N + part_tile, mask=ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=ok)
            tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def _gemv_row(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, part_ptr, count_ptr, N, K, stride_w, s_row_stride,
              k_per_split, splits, SPLIT: tl.constexpr, SCALE: tl.constexpr, SCALE_N: tl.constexpr,
              SCALE_K: tl.constexpr, HAS_BIAS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              VEC: tl.constexpr):  # fmt: skip
    # One activation row on CUDA cores: each thread holds VEC consecutive weights of a row (one
    # 16-byte load: 16 FP8 or 8 bf16/fp16 weights), sums their products with x in float32 in its own
    # registers, and keeps one partial per (row, VEC-column chunk); the cross-thread sum runs once,
    # after the K loop. SCALE: _NONE, _CHANNEL or _BLOCK, as _gemv.
    C: tl.constexpr = BK // VEC
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    n_ok = rn < N
    chunk = tl.arange(0, C)[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [C, VEC] column offsets
    k0 = split * k_per_split
    k1 = tl.minimum(k0 + k_per_split, K)
    w_rows = w_ptr + rn[:, None, None] * stride_w  # [BN, 1, 1]
    acc = tl.zeros((BN, C), dtype=tl.float32)
    for k in range(k0, k1, BK):
        kk = k + chunk
        k_ok = kk < k1
        w = tl.load(w_rows + kk[None, :, :], mask=n_ok[:, None, None] & k_ok[None, :, :], other=0.0)
        x = tl.load(x_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
        part = tl.sum(w.to(tl.float32) * x[None, :, :], axis=2)  # [BN, C]
        if SCALE == 2:  # a VEC-column chunk lies inside one scale block (SCALE_K >= 16, k aligned)
            kb = tl.minimum(k + tl.arange(0, C) * VEC, k1 - 1) // SCALE_K
            s = tl.load(s_ptr + (rn // SCALE_N)[:, None] * s_row_stride + kb[None, :], mask=n_ok[:, None], other=0.0)
            acc += part * s
        else:
            acc += part
    res = tl.sum(acc, axis=1)  # [BN]
    if SCALE == 1:
        res *= tl.load(s_ptr + rn, mask=n_ok, other=0.0)
    if not SPLIT:
        if HAS_BIAS:
            res += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rn, res.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        tl.store(part_ptr + split * N + rn, res, mask=n_ok)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            total = tl.zeros((BN,), dtype=tl.float32)
            for s in range(splits):
                total += tl.load(part_ptr + s * N + rn, mask=n_ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + rn, total.to(out_ptr.dtype.element_ty), mask=n_ok)
            tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_COUNTERS: dict[str, torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor | None:
    """The device's zeroed int32 tile counters; None under CUDA-graph capture before the first
    eager call allocated them (the caller then runs unsplit)."""
    key = str(device)
    if key not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _COUNTERS[key] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def counters_zeroed(device: torch.device | str) -> bool:
    """Whether the device's tile counters are all zero (every split launch resets what it used;
    a launch that leaves one set would make the next launch's last split come too early)."""
    counters = _COUNTERS.get(str(device))
    return counters is None or not bool(counters.any())


def plan_gemv(n: int, k: int, *, scale_k: int | None, num_sms: int, config: GemvConfig = DEFAULT_CONFIG) -> GemvPlan:
    """How to cut an [N, K] weight: split K only when cdiv(N, block_n) column tiles are fewer than
    programs_per_sm x num_sms, into at most that many programs, each split a whole number of
    block_k steps (and of scale blocks: block_k and the scale block along K, `scale_k`, divide one
    another; scale_k None: per-channel scales or none)."""
    if scale_k is not None and scale_k % config.block_k and config.block_k % scale_k:
        raise ValueError(f"GemvConfig.block_k={config.block_k} must divide or be a multiple of the scale "
                         f"block along K ({scale_k})")
    subs = config.block_k // min(config.block_k, SUB_MAX, scale_k or SUB_MAX)
    tiles = triton.cdiv(n, config.block_n)
    steps = triton.cdiv(k, config.block_k)
    splits = max(1, min(steps, config.programs_per_sm * num_sms // tiles))
    k_per_split = triton.cdiv(steps, splits) * config.block_k
    return GemvPlan(config, triton.cdiv(k, k_per_split), k_per_split, subs)


# The kernels index the weight with 32-bit offsets (row * stride + column): the largest element a
# weight may reach. Today's largest heads stay far below (Gemma's 256000 x 3584: 0.92 G).
INT32_OFFSETS = (1 << 31) - 1


def fits_gemv(weight: torch.Tensor) -> bool:
    """Whether weight_gemv can address every element of `weight` [N, K] (INT32_OFFSETS)."""
    return (weight.shape[0] - 1) * weight.stride(0) + weight.shape[1] <= INT32_OFFSETS


def weight_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                block: tuple[int, int] | None = None, bias: torch.Tensor | None = None, *,
                config: GemvConfig | None = None, num_sms: int | None = None) -> torch.Tensor:
    """x [M, K] (M <= SMALL_M_MAX) @ W^T (+ bias) -> [M, N] in x's dtype, one launch.

    weight [N, K] (row stride may exceed K), one of:
    - float8_e4m3fn with `scale` float32: block scales [ceil(N / bn), ceil(K / bk)] with `block` =
      (bn, bk), or one per output channel [N] with `block` None; x bf16/fp16 (fp32 in tests);
    - bfloat16 / float16 with `scale` and `block` None; x in the weight's dtype.
    bias [N] or None. config None: DEFAULT_CONFIG (FP8) or DENSE_CONFIG (bf16/fp16). num_sms None:
    the GPU's (8 under the interpreter; bench/kernel_report_gemm.py passes the H200's to compile its
    real splits)."""
    m, k = x.shape
    n = weight.shape[0]
    if m > SMALL_M_MAX:
        raise ValueError(f"weight_gemv takes x with 0..{SMALL_M_MAX} rows (x.shape[0]), not {m}")
    dense = weight.dtype in DENSE
    if weight.dtype != torch.float8_e4m3fn and not dense:
        raise ValueError(f"weight_gemv takes a float8_e4m3fn (with scale), bfloat16 or float16 weight, not "
                         f"{weight.dtype}")
    if weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"weight must be [N, {k}] with contiguous rows (x has {k} features), not "
                         f"{list(weight.shape)} with strides {weight.stride()}")
    if not fits_gemv(weight):
        raise ValueError(f"weight_gemv computes weight offsets in 32 bits: a weight {list(weight.shape)} with row "
                         f"stride {weight.stride(0)} reaches past {INT32_OFFSETS} elements (the linears take "
                         "another GEMM for it)")
    if dense:
        if scale is not None or block is not None:
            raise ValueError(f"a {weight.dtype} weight takes no scale: scale and block must be None, not "
                             f"{None if scale is None else list(scale.shape)} and {block}")
        if x.dtype != weight.dtype:
            raise ValueError(f"x must be {weight.dtype} like the weight (a 16-bit weight meets x in its own "
                             f"dtype on the tensor cores), not {x.dtype}")
        scale_n, scale_k = 1, None
    else:
        if scale is None:
            raise ValueError("a float8_e4m3fn weight needs its scale: float32 [N] (block None) or block scales")
        scale_n, scale_k = block if block is not None else (1, None)
        want = (triton.cdiv(n, scale_n), triton.cdiv(k, scale_k)) if block is not None else (n,)
        if tuple(scale.shape) != want or scale.dtype != torch.float32:
            raise ValueError(f"scale must be float32 {list(want)} for block {block}, not {scale.dtype} "
                             f"{list(scale.shape)}")
        if block is None and not scale.is_contiguous():
            raise ValueError("per-channel scale must be contiguous")
        if block is not None and scale.stride(1) != 1:
            raise ValueError("block scales must have contiguous rows")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], not {list(bias.shape)}")
    if m == 0:
        return torch.empty((0, n), dtype=x.dtype, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    sms = num_sms or (8 if _interpreting() or not x.is_cuda else _num_sms(x.device.index or 0))
    plan = plan_gemv(n, k, scale_k=scale_k, num_sms=sms, config=config or (DENSE_CONFIG if dense else DEFAULT_CONFIG))
    counters = _counters(x.device) if plan.splits > 1 else None
    if plan.splits > 1 and (counters is None or triton.cdiv(n, plan.config.block_n) > MAX_COUNTERS):
        plan = GemvPlan(plan.config, 1, plan.k_per_split * plan.splits, plan.subs)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    parts = torch.empty((plan.splits, m, n), dtype=torch.float32, device=x.device) if plan.splits > 1 else out
    kind = _NONE if dense else _CHANNEL if block is None else _BLOCK
    s_arg = out if scale is None else scale  # never read without a scale (a constexpr-disabled operand)
    s_row_stride = scale.stride(0) if block is not None else 0
    x_scale = 1.0 if x.dtype == torch.float16 or dense else _X_SCALE
    cfg = plan.config
    if cfg.cores:
        if m != 1:
            raise ValueError(f"a GemvConfig with cores=True takes one row (x.shape[0] == 1), not {m}")
        if x.stride(0) != k:
            x = x.contiguous()
        _gemv_row[(triton.cdiv(n, cfg.block_n), plan.splits)](
            x, weight, s_arg, out if bias is None else bias, out, parts, out if counters is None else counters,
            n, k, weight.stride(0), s_row_stride, plan.k_per_split, plan.splits,
            SPLIT=plan.splits > 1, SCALE=kind, SCALE_N=scale_n, SCALE_K=scale_k or 1, HAS_BIAS=bias is not None,
            BN=cfg.block_n, BK=cfg.block_k, VEC=16 // weight.element_size(), num_warps=cfg.num_warps)
        return out
    desc = None
    if cfg.tma and (weight.stride(0) * weight.element_size()) % 16 == 0 and weight.data_ptr() % 16 == 0:
        from triton.tools.tensor_descriptor import TensorDescriptor

        desc = TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [cfg.block_n, cfg.block_k // plan.subs])
    pdl = cfg.pdl and not _interpreting()
    launch = {"launch_pdl": True} if pdl else {}
    _gemv[(triton.cdiv(n, cfg.block_n), plan.splits)](
        x, weight, weight if desc is None else desc, s_arg, out if bias is None else bias, out, parts,
        out if counters is None else counters, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        s_row_stride, plan.k_per_split, plan.splits, x_scale,
        SPLIT=plan.splits > 1, SCALE=kind, SCALE_N=scale_n, SCALE_K=scale_k or 1, HAS_BIAS=bias is not None,
        DOT=_dot_dtype(weight), W_BYTES=weight.element_size(), MP=16, BN=cfg.block_n, BK=cfg.block_k,
        SUBS=plan.subs, W_DESC=desc is not None, PDL=pdl, PREFETCH=PREFETCH_BYTES, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **launch)
    return out


def _dot_dtype(weight: torch.Tensor) -> tl.dtype:
    """The dot's operand dtype for a 16-bit weight: its own; float32 for bf16 under the interpreter
    (whose bf16 dot is wrong; float32 holds bf16 values and their products exactly). FP8: unused."""
    if weight.dtype == torch.float16:
        return tl.float16
    return tl.float32 if _interpreting() else tl.bfloat16
