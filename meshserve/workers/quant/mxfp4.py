"""MXFP4 (OCP microscaling FP4), as GPT-OSS ships its experts.

Per expert, a weight [out, in] is stored as
  blocks uint8 [out, in / 32, 16]: 32 e2m1 values per group, two per byte, low nibble first;
  scales uint8 [out, in / 32]: e8m0, the group's scale is 2 ** (byte - 127).
e2m1 nibble: sign bit, 2 exponent bits, 1 mantissa bit -> {0, .5, 1, 1.5, 2, 3, 4, 6} and negatives.
"""

from __future__ import annotations

import torch

from meshserve.workers.quant.formats import MXFP4_GROUP

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in `dtype` (exact: every
    value is a small power-of-two multiple, representable in bf16 unless the scale under/overflows)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_GROUP // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair: "
                         f"blocks must be [..., G, {MXFP4_GROUP // 2}] for scales [..., G]")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.uint8)
    values = torch.stack((lut[(b & 0x0F).long()], lut[(b >> 4).long()]), dim=-1)  # [..., G, 16, 2]
    values = values.flatten(-2)  # [..., G, 32]: element 2i from the low nibble, 2i + 1 from the high
    exponent = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponent[..., None].float()).flatten(-2).to(dtype)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., K] float (K % 32 == 0) -> (blocks uint8 [..., K / 32, 16], scales uint8 [..., K / 32]).

    The scale is the power of two that brings the group's largest magnitude to at most 6, each
    value then rounds to the nearest e2m1 value (the OCP MX recipe); used to write test checkpoints
    and by tools that produce MXFP4 weights."""
    if weight.shape[-1] % MXFP4_GROUP:
        raise ValueError(f"MXFP4 needs the last dim ({weight.shape[-1]}) to be a multiple of {MXFP4_GROUP}")
    w = weight.float().unflatten(-1, (-1, MXFP4_GROUP))  # [..., G, 32]
    amax = w.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponent = (torch.ceil(torch.log2(amax / 6.0))).clamp(-127, 127)  # 6 * 2**e >= amax
    scaled = w / torch.exp2(exponent)[..., None]
    lut = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=w.device)
    magnitude = (scaled.abs()[..., None] - lut).abs().argmin(dim=-1)  # nearest of the 8 magnitudes
    codes = (magnitude | ((scaled < 0).long() << 3)).to(torch.uint8).unflatten(-1, (-1, 2))
    blocks = codes[..., 0] | (codes[..., 1] << 4)
    return blocks, (exponent + 127).to(torch.uint8)
