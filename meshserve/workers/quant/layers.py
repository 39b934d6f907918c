"""FP8 linear layers and the transform that puts them into a built (meta-device) model.

`Fp8Linear` holds weight float8_e4m3fn [out, in] and a float32 scale buffer: per block
(`weight_scale_inv` [ceil(out / bn), ceil(in / bk)], checkpoints) or per output channel
(`weight_scale` [out], online FP8). Its compute, by device:
- CUDA sm89+: block scales -> the Triton block GEMM with per-token-group activation
  quantization (fp8_triton.py); per-channel (sm90+, support.py) -> torch._scaled_mm with
  per-token activation scales (row-wise scaling).
- elsewhere (CPU): the exact reference, which dequantizes the weight every call (slow).
With `ctx` it is row-parallel: partial products all-reduced, bias added once afterwards.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from meshserve.parallel.groups import ParallelContext, all_reduce
from meshserve.parallel.layers import RowParallelLinear
from meshserve.workers.quant.formats import FP8_MAX, WeightFormat
from meshserve.workers.quant.fp8 import FP8, dequantize_fp8_block, fp8_linear_reference


@functools.cache
def _has_fp8_tensor_cores(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def _fast_path(x: torch.Tensor) -> bool:
    return x.is_cuda and _has_fp8_tensor_cores(x.device.index if x.device.index is not None else 0)


def _scaled_mm_per_channel(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16/fp16, weight fp8 [N, K], scale [N] -> [M, N]: per-token dynamic activation scales."""
    x_scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)  # [M, 1]
    xq = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    # Row-wise scaling writes bf16 only (torch's rule); fp16 models take one cast.
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1).float(),
                         out_dtype=torch.bfloat16)
    return y if x.dtype == torch.bfloat16 else y.to(x.dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] | None) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype, W given as fp8 `weight` [N, K] and its `scale`
    (block: [ceil(N / bn), ceil(K / bk)]; block None: per output channel [N])."""
    if not _fast_path(x) or x.dtype == torch.float32:
        return fp8_linear_reference(x, weight, scale, block)
    if block is None:
        lead = x.shape[:-1]
        return _scaled_mm_per_channel(x.reshape(-1, x.shape[-1]), weight, scale).view(*lead, weight.shape[0])
    from meshserve.workers.quant.fp8_triton import fp8_block_linear

    return fp8_block_linear(x, weight, scale, block)


class Fp8Linear(nn.Module):
    """y = x @ dequant(W)^T (+ bias); ctx given: row-parallel (all-reduce, then the bias once)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, block: tuple[int, int] | None,
                 ctx: ParallelContext | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block, self.ctx = in_features, out_features, block, ctx
        self.weight_format = WeightFormat.FP8_CHANNEL if block is None else WeightFormat.FP8_BLOCK
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        if block is None:
            self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32))
        else:
            rows, cols = -(-out_features // block[0]), -(-in_features // block[1])
            self.register_buffer("weight_scale_inv", torch.empty(rows, cols, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    @property
    def scale(self) -> torch.Tensor:
        return self.weight_scale if self.block is None else self.weight_scale_inv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_linear(x, self.weight, self.scale, self.block)
        if self.ctx is not None:
            y = all_reduce(y, self.ctx)
        return y if self.bias is None else y + self.bias

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in `dtype` (exact in float32, then cast): for consumers that read a
        plain matrix, e.g. the fused MoE's expert banks until they read FP8 themselves."""
        if self.block is None:
            return (self.weight.float() * self.weight_scale.float()[:, None]).to(dtype)
        return dequantize_fp8_block(self.weight, self.weight_scale_inv, self.block, dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, format={self.weight_format}, block={self.block}"


def convert_linears(model: nn.Module, names: set[str], block: tuple[int, int] | None) -> None:
    """Swap each named nn.Linear / RowParallelLinear of the (meta-device, already dtype-cast)
    `model` for an Fp8Linear of the same shape; the bias keeps the model dtype."""
    modules = dict(model.named_modules())
    for name in sorted(names):
        old = modules[name]
        if isinstance(old, RowParallelLinear):
            out_f, in_f = old.weight.shape
            new = Fp8Linear(in_f, out_f, bias=old.bias is not None, block=block, ctx=old.ctx)
        elif isinstance(old, nn.Linear):
            new = Fp8Linear(old.in_features, old.out_features, bias=old.bias is not None, block=block)
        else:
            raise TypeError(f"module '{name}' is a {type(old).__name__}, not a linear layer")
        if new.bias is not None:
            new.bias = nn.Parameter(torch.empty_like(old.bias), requires_grad=False)
        parent, _, child = name.rpartition(".")
        setattr(modules[parent] if parent else model, child, new)


def linear_names(model: nn.Module) -> list[str]:
    """Every nn.Linear / RowParallelLinear in `model`, by module name."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear | RowParallelLinear)]
