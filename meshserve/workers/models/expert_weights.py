"""What the fused MoE kernels take: one layer's experts in their layout, the activation, and
one GEMM's tiles (fused_moe.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshserve.errors import check

ACT_SILU, ACT_SWIGLU_CLAMP = 0, 1


@dataclass(frozen=True)
class ExpertActivation:
    """SILU: silu(g) * u (DeepSeek). SWIGLU_CLAMP (GPT-OSS): g = min(g, limit),
    u = clamp(u, -limit, limit), (u + 1) * g * sigmoid(alpha * g)."""

    kind: int = ACT_SILU
    alpha: float = 1.702
    limit: float = 7.0


@dataclass(frozen=True)
class ExpertWeights:
    """One layer's experts in the kernels' layout (E experts, hidden H, intermediate I).

    w13: [E, 2I, H] gate rows then up rows; b13: [E, 2I] or None; w2: [E, H, I]; b2: [E, H] or
    None. All in the activation dtype, contiguous.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    b13: torch.Tensor | None
    b2: torch.Tensor | None
    activation: ExpertActivation

    def __post_init__(self) -> None:
        e, two_i, h = self.w13.shape
        check(two_i % 2 == 0, "w13", tuple(self.w13.shape), "[E, 2I, H] (gate rows, then up rows)")
        check(tuple(self.w2.shape) == (e, h, two_i // 2), "w2", tuple(self.w2.shape), f"[{e}, {h}, {two_i // 2}]")
        check(self.b13 is None or tuple(self.b13.shape) == (e, two_i), "b13", None if self.b13 is None
              else tuple(self.b13.shape), f"None or [{e}, {two_i}]")  # fmt: skip
        check(self.b2 is None or tuple(self.b2.shape) == (e, h), "b2", None if self.b2 is None
              else tuple(self.b2.shape), f"None or [{e}, {h}]")  # fmt: skip

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def intermediate(self) -> int:
        return self.w13.shape[1] // 2


@dataclass(frozen=True)
class GemmTiles:
    """One GEMM's tiles. gate_up: block_n columns of gate and as many of up (two accumulators)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
