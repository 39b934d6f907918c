"""A decode step's small ops on the CPU, fused in C++: one call where the torch ops make several.

Between its GEMMs and its attention a decode step of the demo model ran about 40 small torch
ops per layer (the residual add and the RMSNorm's six, the rotary embedding's roll / negate /
two multiplies / add, the K/V write's two `index_copy_`, SiLU and the multiply by up, the
splits and views around them): about 1 ms of a 7 ms batch-16 step on one thread, mostly
dispatch and cold-cache work on a few kilobytes each (docs/performance.md). Here each group is
one pass over its rows:

- `add_rms_norm(x, residual, weight, eps)`: s = x + residual (the stream, rounded to float32 as
  the add rounds it), rms_norm(s) * weight; without a residual the norm of x alone. The sum of
  squares runs in its own order (16 lanes, then across them): within float32 rounding of
  `_rms_norm_float32`'s `vecdot`, whose order is torch's; the scaling is the same two multiplies.
- `silu_and_mul(gate_up)`: silu(gate) * up with exp(-|gate|) by the polynomial of the paged
  decode kernel (within 2 ulp of expf): within a few ulp of `F.silu(gate) * up`.
- `rotary_write_kv(qkv, cos, sin, cache, slots, H, Hkv)`: rotates q and k of the fused qkv
  projection (x * cos + rotate_half(x) * sin, without fused multiply-adds: bit for bit
  `apply_rotary`), returns q and k as new contiguous tensors (and v, a view of qkv) and stores k
  and v at their cache slots (-1: not stored here), as the TORCH reference write does for a
  float32 cache.
- `argmax_rows(x)`: [N] int64 index of each row's maximum, the first on ties, a NaN counting as
  the largest (its first): `x.max(dim=-1).indices`, which on this CPU is a scalar loop (232 us
  for greedy's 64 x 4096 logits against about 10 here).

Float32 and contiguous rows only; the callers (workers/models/fused_ops.py) keep the torch ops
for anything else. Source: cpu_step_ops.cpp, compiled after the paged decode kernel's into one
module (cpu_extension.py); it uses that source's vector helpers (v16, load16, store16, hsum, exp16).
"""

from __future__ import annotations

import torch

from meshserve.attention.backends.cpu_extension import cpu_extension


def step_ops():
    """The compiled module holding these ops (None: not built; the torch ops serve)."""
    return cpu_extension()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rms_norm(x + residual) * weight, x + residual), or (rms_norm(x) * weight, None) without a
    residual. x, residual [..., N], weight [N]: float32, contiguous."""
    module = cpu_extension()
    out, total = module.add_rms_norm(x, residual if residual is not None else _EMPTY, weight, eps)
    return out, (total if residual is not None else None)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] float32 contiguous (gate, then up) -> silu(gate) * up [..., I]."""
    return cpu_extension().silu_and_mul(gate_up)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [N, V] float32 contiguous (V >= 1) -> [N] int64 index of each row's first maximum (NaN
    the largest)."""
    return cpu_extension().argmax_rows(x)


def rotary_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
                    slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, D] and k [T, Hkv, D] rotated (new tensors) and v [T, Hkv, D] (a view of qkv) from
    qkv [T, (H + 2 Hkv) * D]; k and v stored in cache [N, 2, bs, Hkv, D] at slot_mapping [T] int64
    (-1 skips). cos, sin: [T, D] or [T, 1, D] full-width tables. All float32, contiguous."""
    q, k, v = cpu_extension().rotary_write_kv(qkv, cos, sin, cache, slot_mapping, num_heads, num_kv_heads)
    return q, k, v


_EMPTY = torch.empty(0)

__all__ = ["step_ops", "argmax_rows", "add_rms_norm", "silu_and_mul", "rotary_write_kv"]
