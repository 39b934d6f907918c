"""Rotary position embedding (half-rotation / "neox" layout, as HF checkpoints store q and k).

The cos/sin table is computed once in float32 for every position up to the model's limit;
each step gathers the rows of its tokens' absolute positions once (shared by every layer), so
chunked prefill, decode and recompute after preemption all see the same angles. As in the HF
reference, the rotation itself runs in the activation dtype.
"""

from __future__ import annotations

import math

import torch

from meshserve.workers.models.arch import RopeScaling


def inverse_frequencies(rope: RopeScaling, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32 angular frequencies, after the checkpoint's scaling rule."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        return _llama3(inv_freq, rope)
    if rope.kind == "yarn":
        return _yarn(rope, head_dim)[0]
    return inv_freq


def attention_factor(rope: RopeScaling, head_dim: int) -> float:
    """The factor cos and sin are multiplied by (YaRN's temperature; 1 for the other kinds)."""
    return _yarn(rope, head_dim)[1] if rope.kind == "yarn" else 1.0


def _yarn(rope: RopeScaling, head_dim: int) -> tuple[torch.Tensor, float]:
    """YaRN on the two halves of each head (GPT-OSS): the same tables as DeepSeek's rope part."""
    from meshserve.workers.models.deepseek_arch import YarnRope
    from meshserve.workers.models.yarn_rope import yarn_inverse_frequencies

    yarn = YarnRope(theta=rope.theta, kind="yarn", factor=rope.factor,
                    original_max_position_embeddings=rope.original_max_position_embeddings,
                    beta_fast=rope.beta_fast, beta_slow=rope.beta_slow, mscale=rope.mscale,
                    mscale_all_dim=rope.mscale_all_dim, attention_factor=rope.attention_factor,
                    truncate=rope.truncate, interleaved=False)
    return yarn_inverse_frequencies(yarn, head_dim)


def _llama3(inv_freq: torch.Tensor, rope: RopeScaling) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def register_tables(module: torch.nn.Module, inv_freq: torch.Tensor, factor: float, max_positions: int,
                    device: torch.device | str | None) -> None:
    """Float32 `cos`, `sin` buffers [max_positions, len(inv_freq)] of `module`, times `factor`.
    Non-persistent: derived from the config, never read from the checkpoint."""
    freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos() * factor, freqs.sin() * factor
    if device is not None:
        cos, sin = cos.to(device), sin.to(device)
    module.register_buffer("cos", cos, persistent=False)
    module.register_buffer("sin", sin, persistent=False)


class RotaryEmbedding(torch.nn.Module):
    """Float32 cos/sin tables for positions [0, max_positions); `forward` gathers a step's rows."""

    def __init__(self, rope: RopeScaling, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope, self.head_dim, self.max_positions = rope, head_dim, max_positions
        self.reset_tables()

    def reset_tables(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the float32 cos/sin tables, e.g. after the model was built on the meta device."""
        inv_freq = inverse_frequencies(self.rope, self.head_dim)
        register_tables(self, inv_freq, attention_factor(self.rope, self.head_dim), self.max_positions, device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` [T]: each [T, 1, D] in `dtype` (once per step, shared by all layers)."""
        cos = self.cos[positions]  # [T, D/2] float32
        sin = self.sin[positions]
        # Full-width tables in the activation dtype, as the HF reference applies them.
        return torch.cat((cos, cos), -1)[:, None].to(dtype), torch.cat((sin, sin), -1)[:, None].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by cos, sin [T, 1, D]: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
