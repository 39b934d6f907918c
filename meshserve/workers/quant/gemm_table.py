"""Which GEMM formulation an FP8 linear runs on CUDA, by rows (M), and which one a bf16/fp16
decoder projection runs at decode rows (StreamedLinear, ModelConfig.small_m_gemm "on"): one
table, flipped after a GPU measurement (`bench/kernels_device.py` prints the rows its numbers
suggest: the FP8 rows by default, the dense rows with `--part gemv16`).

Formulations (fp8_linear / dense_linear in layers.py dispatch; gemv.py / fp8_cublas.py /
fp8_triton.py / small_m.py run):
- GEMV               split-K GEMV, one launch (gemv.py): FP8 weights as W8A16 (activations
                     unquantized), bf16/fp16 weights in their own dtype; M <= SMALL_M_MAX on
                     linears built with small_m (ModelConfig.small_m_gemm auto or on for FP8, on
                     for bf16/fp16), where the table's small-M rows name it.
- GEMV_CORES         the GEMV's CUDA-core kernel for ONE row (gemv.CORES_CONFIG: float32
                     FMAs, no tensor cores); only in a small-M bucket of max_rows 1.
- STREAM             the weight-streaming kernel (small_m.py; FP8 as W8A16, bf16/fp16 as they
                     are), the GEMV's predecessor (2.2 TB/s on the H200 for FP8, 0.88x cuBLAS for
                     bf16 in a graph); where the small-M rows name it.
- DENSE_CUBLAS       bf16/fp16 weights only: F.linear (cuBLAS), what every other row of a dense
                     linear runs; a small_m_dense bucket may name it to keep cuBLAS.
- CUBLAS_BLOCKWISE   block scales: per-token-group activation quantization straight into the
                     outer-dim-major scale layout, then torch's 1x128 x 128x128 blockwise
                     scaled_mm (cuBLASLt, sm90); gated by a one-time probe per weight shape that
                     falls back (logged) to TRITON_BLOCK.
- TRITON_BLOCK       block scales: the same activation quantization, then the Triton block GEMM.
- CHANNEL_RESCALE    per-channel scales: per-token quantization, a per-tensor `_scaled_mm` with
                     unit scales (the raw product xq @ wq^T), then one kernel applying
                     s_x[m] * s_w[n] (and the bias).
- CHANNEL_ROWWISE    per-channel scales: per-token quantization, then `_scaled_mm` with row-wise
                     scales (the scales applied inside cuBLASLt's epilogue).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

from meshserve.workers.quant.formats import SMALL_M_MAX


class GemmWay(StrEnum):
    """A GEMM formulation (the module docstring lists them): FP8 ones and bf16/fp16 ones alike."""

    GEMV = "gemv"
    GEMV_CORES = "gemv_cores"
    STREAM = "stream"
    CUBLAS_BLOCKWISE = "cublas_blockwise"
    TRITON_BLOCK = "triton_block"
    CHANNEL_RESCALE = "channel_rescale"
    CHANNEL_ROWWISE = "channel_rowwise"
    DENSE_CUBLAS = "dense_cublas"


_BLOCK_WAYS = (GemmWay.GEMV, GemmWay.GEMV_CORES, GemmWay.STREAM, GemmWay.CUBLAS_BLOCKWISE, GemmWay.TRITON_BLOCK)
_CHANNEL_WAYS = (GemmWay.GEMV, GemmWay.GEMV_CORES, GemmWay.STREAM, GemmWay.CHANNEL_RESCALE, GemmWay.CHANNEL_ROWWISE)
_DENSE_WAYS = (GemmWay.GEMV, GemmWay.GEMV_CORES, GemmWay.STREAM, GemmWay.DENSE_CUBLAS)

# Rows bucket -> formulation for linears built with small_m, up to SMALL_M_MAX rows: ((max_rows,
# way), ...) in increasing max_rows; rows above the last bucket take the large-M rules below
# (dense weights: F.linear).
SmallMRows = tuple[tuple[int, GemmWay], ...]


@dataclass(frozen=True)
class GemmTable:
    """small_m_block / small_m_channel: for linears built with small_m, the formulation per rows
    bucket up to SMALL_M_MAX (block-scaled / per-channel weights). small_m_dense: the same for
    bf16/fp16 weights (StreamedLinear, small_m_gemm "on" only: "auto" leaves dense linears on
    nn.Linear, whatever this says). block_cublas_min_rows:
    block-scaled linears with at least this many rows try torch's blockwise scaled_mm (fewer: the
    Triton block GEMM). channel_rescale_max_rows: per-channel
    linears with at most this many rows run the unit-scale `_scaled_mm` + rank-1 rescale (more:
    row-wise `_scaled_mm`; 0 = never). rescale_raw_dtype: the raw product's dtype in the rescale
    formulation (float32: one rounding, to the output; bfloat16: two, half the bytes)."""

    small_m_block: SmallMRows = ((1, GemmWay.GEMV_CORES), (SMALL_M_MAX, GemmWay.GEMV))
    small_m_channel: SmallMRows = ((1, GemmWay.GEMV_CORES), (SMALL_M_MAX, GemmWay.GEMV))
    small_m_dense: SmallMRows = ((1, GemmWay.GEMV_CORES), (SMALL_M_MAX, GemmWay.GEMV))
    block_cublas_min_rows: int = SMALL_M_MAX + 1
    channel_rescale_max_rows: int = 0
    rescale_raw_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name, allowed in (("small_m_block", _BLOCK_WAYS), ("small_m_channel", _CHANNEL_WAYS),
                              ("small_m_dense", _DENSE_WAYS)):
            rows = getattr(self, name)
            bounds = [r for r, _ in rows]
            if bounds != sorted(set(bounds)) or any(not 1 <= r <= SMALL_M_MAX for r in bounds):
                raise ValueError(f"{name} row bounds must increase within 1..{SMALL_M_MAX}, not {bounds}")
            bad = [str(w) for _, w in rows if w not in allowed]
            if bad:
                raise ValueError(f"{name} names {bad}; allowed: {[str(w) for w in allowed]}")
            if any(w is GemmWay.GEMV_CORES and r != 1 for r, w in rows):
                raise ValueError(f"{name}: gemv_cores serves one row; put it in a bucket of max_rows 1, not {rows}")
        if self.block_cublas_min_rows < 1:
            raise ValueError(f"block_cublas_min_rows must be >= 1, not {self.block_cublas_min_rows}")
        if self.channel_rescale_max_rows < 0:
            raise ValueError(f"channel_rescale_max_rows must be >= 0, not {self.channel_rescale_max_rows}")
        if self.rescale_raw_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"rescale_raw_dtype must be torch.float32 or torch.bfloat16, not {self.rescale_raw_dtype}")


# small_m_block / small_m_channel, measured (2026-12-05, NVIDIA H100 80GB HBM3, `bench/kernels_device.py
# --budget 220`; docs/performance.md, "FP8 weights at decode speed"): the 32-layer decode graph of
# the Llama-3-8B projections, against bf16 cuBLAS (5.24 ms at M = 1): at M = 1 GEMV_CORES 1.75x
# (per-channel) / 1.71x (block), GEMV 1.54x / 1.53x, STREAM 1.47x / 1.20x, cuBLASLt blockwise
# 1.31x; at M = 16 GEMV 1.52x / 1.50x, STREAM 1.50x / 1.23x, cuBLASLt blockwise 1.43x (GEMV with
# gemv.DEFAULT_CONFIG; M = 4 was timed per layer only, where GEMV led STREAM per-channel).
# Not yet timed on the H200.
# small_m_dense: GEMV_CORES at one row and GEMV up to 16, by analogy with FP8. Measured since
# (2026-12-06, H100, `bench/kernels_device.py --part gemv16`, docs/performance.md "The eighteenth
# session's device calls"): on 16-bit weights neither beats cuBLAS per layer (8B 0.84x / 0.96-0.97x,
# GPT-OSS-20B 1.00x / 0.89-0.93x, DeepSeek-V2-Lite 0.97x / 0.79-0.80x at M = 1 / 4-16), and the 8B
# bs-1 step with them is 7.21 ms against cuBLAS's 6.32. So only small_m_gemm "on" reads these
# rows (an explicit request for the streaming kernels); "auto" keeps 16-bit weights on cuBLAS.
# The large-M defaults, from the H200 runs of 2026-12-02 (docs/performance.md, "FP8 GEMMs"): torch's
# blockwise scaled_mm measured 1.25x bf16 at M = 64 and 1.50x at M = 4096, so block-scaled layers
# take it above the small-M rows. The per-channel rescale formulation is NOT measured yet: off
# (0) until `bench/h200_gemm.sh` shows it ahead of the row-wise path; then set
# channel_rescale_max_rows to the largest M where it wins (and block_cublas_min_rows to 1 if
# the blockwise column beats the Triton block path at M = 1 and 16).
DEFAULT_TABLE = GemmTable()


def choose(table: GemmTable, *, block: bool, rows: int, small_m: bool) -> GemmWay:
    """The formulation an FP8 linear of `rows` rows runs on CUDA (before the blockwise probe,
    which may still send CUBLAS_BLOCKWISE to TRITON_BLOCK)."""
    if small_m and rows <= SMALL_M_MAX:
        for max_rows, way in table.small_m_block if block else table.small_m_channel:
            if rows <= max_rows:
                return way
    if block:
        return GemmWay.CUBLAS_BLOCKWISE if rows >= table.block_cublas_min_rows else GemmWay.TRITON_BLOCK
    return GemmWay.CHANNEL_RESCALE if rows <= table.channel_rescale_max_rows else GemmWay.CHANNEL_ROWWISE


def choose_dense(table: GemmTable, *, rows: int) -> GemmWay:
    """The formulation a bf16/fp16 StreamedLinear of `rows` rows runs on CUDA: the small_m_dense
    bucket holding `rows`, else DENSE_CUBLAS (F.linear)."""
    if rows <= SMALL_M_MAX:
        for max_rows, way in table.small_m_dense:
            if rows <= max_rows:
                return way
    return GemmWay.DENSE_CUBLAS
