"""DeepSeek's rotary embedding: YaRN frequency scaling, an attention factor on cos/sin, pair rotation.

The YaRN frequencies and attention factor are rope.py's `yarn_inverse_frequencies` (GPT-OSS
uses them too). DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ...; the rotated vector
is returned with the even components first and the odd ones second, the same permutation for q
and k, so their dot products (all attention ever uses) are those of the interleaved rotation.
"""

from __future__ import annotations

import torch

from meshserve.workers.models.deepseek_arch import YarnRope
from meshserve.workers.models.rope import (
    building_on_meta,
    register_empty_tables,
    register_tables,
    yarn_inverse_frequencies,
)


class YarnRotary(torch.nn.Module):
    """Float32 cos/sin tables [max_positions, dim / 2] (times the attention factor)."""

    def __init__(self, rope: YarnRope, dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope, self.dim, self.max_positions = rope, dim, max_positions
        self.reset_tables()

    def reset_tables(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the tables, e.g. after the model was built on the meta device."""
        if building_on_meta(device):
            return register_empty_tables(self, self.dim // 2, self.max_positions)
        inv_freq, factor = yarn_inverse_frequencies(self.rope, self.dim)
        register_tables(self, inv_freq, factor, self.max_positions, device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` [T]: each [T, 1, dim / 2] in `dtype`, shared by every layer."""
        return self.cos[positions][:, None].to(dtype), self.sin[positions][:, None].to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
              interleaved: bool | None = None) -> torch.Tensor:  # fmt: skip
        """Rotate x [T, heads, dim] by the step's tables; interleaved None: the model's layout
        (DeepSeek-V3.2's indexer rotates halves whatever its MLA does)."""
        return rotate_pairs(x, cos, sin, interleaved=self.rope.interleaved if interleaved is None else interleaved)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool) -> torch.Tensor:
    """x [..., dim] rotated pairwise by cos, sin [..., dim / 2] (broadcast): pairs (x[2i], x[2i + 1])
    when interleaved, else (x[i], x[i + dim / 2]); returns (x1 cos - x2 sin, x2 cos + x1 sin) side
    by side, each product and sum rounded to the result dtype (torch's elementwise ops)."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
