"""DeepSeek's rotary embedding: YaRN frequency scaling, an attention factor on cos/sin, pair rotation.

YaRN (Peng et al. 2023) keeps the high-frequency dimensions (many rotations over the original
context) as they are, divides the low-frequency ones by `factor`, and blends linearly between
the dimensions that make beta_fast and beta_slow rotations. cos and sin are scaled by the
attention factor mscale(factor, mscale) / mscale(factor, mscale_all_dim). DeepSeek rotates
interleaved pairs (x0, x1), (x2, x3), ...; the rotated vector is returned with the even
components first and the odd ones second, the same permutation for q and k, so their dot
products (all attention ever uses) are those of the interleaved rotation.
"""

from __future__ import annotations

import math

import torch

from meshserve.attention.mla.spec import yarn_mscale
from meshserve.workers.models.deepseek_arch import YarnRope
from meshserve.workers.models.rope import register_tables


def yarn_inverse_frequencies(rope: YarnRope, dim: int) -> tuple[torch.Tensor, float]:
    """([dim // 2] float32 angular frequencies, attention factor) for a `dim`-wide rope part."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    base_freq = rope.theta**exponents  # wavelengths / 2 pi
    if rope.kind == "default":
        return 1.0 / base_freq, 1.0 if rope.attention_factor is None else rope.attention_factor
    extrapolation = 1.0 / base_freq
    interpolation = 1.0 / (rope.factor * base_freq)
    old_len = rope.original_max_position_embeddings

    def dim_for(rotations: float) -> float:
        """The dimension whose frequency makes `rotations` turns over the original context."""
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dim_for(rope.beta_fast), dim_for(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of width zero would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequency, kept), 0: interpolate (divided by factor)
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    factor = rope.attention_factor
    if factor is None:
        if rope.mscale and rope.mscale_all_dim:
            factor = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
        else:
            factor = yarn_mscale(rope.factor)
    return inv_freq, float(factor)


class YarnRotary(torch.nn.Module):
    """Float32 cos/sin tables [max_positions, dim / 2] (times the attention factor)."""

    def __init__(self, rope: YarnRope, dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope, self.dim, self.max_positions = rope, dim, max_positions
        self.reset_tables()

    def reset_tables(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the tables, e.g. after the model was built on the meta device."""
        inv_freq, factor = yarn_inverse_frequencies(self.rope, self.dim)
        register_tables(self, inv_freq, factor, self.max_positions, device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` [T]: each [T, 1, dim / 2] in `dtype`, shared by every layer."""
        return self.cos[positions][:, None].to(dtype), self.sin[positions][:, None].to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, dim] by the step's tables."""
        if self.rope.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
