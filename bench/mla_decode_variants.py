"""The TRITON MLA decode variants that bench/mla_decode_device.py times and bench/kernel_report_mla.py
compiles: today's default (the shared-rows kernel) and the FlashMLA-structured kernel
(kernels/mla_decode_fm.py) over column splits, tile lengths, warps and pipeline depths.
DeepSeek-V3 shapes: 128 heads, latent 512 + rope 64, bf16.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshserve.attention.mla.backends.triton_common import MLADecodeConfig, decode_config, flashmla_decode_config

HEADS = 128


@dataclass(frozen=True)
class Variant:
    label: str
    config: MLADecodeConfig


def _fm(value_split: int, block_n: int, warps: int, stages: int, block_h: int = 64, prefetch: bool = False) -> Variant:
    cfg = flashmla_decode_config(HEADS, "bfloat16", "cuda", value_split=value_split, block_n=block_n,
                                 num_stages=stages, prefetch=prefetch)  # fmt: skip
    cfg = dataclasses.replace(cfg, num_warps=warps, block_h=block_h)
    label = f"fm v{value_split} {block_h}x{block_n} w{warps} s{stages}{' pf' if prefetch else ''}"
    return Variant(label, cfg)


def variants() -> tuple[Variant, ...]:
    """What each should show is in docs/performance.md ("FlashMLA-structured TRITON decode")."""
    default = decode_config(HEADS, "bfloat16", "cuda")
    return (
        Variant("default 64x32 w8 s2", default),
        _fm(1, 32, 8, 3),  # the switch's default: the default's tiles, copies really 2 tiles deep
        _fm(1, 32, 8, 4),  # 3 tiles deep (216 KB)
        _fm(1, 64, 8, 2),  # [64, 512] accumulators with 64-key tiles, copies 1 tile deep
        _fm(2, 64, 8, 2),  # [64, 256] accumulators: Q K^T 4x, fewer registers
        _fm(2, 32, 4, 1),  # one warpgroup, 104 KB: two CTAs a SM overlap each other
        _fm(2, 16, 4, 2),  # the same with 16-key tiles through the pipeline (108 KB)
        _fm(2, 16, 4, 1, prefetch=True),  # two CTAs a SM, the next tile in registers (88 KB)
        _fm(2, 32, 8, 2, block_h=128),  # 128 heads: each warpgroup scores its own 64 heads
        _fm(2, 32, 8, 1, block_h=128, prefetch=True),
        _fm(2, 64, 8, 1, block_h=128),
    )
