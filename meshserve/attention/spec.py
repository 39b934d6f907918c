"""What one attention layer computes: the static, per-layer description.

A model builds one `AttentionSpec` per layer. Backends read it (never a global config) to know
what to compute; the registry checks it against each backend's declared capabilities.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property

from meshserve.core.attention_options import KVCacheDtype  # defined in core for config.py; part of this spec
from meshserve.errors import as_enum, check


def check_window(sliding_window: int | None, num_sink_tokens: int) -> None:
    """The window rule of a layer (AttentionSpec) and of its KV retention (kvstore): a window of
    at least one token, or none; sink tokens only beside a window."""
    if sliding_window is not None:
        check(sliding_window >= 1, "sliding_window", sliding_window, "an integer >= 1 or None")
    check(num_sink_tokens >= 0, "num_sink_tokens", num_sink_tokens, "an integer >= 0")
    check(num_sink_tokens == 0 or sliding_window is not None, "num_sink_tokens", num_sink_tokens,
          "0 unless sliding_window is set (sink tokens only matter beside a window)")

class AttentionType(StrEnum):
    DECODER = "decoder"  # causal self-attention over the paged cache
    ENCODER = "encoder"  # non-causal self-attention whose K/V are cached (for cross-attention later)
    ENCODER_ONLY = "encoder_only"  # non-causal self-attention, no KV cache (embedding models)
    CROSS = "cross"  # decoder queries over cached encoder K/V, non-causal


@dataclass(frozen=True)
class IndexerDims:
    """DeepSeek-V3.2's lightning indexer: sparse MLA attends to the `topk` best-scored earlier tokens.

    Each token caches one indexer key [head_dim] beside its latent (the indexer key cache); a
    query scores key t as sum_h w[h] * relu(q[h] . k_t / sqrt(head_dim)) over `num_heads` index heads.
    """

    num_heads: int  # index_n_heads
    head_dim: int  # index_head_dim (its first qk_rope_head_dim values are rope-rotated)
    topk: int  # index_topk: keys each query attends to (all of them when fewer are visible)

    def __post_init__(self) -> None:
        for name, config_key in (("num_heads", "index_n_heads"), ("head_dim", "index_head_dim"),
                                 ("topk", "index_topk")):  # fmt: skip
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, config_key, value, "an integer >= 1")


@dataclass(frozen=True)
class MLADims:
    """Multi-head latent attention dimensions (DeepSeek-V2/V3); `indexer` set: sparse MLA (V3.2)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    indexer: IndexerDims | None = None

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, name, value, "an integer >= 1")
        if self.q_lora_rank is not None:
            check(self.q_lora_rank >= 1, "q_lora_rank", self.q_lora_rank, "an integer >= 1 or None")
        if self.indexer is not None:
            check(self.indexer.head_dim >= self.qk_rope_head_dim, "index_head_dim", self.indexer.head_dim,
                  f"an integer >= qk_rope_head_dim={self.qk_rope_head_dim} (its first values are rope-rotated)")

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width before absorption: the no-rope part plus the rope part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_size(self) -> int:
        """Per-token width of the latent cache: compressed KV plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class AttentionSpec:
    """Static description of one attention layer.

    Masking semantics (positions are absolute token positions in the sequence):
      causal:          key kp visible to query qp iff kp <= qp
      sliding_window:  additionally qp - kp < sliding_window (the window counts the query itself)
      num_sink_tokens: keys kp < num_sink_tokens stay visible whatever the window (StreamingLLM)
      has_sinks:       a learned logit per head joins the softmax denominator (GPT-OSS); its
                       probability mass is dropped, so outputs sum to less than one
      use_alibi:       score += slope[h] * (kp - qp)
      logits_soft_cap: score = cap * tanh(score / cap), after scaling, before ALiBi and masks
    """

    num_heads: int
    num_kv_heads: int
    head_size: int
    head_size_v: int | None = None
    scale: float | None = None  # None: 1 / (q_scaling * sqrt(head_size))
    q_scaling: float = 1.0
    attn_type: AttentionType = AttentionType.DECODER
    sliding_window: int | None = None
    has_sinks: bool = False
    num_sink_tokens: int = 0
    use_alibi: bool = False
    logits_soft_cap: float | None = None
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO
    mla: MLADims | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "attn_type", as_enum(AttentionType, "attn_type", self.attn_type))
        object.__setattr__(self, "kv_cache_dtype", as_enum(KVCacheDtype, "kv_cache_dtype", self.kv_cache_dtype))
        check(self.num_heads >= 1, "num_heads", self.num_heads, "an integer >= 1")
        check(self.num_kv_heads >= 1, "num_kv_heads", self.num_kv_heads, "an integer >= 1")
        check(
            self.num_heads % self.num_kv_heads == 0,
            "num_kv_heads",
            self.num_kv_heads,
            f"a divisor of num_heads={self.num_heads}",
        )
        check(self.head_size >= 1, "head_size", self.head_size, "an integer >= 1")
        if self.head_size_v is not None:
            check(self.head_size_v >= 1, "head_size_v", self.head_size_v, "an integer >= 1 or None")
        check(self.q_scaling > 0, "q_scaling", self.q_scaling, "a number > 0")
        if self.scale is not None:
            check(self.scale > 0 and math.isfinite(self.scale), "scale", self.scale, "a finite number > 0")
        check_window(self.sliding_window, self.num_sink_tokens)
        if self.logits_soft_cap is not None:
            check(self.logits_soft_cap > 0, "logits_soft_cap", self.logits_soft_cap, "a number > 0 or None")
        if self.sliding_window is not None:
            check(
                self.attn_type is AttentionType.DECODER,
                "attn_type",
                str(self.attn_type),
                "'decoder' when sliding_window is set",
            )

    # Derived values: computed on first use and kept (the spec is frozen), so a layer's forward
    # pass reads them as attributes, not as a function call per layer per step.
    @cached_property
    def softmax_scale(self) -> float:
        if self.scale is not None:
            return self.scale
        return 1.0 / (self.q_scaling * math.sqrt(self.head_size))

    @cached_property
    def v_size(self) -> int:
        return self.head_size_v if self.head_size_v is not None else self.head_size

    @cached_property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @cached_property
    def is_causal(self) -> bool:
        return self.attn_type is AttentionType.DECODER

    @cached_property
    def uses_kv_cache(self) -> bool:
        return self.attn_type is not AttentionType.ENCODER_ONLY
