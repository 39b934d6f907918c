"""Rotary position embedding (half-rotation / "neox" layout, as HF checkpoints store q and k).

The cos/sin table is computed once in float32 for every position up to the model's limit;
each step gathers the rows of its tokens' absolute positions once (shared by every layer), so
chunked prefill, decode and recompute after preemption all see the same angles. As in the HF
reference, the rotation itself runs in the activation dtype.
"""

from __future__ import annotations

import math

import torch

from meshserve.attention.mla.spec import yarn_mscale
from meshserve.workers.models.arch import RopeScaling
from meshserve.workers.models.deepseek_arch import YarnRope


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
    yarn = YarnRope(theta=rope.theta, kind="yarn", factor=rope.factor,
                    original_max_position_embeddings=rope.original_max_position_embeddings,
                    beta_fast=rope.beta_fast, beta_slow=rope.beta_slow, mscale=rope.mscale,
                    mscale_all_dim=rope.mscale_all_dim, attention_factor=rope.attention_factor,
                    truncate=rope.truncate, interleaved=False)
    return yarn_inverse_frequencies(yarn, head_dim)


def yarn_inverse_frequencies(rope: YarnRope, dim: int) -> tuple[torch.Tensor, float]:
    """([dim // 2] float32 angular frequencies, attention factor) for a `dim`-wide rope part.

    YaRN (Peng et al. 2023) keeps the high-frequency dimensions (many rotations over the original
    context) as they are, divides the low-frequency ones by `factor`, and blends linearly between
    the dimensions that make beta_fast and beta_slow rotations. cos and sin are scaled by the
    attention factor mscale(factor, mscale) / mscale(factor, mscale_all_dim).
    """
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


def building_on_meta(device: torch.device | str | None) -> bool:
    """The module is being built on the meta device (loader.build_model): its tables get their
    values from reset_tables(device) once the model is on its device, so nothing is computed now
    (meta ops run through torch._refs, whose first call imports torch._dynamo: ~1 s)."""
    return device is None and torch.get_default_device().type == "meta"


def register_empty_tables(module: torch.nn.Module, width: int, max_positions: int) -> None:
    """`cos`, `sin` buffers of register_tables' shape, without values (building_on_meta)."""
    module.register_buffer("cos", torch.empty(max_positions, width), persistent=False)
    module.register_buffer("sin", torch.empty(max_positions, width), persistent=False)


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
        if building_on_meta(device):
            return register_empty_tables(self, self.head_dim // 2, self.max_positions)
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
    rotated = x.roll(half, -1)  # (x2, x1): one op where slicing, negating and cat took four
    rotated[..., :half].neg_()  # rotate_half(x) = (-x2, x1), bit for bit
    return x * cos + rotated * sin
