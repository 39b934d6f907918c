"""FP8 linears on torch's cuBLASLt GEMMs (sm90), with the activation quantization in front of
them written by one Triton kernel in the layout cuBLASLt reads.

Block-scaled weights (DeepSeek-V3 / Qwen3-FP8, 128 x 128 blocks): `torch.nn.functional.scaled_mm`
with ScalingType.BlockWise1x128 for the activations and BlockWise128x128 for the weight
(torch >= 2.9 with cuBLASLt >= 12.9, sm90 only). The layouts torch checks (ScaledBlas.cpp,
`_scaled_block1x128_block128x128`), for A = xq [M, K] and B = wq^T [K, N]:
- scale_a [M, ceil(K / 128)] with strides (1, M): token-fastest ("outer-dim-major").
  `quantize_groups(..., outer_major=True)` writes that layout directly; M is first rounded up to
  SCALE_ROW_ALIGN rows (zero rows, sliced off the output) so that every scale column starts
  16-byte aligned, which is what cuBLASLt's scale pointers and leading dimensions need.
- scale_b [round_up(ceil(K / 128), 4), ceil(N / 128)] with strides (1, round_up(..., 4)): the
  checkpoint's [ceil(N / 128), ceil(K / 128)] row-major scales, padded along K to a multiple of
  4, then transposed (a view; the pad copies only where K / 128 is not already a multiple of 4).
A one-time probe per (N, K, dtype, device) runs it once beside the Triton block GEMM on the same
operands; a refusal or a disagreement is logged once and sends that shape to the Triton block
GEMM for good (`probe_results()` lists the verdicts).

Per-channel weights (online FP8): besides torch._scaled_mm with row-wise scales, the rank-1
formulation out = (xq @ wq^T) * s_x[m] * s_w[n], computed as a per-tensor `_scaled_mm` with unit
scales (cuBLASLt's fastest FP8 GEMM, 1.66x bf16 at M = 1 where the row-wise one is 0.62x) whose
raw product the Triton `rank1_rescale` multiplies by both scales (float32, one rounding).
"""

from __future__ import annotations

import functools
import logging

import torch

from meshserve.workers.quant.fp8_triton import block_gemm, quantize_groups, quantize_rows, rank1_rescale

log = logging.getLogger("meshserve.quant")

SCALE_ROW_ALIGN = 4  # rows of xq / scale_a rounded up to this: 16-byte aligned float32 scale columns
BLOCK = (128, 128)  # the only block shape torch's blockwise scaled_mm takes
PROBE_REL_TOL = 1e-2  # blockwise vs Triton on the same operands: float32 sums, bf16 output (~1e-3)

_PROBES: dict[tuple, str | None] = {}  # (N, K, dtype, device) -> None (serves) or why it does not


def probe_results() -> dict[tuple, str | None]:
    """The probe verdicts so far: (N, K, dtype, device) -> None where torch's blockwise GEMM serves
    the shape, else the reason it fell back to the Triton block GEMM."""
    return dict(_PROBES)


def torch_weight_scales(w_scale: torch.Tensor) -> torch.Tensor:
    """Block scales [ceil(N / 128), ceil(K / 128)] (row-major) -> the scale_b torch's blockwise
    scaled_mm takes for B = W^T: [round_up(ceil(K / 128), 4), ceil(N / 128)], strides (1, that)."""
    pad = -w_scale.shape[1] % 4
    if pad or w_scale.stride(1) != 1 or w_scale.stride(0) != w_scale.shape[1]:
        w_scale = torch.nn.functional.pad(w_scale.float(), (0, pad)).contiguous()
    return w_scale.t()


def missing_blockwise_api() -> str | None:
    """Why this torch build has no blockwise scaled_mm (None: it has one; torch >= 2.9)."""
    F = torch.nn.functional
    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm"
    return None


def blockwise_scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale_b: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """xq fp8 [M, K], x_scale [M, ceil(K / 128)] strides (1, M), weight fp8 [N, K], scale_b from
    `torch_weight_scales` -> [M, N] in out_dtype (torch's blockwise scaled_mm, where
    `missing_blockwise_api()` is None; torch raises for a GPU or layout it does not serve)."""
    F = torch.nn.functional
    kinds = F.ScalingType
    return F.scaled_mm(xq, weight.t(), scale_a=x_scale, scale_recipe_a=kinds.BlockWise1x128, scale_b=scale_b,
                       scale_recipe_b=kinds.BlockWise128x128, output_dtype=out_dtype)


def _probe(key: tuple, xq, xs, weight, w_scale, scale_b, out_dtype, m: int) -> torch.Tensor | None:
    """Run the blockwise GEMM once and check it against the Triton block GEMM on the same
    operands; record the verdict. Returns the blockwise output [M', N] when it serves."""
    reason = missing_blockwise_api()
    if reason is not None:
        reason = f"torch blockwise scaled_mm refused: {reason}"
    else:
        try:
            got = blockwise_scaled_mm(xq, xs, weight, scale_b, out_dtype)
        except Exception as exc:  # noqa: BLE001 - any refusal (layout, arch, build) means "not here"
            reason = f"torch blockwise scaled_mm refused: {str(exc).strip().splitlines()[0][:200]}"
        else:
            ref = block_gemm(xq[:m], xs[:m].contiguous(), weight, w_scale, BLOCK, out_dtype).float()
            diff = (got[:m].float() - ref).norm() / ref.norm().clamp(min=1e-30)
            reason = None if bool(torch.isfinite(got[:m]).all()) and diff.item() < PROBE_REL_TOL else \
                f"torch blockwise scaled_mm disagrees with the Triton block GEMM (relative error {diff.item():.3g})"
    _PROBES[key] = reason
    n, k = weight.shape
    if reason is None:
        log.info("fp8 block GEMM [N=%d, K=%d, %s]: torch blockwise scaled_mm (probe passed)", n, k, out_dtype)
        return got
    log.warning("fp8 block GEMM [N=%d, K=%d, %s]: Triton block GEMM (%s)", n, k, out_dtype, reason)
    return None


def block_linear_cublas(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                        block: tuple[int, int]) -> torch.Tensor | None:
    """x [M, K] (bf16/fp16, row-contiguous) -> [M, N] through torch's blockwise scaled_mm, or None
    where it does not serve this shape (the caller runs the Triton block GEMM): a block other
    than 128 x 128, a shape whose probe failed, or an unprobed shape under CUDA-graph capture
    (a probe must synchronize; the eager warm-up before capture probes)."""
    if tuple(block) != BLOCK:
        return None
    n, k = weight.shape
    key = (n, k, x.dtype, str(x.device))
    probed = key in _PROBES
    if probed and _PROBES[key] is not None:
        return None
    if not probed and x.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    m = x.shape[0]
    xq, xs = quantize_groups(x, BLOCK[1], outer_major=True, row_align=SCALE_ROW_ALIGN)
    scale_b = torch_weight_scales(w_scale)
    if not probed:
        out = _probe(key, xq, xs, weight, w_scale, scale_b, x.dtype, m)
        return None if out is None else out[:m]
    return blockwise_scaled_mm(xq, xs, weight, scale_b, x.dtype)[:m]


@functools.cache
def _unit_scale(device: str) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=device)


def channel_rescale_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *,
                           bias: torch.Tensor | None = None,
                           raw_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, K] (row-contiguous) @ (weight fp8 [N, K] * scale [N, 1])^T (+ bias [N]) -> [M, N] in
    x's dtype: per-token quantization (one launch), the raw product xq @ wq^T from a per-tensor
    `_scaled_mm` with unit scales in raw_dtype, then s_x[m] * s_w[n] (+ bias) in one launch.

    Exact identity: x_q[m, k] s_x[m] and w_q[n, k] s_w[n] are the dequantized operands, so
    sum_k (x_q w_q)[m, n] s_x[m] s_w[n] is their product; the raw sum is held in raw_dtype
    (float32: the same precision cuBLASLt's row-wise epilogue has; bfloat16: one extra rounding)."""
    xq, x_scale = quantize_rows(x)  # [M, K] fp8, [M, 1] float32
    unit = _unit_scale(str(x.device))
    raw = torch._scaled_mm(xq, weight.t(), scale_a=unit, scale_b=unit, out_dtype=raw_dtype)
    return rank1_rescale(raw, x_scale, scale, x.dtype, bias)
