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


def _fm(value_split: int, block_n: int, warps: int, stages: int, block_h: int = 64) -> Variant:
    cfg = flashmla_decode_config(HEADS, "bfloat16", "cuda", value_split=value_split, block_n=block_n,
                                 num_stages=stages)  # fmt: skip
    cfg = dataclasses.replace(cfg, num_warps=warps, block_h=block_h)
    return Variant(f"fm v{value_split} {block_h}x{block_n} w{warps} s{stages}", cfg)


def variants() -> tuple[Variant, ...]:
    default = decode_config(HEADS, "bfloat16", "cuda")
    return (
        Variant("default 64x32 w8 s2", default),
        # Static model (bench/kernel_report_mla.py, Triton 3.6 SASS of the loop, docs/performance.md):
        _fm(1, 64, 8, 2),  # [64, 512] accumulators, 64-key tiles: ~30% fewer issue slots a key than default
        _fm(1, 32, 8, 3),  # the default's tiles one stage deeper
        _fm(2, 64, 8, 2),  # [64, 256] accumulators: 1.53x the tensor work, fewer registers
        _fm(2, 32, 4, 1),  # one warpgroup, 108 KB shared: two CTAs a SM overlap each other (ping-pong)
        _fm(2, 16, 4, 2),  # the same with 2 stages of 16-key tiles (also 108 KB)
        _fm(2, 32, 8, 3),
        # 128 heads a program: each warpgroup scores its own 64 heads (at 64 heads and 8 warps
        # Triton gives both warpgroups all 64 rows of Q K^T, computing it twice).
        _fm(2, 32, 8, 2, block_h=128),
        _fm(2, 64, 8, 1, block_h=128),
    )
