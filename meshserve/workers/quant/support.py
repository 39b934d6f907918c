"""Which devices serve which weight formats, and how: declared once, as data.

The generated table in docs/quantization.md, `meshserve backends` and the loader's refusal all
read SUPPORT; `python -m meshserve.workers.quant.support --write docs/quantization.md` refreshes
the page (a test fails when it is stale).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshserve.core.generated_docs import docs_main, replace_block
from meshserve.workers.quant.formats import WeightFormat


@dataclass(frozen=True)
class FormatSupport:
    """One weight format on one device kind. min_compute_capability: CUDA only (None: any);
    min_block_k: the smallest FP8 block along the input dim the compute takes (None: any)."""

    format: WeightFormat
    device: str
    compute: str
    bytes_per_weight: str
    min_compute_capability: tuple[int, int] | None = None
    min_block_k: int | None = None
    notes: str = ""


SUPPORT: tuple[FormatSupport, ...] = (
    FormatSupport(WeightFormat.FP8_BLOCK, "cuda", "activations quantized per token per block_k features, then "
                  "torch's blockwise scaled_mm (cuBLASLt, 128x128 blocks, sm90, probed once per shape; "
                  "fp8_cublas.py) or the Triton block GEMM (fp8_triton.py), by rows (gemm_table.py); <= 16 rows "
                  "(--small-m-gemm auto or on): one-launch split-K W8A16 GEMV (gemv.py)",
                  "1 + 4 / (bn * bk)", (8, 9), min_block_k=16,
                  notes="bf16/fp16 activations; fp32 activations take the reference path"),
    FormatSupport(WeightFormat.FP8_BLOCK, "cpu", "reference: the weight dequantized every call (exact, slow)",
                  "1 + 4 / (bn * bk)"),
    FormatSupport(WeightFormat.FP8_CHANNEL, "cuda", "activations quantized per token (one Triton kernel), then "
                  "torch._scaled_mm with row-wise scales, or per-tensor with unit scales + a rank-1 rescale "
                  "kernel, by rows (gemm_table.py); <= 16 rows (--small-m-gemm auto or on): one-launch split-K "
                  "W8A16 GEMV (gemv.py)",
                  "1 + 4 / in_features", (9, 0), notes="row-wise _scaled_mm needs sm90"),
    FormatSupport(WeightFormat.FP8_CHANNEL, "cpu", "reference: the weight dequantized every call (exact, slow)",
                  "1 + 4 / in_features"),
    FormatSupport(WeightFormat.MXFP4, "cuda", "dequantized at load; the MoE runs in the model dtype",
                  "2 (bf16; 0.53 in the checkpoint)", notes="interim: the fused MoE is to read packed MXFP4"),
    FormatSupport(WeightFormat.MXFP4, "cpu", "dequantized at load; the MoE runs in the model dtype",
                  "4 (fp32) or 2 (bf16)"),
)


def refusals(fmt: WeightFormat, device: str, compute_capability: tuple[int, int] | None = None,
             block: tuple[int, int] | None = None) -> list[str]:
    """Every reason `fmt` cannot be served on `device` (empty: it can)."""
    rows = [s for s in SUPPORT if s.format is fmt and s.device == device]
    if not rows:
        served = sorted({s.device for s in SUPPORT if s.format is fmt})
        return [f"{fmt} has no compute path on {device} (served on: {served})"]
    row, reasons = rows[0], []
    if row.min_compute_capability and compute_capability and compute_capability < row.min_compute_capability:
        need = ".".join(map(str, row.min_compute_capability))
        reasons.append(f"{fmt} needs FP8 tensor cores: compute capability >= {need}, this GPU has "
                       f"{'.'.join(map(str, compute_capability))} (serve a bf16 checkpoint here)")
    if row.min_block_k and block is not None and block[1] < row.min_block_k:
        reasons.append(f"{fmt} on {device} needs weight_block_size[1] >= {row.min_block_k}, not {block[1]}")
    return reasons


def support_table() -> str:
    lines = ["| weight format | device | compute | bytes per weight | min compute capability | notes |",
             "|---|---|---|---|---|---|"]
    for s in SUPPORT:
        cc = ".".join(map(str, s.min_compute_capability)) if s.min_compute_capability else "-"
        lines.append(f"| {s.format} | {s.device} | {s.compute} | {s.bytes_per_weight} | {cc} | {s.notes or '-'} |")
    return "\n".join(lines)


BEGIN, END = "<!-- BEGIN GENERATED: weight formats -->", "<!-- END GENERATED: weight formats -->"


def render_page(page: str) -> str:
    return replace_block(page, BEGIN, END, support_table())


def main() -> None:
    docs_main(__doc__, support_table, render_page)


if __name__ == "__main__":
    main()
