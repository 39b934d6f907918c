"""FP8 linear layers and the transform that puts them into a built (meta-device) model.

`Fp8Linear` holds weight float8_e4m3fn [out, in] and a float32 scale buffer: per block
(`weight_scale_inv` [ceil(out / bn), ceil(in / bk)], checkpoints) or per output channel
(`weight_scale` [out], online FP8). Its compute, by device:
- CUDA sm89+, at most SMALL_M_MAX rows (decode), on linears built with small_m
  (ModelConfig.small_m_gemm auto or on, docs/engine.md): what gemm_table.py's small-M rows name,
  by default the one-launch split-K W8A16 GEMV (gemv.py; activations stay bf16/fp16), or
  small_m.py's older streaming kernel, or a tiled formulation below.
- CUDA sm89+, more rows (or small_m_gemm off), by gemm_table.py's table: block scales ->
  per-token-group activation quantization, then torch's blockwise scaled_mm (cuBLASLt, sm90,
  probed once per shape: fp8_cublas.py) or the Triton block GEMM (fp8_triton.py); per-channel
  (sm90+, support.py) -> per-token quantization (one Triton kernel), then torch._scaled_mm with
  row-wise scales, or per-tensor with unit scales followed by the rank-1 rescale kernel.
- elsewhere (CPU): the exact reference, which dequantizes the weight every call (slow).
With `ctx` it is row-parallel: partial products all-reduced, bias added once afterwards.
`Fp8ParallelLMHead` is the vocabulary-split LM head with FP8 rows (ModelConfig.quantize_lm_head
at tp > 1): its rank's logits through the same fp8_linear, then ParallelLMHead's all-gather.
`StreamedLinear` is the bf16/fp16 sibling (`dense_linear`): at most SMALL_M_MAX rows on CUDA run
what gemm_table.py's small_m_dense rows name (by default the same split-K GEMV on the 16-bit
weight, gemv.py; or small_m.py's streaming kernel, or cuBLAS), swapped in by
`stream_dense_linears` when ModelConfig.small_m_gemm is "on" (not "auto": unmeasured on a GPU).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from meshserve.core.arith import cdiv
from meshserve.parallel.groups import ParallelContext, all_reduce
from meshserve.parallel.layers import ParallelLMHead, RowParallelLinear
from meshserve.workers.quant import gemm_table
from meshserve.workers.quant.formats import SMALL_M_MAX, WeightFormat
from meshserve.workers.quant.fp8 import FP8, dequantize_fp8_block, fp8_linear_reference
from meshserve.workers.quant.gemm_table import GemmTable, GemmWay, choose, choose_dense


@functools.cache
def _has_fp8_tensor_cores(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def _fast_path(x: torch.Tensor) -> bool:
    return x.is_cuda and _has_fp8_tensor_cores(x.device.index if x.device.index is not None else 0)


def _scaled_mm_per_channel(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16/fp16, weight fp8 [N, K], scale [N] -> [M, N]: per-token dynamic activation
    scales from one Triton launch, then torch._scaled_mm with row-wise scales (two launches)."""
    from meshserve.workers.quant.fp8_triton import quantize_rows

    xq, x_scale = quantize_rows(x)  # [M, K] fp8, [M, 1] float32
    # Row-wise scaling writes bf16 only (torch's rule); fp16 models take one cast.
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=torch.bfloat16)
    return y if x.dtype == torch.bfloat16 else y.to(x.dtype)


# cuBLASLt's FP8 GEMMs (torch._scaled_mm on CUDA) take N and K only in multiples of 16. The
# projections' N always are; a vocabulary (the LM head, ModelConfig.quantize_lm_head) or its TP
# shard need not be (32001, 50257, ...).
SCALED_MM_ALIGN = 16


def _per_channel_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                      way: GemmWay, table: GemmTable) -> torch.Tensor:
    """x [M, K] @ (weight fp8 [N, K] * scale [N, 1])^T (+ bias) by the per-channel GEMM `way`.
    When N is not a multiple of SCALED_MM_ALIGN, the whole multiples run the GEMM and the last
    N % 16 rows (at most 15 of them) the dequantized reference, concatenated along N."""
    n = weight.shape[0]
    whole = n - n % SCALED_MM_ALIGN
    if whole < n:
        tail = fp8_linear_reference(x, weight[whole:], scale[whole:], None)  # [M, N % 16]
        tail = tail if bias is None else tail + bias[whole:]
        if whole == 0:
            return tail
        front = _per_channel_gemm(x, weight[:whole], scale[:whole], None if bias is None else bias[:whole], way,
                                  table)
        return torch.cat((front, tail), dim=-1)
    if way is GemmWay.CHANNEL_RESCALE:
        from meshserve.workers.quant.fp8_cublas import channel_rescale_linear

        return channel_rescale_linear(x, weight, scale, bias=bias, raw_dtype=table.rescale_raw_dtype)  # bias fused
    y = _scaled_mm_per_channel(x, weight, scale)
    return y if bias is None else y + bias


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               *, small_m: bool = False, bias: torch.Tensor | None = None,
               table: GemmTable | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias [N]) -> [..., N] in x's dtype, W given as fp8 `weight` [N, K] and its
    `scale` (block: [ceil(N / bn), ceil(K / bk)]; block None: per output channel [N]).

    On CUDA the formulation follows `table` (None: gemm_table.DEFAULT_TABLE) by rows: with
    `small_m` (ModelConfig.small_m_gemm auto or on) up to SMALL_M_MAX rows run what the table's
    small-M rows name (default: the split-K W8A16 GEMV, gemv.py); other rows quantize the
    activations (block: per token per bk features, then torch's blockwise scaled_mm where its
    probe passed, else the Triton block GEMM; per-channel: per token, then `_scaled_mm` row-wise
    or unit-scale + rank-1 rescale)."""
    if not _fast_path(x) or x.dtype == torch.float32:
        y = fp8_linear_reference(x, weight, scale, block)
        return y if bias is None else y + bias
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    table = gemm_table.DEFAULT_TABLE if table is None else table
    way = choose(table, block=block is not None, rows=x2.shape[0], small_m=small_m)
    if way in (GemmWay.GEMV, GemmWay.GEMV_CORES):
        from meshserve.workers.quant.gemv import CORES_CONFIG, fits_gemv, weight_gemv

        if not fits_gemv(weight):  # past 32-bit offsets: the activation-quantized GEMM of larger M
            return fp8_linear(x, weight, scale, block, small_m=False, bias=bias, table=table)

        config = CORES_CONFIG if way is GemmWay.GEMV_CORES else None
        return weight_gemv(x2, weight, scale, block, bias, config=config).view(*lead, weight.shape[0])  # bias fused
    if way is GemmWay.STREAM:
        from meshserve.workers.quant.small_m import stream_linear

        return stream_linear(x2, weight, scale, block, bias).view(*lead, weight.shape[0])  # bias fused
    if way in (GemmWay.CHANNEL_RESCALE, GemmWay.CHANNEL_ROWWISE):
        return _per_channel_gemm(x2, weight, scale, bias, way, table).view(*lead, weight.shape[0])
    y = None
    if way is GemmWay.CUBLAS_BLOCKWISE:
        from meshserve.workers.quant.fp8_cublas import block_linear_cublas

        y = block_linear_cublas(x2, weight, scale, block)  # None: not served here (probe), Triton below
    if y is None:
        from meshserve.workers.quant.fp8_triton import fp8_block_linear

        y = fp8_block_linear(x2, weight, scale, block)
    y = y.view(*lead, weight.shape[0])
    return y if bias is None else y + bias


class Fp8Linear(nn.Module):
    """y = x @ dequant(W)^T (+ bias); ctx given: row-parallel (all-reduce, then the bias once)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, block: tuple[int, int] | None,
                 ctx: ParallelContext | None = None, small_m: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block, self.ctx = in_features, out_features, block, ctx
        self.small_m = small_m  # decode-sized inputs take the weight-streaming kernel (CUDA)
        self.weight_format = WeightFormat.FP8_CHANNEL if block is None else WeightFormat.FP8_BLOCK
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        if block is None:
            self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32))
        else:
            rows, cols = cdiv(out_features, block[0]), cdiv(in_features, block[1])
            self.register_buffer("weight_scale_inv", torch.empty(rows, cols, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    @property
    def scale(self) -> torch.Tensor:
        return self.weight_scale if self.block is None else self.weight_scale_inv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ctx is None:  # the bias joins the GEMM where the kernel can add it
            return fp8_linear(x, self.weight, self.scale, self.block, small_m=self.small_m, bias=self.bias)
        y = all_reduce(fp8_linear(x, self.weight, self.scale, self.block, small_m=self.small_m), self.ctx)
        return y if self.bias is None else y + self.bias

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in `dtype` (exact in float32, then cast): for consumers that read a
        plain matrix, e.g. the fused MoE's expert banks until they read FP8 themselves."""
        if self.block is None:
            return (self.weight.float() * self.weight_scale.float()[:, None]).to(dtype)
        return dequantize_fp8_block(self.weight, self.weight_scale_inv, self.block, dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, format={self.weight_format}, block={self.block}"


class Fp8ParallelLMHead(ParallelLMHead):
    """A vocabulary-split LM head with FP8 rows: weight float8_e4m3fn [rows, hidden] and one
    float32 `weight_scale` per row (what online FP8 writes; the loader quantizes this rank's rows).
    Its logits [N, rows] run fp8_linear (the small-M GEMV at decode rows, with `small_m`), then
    ParallelLMHead's all-gather along the vocabulary."""

    def __init__(self, vocab_size: int, hidden: int, *, ctx: ParallelContext, small_m: bool = False) -> None:
        super().__init__(vocab_size, hidden, ctx=ctx)
        rows = self.weight.shape[0]
        self.block, self.small_m = None, small_m
        self.weight_format = WeightFormat.FP8_CHANNEL
        self.weight = nn.Parameter(torch.empty(rows, hidden, dtype=FP8), requires_grad=False)
        self.register_buffer("weight_scale", torch.empty(rows, dtype=torch.float32))

    def local_logits(self, h: torch.Tensor) -> torch.Tensor:
        return fp8_linear(h, self.weight, self.weight_scale, None, small_m=self.small_m)

    def extra_repr(self) -> str:
        return f"rows={self.weight.shape[0]} of vocab={self.vocab_size}, format={self.weight_format}"


def _runs_decode_kernels(x: torch.Tensor) -> bool:
    """Whether x's device runs dense_linear's Triton decode kernels: CUDA (the CPU tests patch this
    to run them under TRITON_INTERPRET)."""
    return x.is_cuda


def dense_way(x: torch.Tensor, weight: torch.Tensor, table: GemmTable | None = None) -> GemmWay:
    """The formulation dense_linear runs for x [..., K] and a weight [N, K]: the table's small_m_dense
    choice for x's rows where a decode kernel can take it (x and weight both bf16 or both fp16, on
    CUDA, a weight within 32-bit offsets), else DENSE_CUBLAS."""
    rows = x.numel() // max(x.shape[-1], 1)
    if rows > SMALL_M_MAX or not _runs_decode_kernels(x) or x.dtype != weight.dtype:
        return GemmWay.DENSE_CUBLAS
    from meshserve.workers.quant.gemv import DENSE, fits_gemv

    if x.dtype not in DENSE or not fits_gemv(weight):
        return GemmWay.DENSE_CUBLAS
    return choose_dense(gemm_table.DEFAULT_TABLE if table is None else table, rows=rows)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 table: GemmTable | None = None) -> torch.Tensor:
    """x [..., K] @ weight^T (+ bias [N]) -> [..., N] for a bf16/fp16 `weight` [N, K], by `dense_way`
    (table None: gemm_table.DEFAULT_TABLE): at most SMALL_M_MAX rows on CUDA by default the split-K
    GEMV (gemv.DENSE_CONFIG; the CUDA-core kernel at one row, gemv.DENSE_CORES_CONFIG; bias fused),
    everything else F.linear."""
    way = dense_way(x, weight, table)
    if way is GemmWay.DENSE_CUBLAS:
        return nn.functional.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if way is GemmWay.STREAM:
        from meshserve.workers.quant.small_m import stream_linear

        y = stream_linear(x2, weight, bias=bias)
    else:
        from meshserve.workers.quant.gemv import DENSE_CORES_CONFIG, weight_gemv

        y = weight_gemv(x2, weight, bias=bias, config=DENSE_CORES_CONFIG if way is GemmWay.GEMV_CORES else None)
    return y.view(*x.shape[:-1], weight.shape[0])


class StreamedLinear(nn.Module):
    """A bf16/fp16 linear (row-parallel when `ctx` is given) whose decode-sized inputs (at most
    SMALL_M_MAX rows, on CUDA) run a one-launch decode kernel (`dense_linear`: by default the
    split-K GEMV, gemv.py; `table` None: gemm_table.DEFAULT_TABLE's small_m_dense rows), with no
    cuBLAS split-K reduction kernel. Larger inputs and other devices run F.linear. Parameters
    keep nn.Linear's names and shapes (weight [out, in], bias [out]), so loading is unchanged."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, ctx: ParallelContext | None, *,
                 table: GemmTable | None = None) -> None:
        super().__init__()
        self.weight, self.bias, self.ctx, self.table = weight, bias, ctx, table
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ctx is None:  # the bias joins the kernel
            return dense_linear(x, self.weight, self.bias, table=self.table)
        y = all_reduce(dense_linear(x, self.weight, table=self.table), self.ctx)
        return y if self.bias is None else y + self.bias  # row-parallel: the bias once, after the sum

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, small_m<={SMALL_M_MAX}"


# The decoder-layer projections the bf16 switch streams (fused and unfused names; DeepSeek's MLA
# projections but kv_b_proj, which the attention folds into matrices, and its shared experts;
# MLA's q_kv_a_proj stacks q_proj / q_a_proj with kv_a_proj_with_mqa); routed experts (a module
# list `experts`) are left to the fused MoE, which reads their weights as banks; routers, V3.2's
# indexer and the LM head stay on cuBLAS.
STREAMED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "gate_proj", "up_proj", "q_proj", "k_proj",
            "v_proj", "q_kv_a_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")


def stream_dense_linears(model: nn.Module) -> list[str]:
    """Swap the decoder layers' plain nn.Linear / RowParallelLinear projections of the built
    (meta-device, dtype-cast) `model` for StreamedLinear, keeping their parameters; returns the
    names swapped. FP8 layers (Fp8Linear) already stream at small M and are left alone."""
    modules = dict(model.named_modules())
    swapped = []
    for name, old in modules.items():
        parent, _, child = name.rpartition(".")
        dense = type(old) is nn.Linear or isinstance(old, RowParallelLinear)
        if child not in STREAMED or ".experts." in f".{name}" or not dense:
            continue
        new = StreamedLinear(old.weight, old.bias, old.ctx if isinstance(old, RowParallelLinear) else None)
        setattr(modules[parent] if parent else model, child, new)
        swapped.append(name)
    return swapped


def convert_linears(model: nn.Module, names: set[str], block: tuple[int, int] | None, *,
                    small_m: bool = False) -> None:
    """Swap each named nn.Linear / RowParallelLinear of the (meta-device, already dtype-cast)
    `model` for an Fp8Linear of the same shape (the bias keeps the model dtype), and a
    ParallelLMHead for an Fp8ParallelLMHead (per-channel scales only: `block` None)."""
    modules = dict(model.named_modules())
    for name in sorted(names):
        old = modules[name]
        if isinstance(old, ParallelLMHead):
            if block is not None:
                raise ValueError(f"'{name}' is a vocabulary-split LM head: FP8 with per-channel scales only "
                                 f"(block None), not block {block}")
            new = Fp8ParallelLMHead(old.vocab_size, old.weight.shape[1], ctx=old.ctx, small_m=small_m)
        elif isinstance(old, RowParallelLinear):
            out_f, in_f = old.weight.shape
            new = Fp8Linear(in_f, out_f, bias=old.bias is not None, block=block, ctx=old.ctx, small_m=small_m)
        elif isinstance(old, nn.Linear):
            new = Fp8Linear(old.in_features, old.out_features, bias=old.bias is not None, block=block,
                            small_m=small_m)
        else:
            raise TypeError(f"module '{name}' is a {type(old).__name__}, not a linear layer")
        if getattr(new, "bias", None) is not None:  # an LM head has none
            new.bias = nn.Parameter(torch.empty_like(old.bias), requires_grad=False)
        parent, _, child = name.rpartition(".")
        setattr(modules[parent] if parent else model, child, new)


def linear_names(model: nn.Module) -> list[str]:
    """Every nn.Linear / RowParallelLinear in `model`, by module name."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear | RowParallelLinear)]
