"""Triton kernels for FP8 block-scaled linears (DeepSeek-V3 / Qwen3-FP8 checkpoints), sm89+.

y = x @ W^T with W float8_e4m3fn [N, K] and one float32 scale per [block_n, block_k] block,
x quantized on the fly: one scale per token per block_k features ("per-token-group", the
scheme the checkpoints were trained for). Two launches:
1. `quantize_groups`: x [M, K] -> fp8 [M, K] + scales [M, ceil(K / group)] (amax / 448), one
   kernel writing both, row-major or in the outer-dim-major layout torch's blockwise scaled_mm
   reads (`quantize_rows` is its one-scale-per-token sibling, for online FP8's torch._scaled_mm).
2. `_block_gemm`: each program owns a [BM, BN] output tile and walks K one block_k at a time:
   acc += dot(xq, wq^T) * x_scale[m, kb] * w_scale[n // block_n, kb]   (float32 accumulator),
   so every partial product is rescaled exactly once, with its own two scales.
`rank1_rescale` is online FP8's other epilogue: a unit-scale per-tensor GEMM's raw product times
s_x[m] * s_w[n] (fp8_cublas.py). On CPU the same kernels run under TRITON_INTERPRET=1 (tests,
small shapes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshserve.workers.quant.formats import FP8_MAX


@triton.jit
def _round_e4m3(v):
    """v (float32, |v| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, in float32.

    The cast that follows is then exact. Rounding here rather than in the cast keeps the result
    identical to torch's `.to(float8_e4m3fn)` everywhere, including under TRITON_INTERPRET, whose
    cast loses the carry when a mantissa rounds up into the next power of two (124.3 -> 64)."""
    exp = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step_exp = tl.maximum(exp, -6) - 3  # 3 mantissa bits; subnormals below 2**-6 keep the 2**-9 step
    step = ((step_exp + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - step_exp) << 23).to(tl.float32, bitcast=True)
    steps = v * inv_step  # exact (a power of two), |steps| < 16
    r = ((steps + 12582912.0) - 12582912.0) * step  # 1.5 * 2**23: float addition rounds to even
    return tl.where(r == 0.0, v * 0.0, r)  # keep the sign of a value that rounds to zero, as a cast does


@triton.jit
def _group_quant(x_ptr, q_ptr, s_ptr, M, M_OUT, K, stride_x, stride_q, stride_sm, stride_sg,
                 ROWS: tl.constexpr, GROUP: tl.constexpr, FMAX: tl.constexpr):  # fmt: skip
    # One program quantizes ROWS tokens x one group: [ROWS, GROUP] values, one scale per row.
    # Rows M..M_OUT-1 are padding (the layout cuBLAS reads): q = 0 there, scale = the floor.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    ok = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    # IEEE divisions (div_rn): `/` on fp32 compiles to an approximate divide on NVIDIA GPUs, and
    # the values must equal torch's x / (amax / 448) to the bit.
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=1), FMAX), 1e-12)
    q = _round_e4m3(tl.clamp(tl.div_rn(x, scale[:, None]), -FMAX, FMAX))
    out_ok = (rows < M_OUT)[:, None] & (cols < K)[None, :]
    tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=out_ok)
    tl.store(s_ptr + rows * stride_sm + g * stride_sg, scale, mask=rows < M_OUT)


def quantize_groups(x: torch.Tensor, group: int, *, outer_major: bool = False,
                    row_align: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (fp32/fp16/bf16) -> (float8_e4m3fn [M', K], float32 scales [M', ceil(K / group)]).
    One launch; each program takes up to 16 tokens of one group (2048 values at group 128).

    Default: M' = M, scales row-major. `outer_major`: the scales are written token-fastest
    (strides (1, M'): the "outer-dim-major" 1x128 layout of torch's blockwise scaled_mm, so that
    no transpose kernel runs) and M' = M rounded up to `row_align`, the extra rows zeros (their
    scales the 1e-12 floor) for a GEMM that needs aligned scale columns; slice its output [:M]."""
    m, k = x.shape
    groups = triton.cdiv(k, group)
    m_out = triton.cdiv(m, row_align) * row_align
    q = torch.empty((m_out, k), dtype=torch.float8_e4m3fn, device=x.device)
    if outer_major:
        s = torch.empty((groups, m_out), dtype=torch.float32, device=x.device).t()  # [M', G], strides (1, M')
    else:
        s = torch.empty((m_out, groups), dtype=torch.float32, device=x.device)
    if m_out:
        rows = min(16, triton.next_power_of_2(m_out))
        _group_quant[(triton.cdiv(m_out, rows), groups)](x, q, s, m, m_out, k, x.stride(0), q.stride(0), s.stride(0),
                                                         s.stride(1), ROWS=rows, GROUP=group, FMAX=FP8_MAX,
                                                         num_warps=4 if rows * group >= 1024 else 1)
    return q, s


@triton.jit
def _row_quant(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr, FMAX: tl.constexpr):
    # One program per token: a pass for the row's amax, a second (from L1/L2) to quantize.
    row = tl.program_id(0)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, K, BLOCK):
        cols = k + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), FMAX), 1e-12)
    for k in range(0, K, BLOCK):
        cols = k + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        q = _round_e4m3(tl.clamp(tl.div_rn(x, scale), -FMAX, FMAX))
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=cols < K)
    tl.store(s_ptr + row, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic quantization in one launch: x [M, K] -> (float8_e4m3fn [M, K], float32
    scales [M, 1]), the operands of torch._scaled_mm's row-wise scaling. Bit-identical to
    `quantize_per_token_group(x, K)` (CPU torch)."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = min(4096, triton.next_power_of_2(k))
        _row_quant[(m,)](x, q, s, k, x.stride(0), q.stride(0), BLOCK=block, FMAX=FP8_MAX,
                         num_warps=8 if block >= 2048 else 4)
    return q, s


@triton.jit
def _rank1_rescale(raw_ptr, sx_ptr, sw_ptr, b_ptr, out_ptr, M, N, stride_raw, stride_out,
                   HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    m_ok, n_ok = rm < M, rn < N
    ok = m_ok[:, None] & n_ok[None, :]
    v = tl.load(raw_ptr + rm[:, None] * stride_raw + rn[None, :], mask=ok, other=0.0).to(tl.float32)
    sx = tl.load(sx_ptr + rm, mask=m_ok, other=0.0)
    sw = tl.load(sw_ptr + rn, mask=n_ok, other=0.0)
    y = (v * sx[:, None]) * sw[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_out + rn[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)


def rank1_rescale(raw: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """out [M, N] = raw [M, N] * x_scale[m] * w_scale[n] (+ bias [N]), in float32, one rounding to
    out_dtype: the epilogue of a per-channel FP8 GEMM run as a unit-scale per-tensor GEMM.
    x_scale [M] or [M, 1] and w_scale [N] float32, contiguous; raw's rows may be strided."""
    m, n = raw.shape
    if x_scale.numel() != m or w_scale.numel() != n:
        raise ValueError(f"rank1_rescale: x_scale has {x_scale.numel()} values for {m} rows (raw.shape[0]) and "
                         f"w_scale {w_scale.numel()} for {n} columns (raw.shape[1])")
    out = torch.empty((m, n), dtype=out_dtype, device=raw.device)
    if m and n:
        # Decode rows: narrow tiles, so that a few hundred KB still spread over ~100 programs.
        bm = min(16, triton.next_power_of_2(m))
        bn = 256 if m <= 4 else max(128, 2048 // bm)
        _rank1_rescale[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            raw, x_scale, w_scale, out if bias is None else bias, out, m, n, raw.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BM=bm, BN=bn, num_warps=4 if bm * bn >= 2048 else 2)
    return out


@triton.jit
def _block_gemm(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, stride_a, stride_b, stride_c,
                k_blocks, w_k_blocks, SCALE_N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    # Grouped tile order: GROUP_M row tiles share each column tile while it is in L2.
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m

    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok, n_ok = rm < M, rn < N
    a_ptrs = a_ptr + rm[:, None] * stride_a + rk[None, :]
    b_ptrs = b_ptr + rn[:, None] * stride_b + rk[None, :]
    a_scales = as_ptr + rm * k_blocks
    b_scales = bs_ptr + (rn // SCALE_N) * w_k_blocks
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, k_blocks):
        k_ok = rk < K - kb * BK
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        sa = tl.load(a_scales + kb, mask=m_ok, other=0.0)
        sb = tl.load(b_scales + kb, mask=n_ok, other=0.0)
        acc += tl.dot(a, tl.trans(b)) * sa[:, None] * sb[None, :]
        a_ptrs += BK
        b_ptrs += BK
    c = c_ptr + rm[:, None] * stride_c + rn[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _tiles(m: int, n: int) -> tuple[int, int, int, int]:
    """(BM, BN, warps, stages): small M (decode) takes narrow tiles so that enough programs run
    to keep every SM reading weights; large M the 128x128 tiles of a compute-bound GEMM."""
    bm = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    bn = 128
    while bn > 32 and triton.cdiv(m, bm) * triton.cdiv(n, bn) < 256:
        bn //= 2
    return bm, bn, 8 if bm * bn >= 128 * 128 else 4, 3 if bm >= 128 else 4


def block_gemm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
               block: tuple[int, int], out_dtype: torch.dtype, *,
               tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """xq fp8 [M, K], x_scale [M, ceil(K / bk)], weight fp8 [N, K], w_scale [ceil(N / bn), ceil(K / bk)]
    -> [M, N] in out_dtype. `tiles` (BM, BN, warps, stages): None = `_tiles`' choice (the bench's
    --sweep times others)."""
    m, k = xq.shape
    n = weight.shape[0]
    bn_scale, bk = block
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    if tiles is None:
        bm, bn, warps, stages = _tiles(m, n)
        bn = min(bn, bn_scale) if bn_scale >= 16 else bn  # a tile inside one scale row where it can be
    else:
        bm, bn, warps, stages = tiles
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _block_gemm[grid](xq, x_scale, weight, w_scale, out, m, n, k, xq.stride(0), weight.stride(0), out.stride(0),
                      x_scale.shape[1], w_scale.shape[1], SCALE_N=bn_scale, BM=bm, BN=bn, BK=bk, GROUP_M=8,
                      num_warps=warps, num_stages=stages)
    return out


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                     block: tuple[int, int]) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype: per-token-group quantization of x, then the block GEMM."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    xq, xs = quantize_groups(x2, block[1])
    return block_gemm(xq, xs, weight, w_scale, block, x.dtype).view(*lead, weight.shape[0])
