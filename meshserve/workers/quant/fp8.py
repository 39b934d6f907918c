"""FP8 numerics in plain torch: block and per-channel weight (de)quantization, per-token-group
activation quantization, and the reference linear the CPU path runs (and GPU tests compare with).

Conventions (DeepSeek-V3's and vLLM's): a scale is what multiplies the fp8 value back to the
real one (`weight_scale_inv` in checkpoints, despite its name), chosen as amax / 448 so that
the largest magnitude of its block lands on the largest finite float8_e4m3fn.
"""

from __future__ import annotations

import torch

from meshserve.core.arith import cdiv
from meshserve.workers.quant.formats import FP8_MAX

FP8 = torch.float8_e4m3fn
_TINY = 1e-12  # an all-zero block still gets a finite, positive scale


def expand_block_scales(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Scales [ceil(N / bn), ceil(K / bk)] -> one per element [N, K] (edge blocks cut to the shape)."""
    bn, bk = block
    n, k = shape
    return scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]


def dequantize_fp8_block(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight fp8 [N, K], scale float32 [ceil(N / bn), ceil(K / bk)] -> [N, K] in `dtype`
    (multiplied in float32, then cast: the exact product for float32 and float64)."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    return (weight.to(work) * expand_block_scales(scale.to(work), tuple(weight.shape), block)).to(dtype)


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (fp8 [N, K], float32 scales [ceil(N / bn), ceil(K / bk)])."""
    bn, bk = block
    n, k = weight.shape
    rows, cols = cdiv(n, bn), cdiv(k, bk)
    padded = weight.new_zeros(rows * bn, cols * bk, dtype=torch.float32)
    padded[:n, :k] = weight.float()
    tiles = padded.view(rows, bn, cols, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=_TINY)  # [rows, cols]
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(rows * bn, cols * bk)[:n, :k].contiguous(), scale


# Rows of a per-channel quantization are done this many elements at a time: each chunk's float32
# temporaries stay within ~256 MiB, where a whole LM head (128256 x 4096) would take ~2 GB per
# temporary on the device while the model loads. Each row is computed alone, so the result is the same.
_CHUNK_ELEMENTS = 1 << 26


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (fp8 [N, K], float32 scale [N]): online FP8's weights."""
    n, k = weight.shape
    q = torch.empty((n, k), dtype=FP8, device=weight.device)
    scale = torch.empty(n, dtype=torch.float32, device=weight.device)
    step = max(1, _CHUNK_ELEMENTS // max(k, 1))
    for start in range(0, n, step):
        w = weight[start:start + step].float()
        s = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=_TINY)
        q[start:start + step] = (w / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        scale[start:start + step] = s
    return q, scale


def quantize_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: x [M, K] -> (fp8 [M, K], float32 scales [M, ceil(K / group)]),
    one scale per token per `group` consecutive features (DeepSeek-V3: group = block_k = 128)."""
    m, k = x.shape
    groups = cdiv(k, group)
    padded = x.new_zeros(m, groups * group, dtype=torch.float32)
    padded[:, :k] = x.float()
    tiles = padded.view(m, groups, group)
    scale = (tiles.abs().amax(dim=2) / FP8_MAX).clamp(min=_TINY)
    q = (tiles / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(m, groups * group)[:, :k].contiguous(), scale


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                         block: tuple[int, int] | None) -> torch.Tensor:
    """x [..., K] @ dequantized(weight)^T -> [..., N] in x's dtype: the exact weights, unquantized
    activations (CPU path; slow: it rebuilds the float matrix every call).

    block None: scale is per output channel [N]."""
    if block is None:
        w = (weight.float() * scale.float()[:, None]).to(x.dtype)
    else:
        w = dequantize_fp8_block(weight, scale, block, x.dtype)
    return torch.nn.functional.linear(x, w)
