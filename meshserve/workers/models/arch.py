"""A decoder's shape and per-architecture differences, as data read from an HF config.json.

One `ModelArch` describes every supported architecture: Llama (llama3 rope scaling), Qwen2
(bias on q/k/v), Qwen3 (RMSNorm on each q/k head), Mistral (sliding window), Gemma2 (soft-caps,
sandwich norms, scaled embeddings, alternating windows), Gemma3 text (Gemma2 without soft-caps,
with (1 + w) q/k norms and a local rope base for windowed layers), GPT-OSS (learned sinks, YaRN, a
mixture of experts: gptoss_moe.py). Each parser
below maps one `architectures` name to the fields that differ; the transformer reads only
this record, so adding an architecture is a table entry, not a copy of the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from meshserve.errors import ConfigError, check
from meshserve.workers.models.deepseek_arch import DeepseekArch, deepseek_generic_config, parse_deepseek
from meshserve.workers.quant.formats import parse_quantization_config


@dataclass(frozen=True)
class RopeScaling:
    """Rotary embedding parameters (HF `rope_parameters` / legacy `rope_theta` + `rope_scaling`).

    kind: "default", "linear" (positions / factor), "llama3" (frequency-band smoothing) or
    "yarn" (YaRN: beta_fast/beta_slow ramp, cos/sin times attention_factor; GPT-OSS).
    """

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None  # yarn: None = derived from factor (and mscales)
    mscale: float | None = None
    mscale_all_dim: float | None = None

    KINDS = ("default", "linear", "llama3", "yarn")

    def __post_init__(self) -> None:
        check(self.kind in self.KINDS, "rope_type", self.kind, f"one of {list(self.KINDS)}")
        check(self.theta > 0, "rope_theta", self.theta, "a number > 0")
        check(self.factor > 0, "rope factor", self.factor, "a number > 0")
        if self.kind == "yarn":
            check(self.original_max_position_embeddings is not None, "original_max_position_embeddings",
                  None, "an integer >= 1 for yarn rope scaling")
        if self.kind == "llama3":
            check(self.high_freq_factor > self.low_freq_factor, "high_freq_factor", self.high_freq_factor,
                  f"a number > low_freq_factor={self.low_freq_factor}")
            check(self.original_max_position_embeddings is not None, "original_max_position_embeddings",
                  None, "an integer >= 1 for llama3 rope scaling")


@dataclass(frozen=True)
class SwigluExperts:
    """GPT-OSS's mixture of experts: top_k of num_experts per token, softmax over the chosen
    router logits; each expert is a clamped SwiGLU (gate * sigmoid(alpha * gate) * (up + 1))."""

    num_experts: int
    top_k: int
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        check(isinstance(self.num_experts, int) and self.num_experts >= 1, "num_local_experts",
              self.num_experts, "an integer >= 1")
        check(isinstance(self.top_k, int) and 1 <= self.top_k <= self.num_experts, "num_experts_per_tok",
              self.top_k, f"an integer in [1, num_local_experts={self.num_experts}]")
        check(self.swiglu_limit > 0, "swiglu_limit", self.swiglu_limit, "a number > 0")


@dataclass(frozen=True)
class ModelArch:
    """Everything the transformer needs to know about one checkpoint's architecture.

    layer_windows: one entry per layer, the sliding window (in tokens, counting the query
    itself) or None for full attention.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeScaling
    layer_windows: tuple[int | None, ...]
    hidden_act: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    deepseek: DeepseekArch | None = None  # MLA + MoE models (deepseek_arch.py); built by deepseek.py
    # Gemma-style details (all off for Llama-like models):
    norm_unit_offset: bool = False  # RMSNorm multiplies by (1 + weight): checkpoints store the offset
    embed_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden_size))
    sandwich_norms: bool = False  # norms after attention and MLP too (pre/post_feedforward_layernorm)
    attn_scale: float | None = None  # softmax scale; None: 1 / sqrt(head_dim)
    attn_soft_cap: float | None = None  # attention logits: cap * tanh(score / cap)
    final_soft_cap: float | None = None  # LM logits: cap * tanh(logit / cap)
    local_rope: RopeScaling | None = None  # Gemma3: the sliding-window layers' own rope (None: `rope`)
    # GPT-OSS details:
    attn_sinks: bool = False  # a learned per-head logit joins each softmax denominator (self_attn.sinks)
    experts: SwigluExperts | None = None  # the MLP is gptoss_moe.SwigluMoE

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, name, value, "an integer >= 1")
        check(self.num_heads % self.num_kv_heads == 0, "num_key_value_heads", self.num_kv_heads,
              f"a divisor of num_attention_heads={self.num_heads}")
        check(len(self.layer_windows) == self.num_layers, "layer_types", len(self.layer_windows),
              f"one entry per layer ({self.num_layers})")
        for name in ("attn_soft_cap", "final_soft_cap", "attn_scale", "embed_scale"):
            value = getattr(self, name)
            check(value is None or value > 0, name, value, "a number > 0 or None")
        check(self.hidden_act in ACTIVATIONS, "hidden_act", self.hidden_act, f"one of {sorted(ACTIVATIONS)}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        """Weights in the checkpoint (embeddings counted once when tied)."""
        attn = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        if self.experts is not None:
            mlp = self.experts.num_experts * (mlp + 3 * self.intermediate_size + 2 * self.hidden_size)
        layer = attn + mlp + 2 * self.hidden_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embed + self.hidden_size


ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")


def _rope(cfg: dict[str, Any]) -> RopeScaling:
    # transformers >= 5 writes `rope_parameters`; older checkpoints `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))

    def num(key: str) -> float | None:
        return None if params.get(key) is None else float(params[key])

    return RopeScaling(
        theta=float(theta),
        kind=str(kind),
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=num("attention_factor"),
        mscale=num("mscale"),
        mscale_all_dim=num("mscale_all_dim"),
    )


def _eos(cfg: dict[str, Any]) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _layer_windows(cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding windows from `layer_types` (Qwen2/3 style) or one global window (Mistral)."""
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:
        window = None
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        if window is not None and "max_window_layers" in cfg:
            layer_types = ["sliding_attention" if i >= cfg["max_window_layers"] else "full_attention"
                           for i in range(num_layers)]
        else:
            layer_types = ["sliding_attention" if window is not None else "full_attention"] * num_layers
    allowed = ("full_attention", "sliding_attention")
    for i, kind in enumerate(layer_types):
        check(kind in allowed, f"layer_types[{i}]", kind, f"one of {list(allowed)}")
        if kind == "sliding_attention":
            check(isinstance(window, int) and window >= 1, "sliding_window", window,
                  "an integer >= 1 when a layer uses sliding attention")
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def _common(cfg: dict[str, Any], architecture: str) -> ModelArch:
    def need(key: str) -> Any:
        if key not in cfg:
            raise ConfigError(f"config.json:{key}", None, f"required for {architecture}")
        return cfg[key]

    num_heads = need("num_attention_heads")
    hidden = need("hidden_size")
    num_layers = need("num_hidden_layers")
    return ModelArch(
        architecture=architecture,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or hidden // num_heads,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rope=_rope(cfg),
        layer_windows=(None,) * num_layers,
        hidden_act=cfg.get("hidden_act", "silu"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        eos_token_ids=_eos(cfg),
        bos_token_id=cfg.get("bos_token_id"),
    )


def _llama(cfg: dict[str, Any]) -> ModelArch:
    base = _common(cfg, "LlamaForCausalLM")
    bias = bool(cfg.get("attention_bias", False))
    return replace(base, qkv_bias=bias, o_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)))


def _qwen2(cfg: dict[str, Any]) -> ModelArch:
    base = _common(cfg, "Qwen2ForCausalLM")
    return replace(base, qkv_bias=True, layer_windows=_layer_windows(cfg, base.num_layers))


def _qwen3(cfg: dict[str, Any]) -> ModelArch:
    base = _common(cfg, "Qwen3ForCausalLM")
    bias = bool(cfg.get("attention_bias", False))
    return replace(base, qkv_bias=bias, o_bias=bias, qk_norm=True,
                   layer_windows=_layer_windows(cfg, base.num_layers))


def _mistral(cfg: dict[str, Any]) -> ModelArch:
    base = _common(cfg, "MistralForCausalLM")
    window = cfg.get("sliding_window")
    return replace(base, layer_windows=(window,) * base.num_layers)


def _gemma2(cfg: dict[str, Any]) -> ModelArch:
    base = _common(cfg, "Gemma2ForCausalLM")
    bias = bool(cfg.get("attention_bias", False))

    def cap(key: str) -> float | None:
        value = cfg.get(key)
        check(value is None or (isinstance(value, int | float) and value > 0), key, value, "a number > 0 or null")
        return None if value is None else float(value)

    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(base.num_layers)]
    return replace(
        base, qkv_bias=bias, o_bias=bias,
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        layer_windows=_layer_windows({**cfg, "layer_types": layer_types}, base.num_layers),
        norm_unit_offset=True, embed_scale=float(base.hidden_size) ** 0.5, sandwich_norms=True,
        attn_scale=float(cfg.get("query_pre_attn_scalar", base.head_dim)) ** -0.5,
        attn_soft_cap=cap("attn_logit_softcapping"), final_soft_cap=cap("final_logit_softcapping"),
    )


def _gemma3(cfg: dict[str, Any]) -> ModelArch:
    num_layers = cfg.get("num_hidden_layers", 1)
    pattern = int(cfg.get("sliding_window_pattern", 6))  # older configs: every pattern-th layer is full
    layer_types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers >= 5: one rope per layer type
        rope = _rope({"rope_parameters": params["full_attention"]})
        local = _rope({"rope_parameters": params.get("sliding_attention") or {"rope_theta": 10000.0}})
    else:
        rope = _rope({**cfg, "rope_theta": cfg.get("rope_theta", 1_000_000.0)})
        local = RopeScaling(theta=float(cfg.get("rope_local_base_freq", 10000.0)))
    gemma = _gemma2({**cfg, "layer_types": layer_types, "attn_logit_softcapping": cfg.get("attn_logit_softcapping"),
                     "final_logit_softcapping": cfg.get("final_logit_softcapping")})
    return replace(gemma, architecture="Gemma3ForCausalLM", qk_norm=True, rope=rope, local_rope=local)


def _gpt_oss(cfg: dict[str, Any]) -> ModelArch:
    base = _common(cfg, "GptOssForCausalLM")
    # The released checkpoints store experts in MXFP4 blocks: workers/quant reads them.
    bias = bool(cfg.get("attention_bias", True))
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(base.num_layers)]
    experts = SwigluExperts(
        num_experts=cfg.get("num_local_experts", cfg.get("num_experts")),
        top_k=cfg.get("num_experts_per_tok"),
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
    )
    return replace(base, qkv_bias=bias, o_bias=bias, attn_sinks=True, experts=experts,
                   rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                   layer_windows=_layer_windows({**cfg, "layer_types": layer_types}, base.num_layers))


def _deepseek(cfg: dict[str, Any], architecture: str, *, v3: bool) -> ModelArch:
    base = _common(deepseek_generic_config(cfg, v3=v3), architecture)
    return replace(base, deepseek=parse_deepseek(cfg, v3=v3))


def _deepseek_v2(cfg: dict[str, Any]) -> ModelArch:
    return _deepseek(cfg, "DeepseekV2ForCausalLM", v3=False)


def _deepseek_v3(cfg: dict[str, Any]) -> ModelArch:
    return _deepseek(cfg, "DeepseekV3ForCausalLM", v3=True)


def _deepseek_v32(cfg: dict[str, Any]) -> ModelArch:
    """DeepSeek-V3.2: V3 plus the lightning indexer of sparse MLA (index_topk, index_n_heads, index_head_dim)."""
    check(cfg.get("index_topk") is not None, "config.json:index_topk", None,
          "an integer >= 1 for DeepseekV32ForCausalLM (the sparse MLA top-k)")  # fmt: skip
    return _deepseek(cfg, "DeepseekV32ForCausalLM", v3=True)


# `architectures[0]` in config.json -> parser. The transformer is the same for the first four;
# DeepSeek (MLA attention, MoE) is built by models/deepseek.py (see models.model_class).
ARCHITECTURES: dict[str, Callable[[dict[str, Any]], ModelArch]] = {
    "LlamaForCausalLM": _llama,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "MistralForCausalLM": _mistral,
    "Gemma2ForCausalLM": _gemma2,
    "Gemma3ForCausalLM": _gemma3,
    "GptOssForCausalLM": _gpt_oss,
    "DeepseekV2ForCausalLM": _deepseek_v2,
    "DeepseekV3ForCausalLM": _deepseek_v3,
    "DeepseekV32ForCausalLM": _deepseek_v32,
}


def arch_from_hf_config(cfg: dict[str, Any]) -> ModelArch:
    """Parse an HF config.json dict; unknown architectures are refused naming the supported ones."""
    names = cfg.get("architectures") or []
    check(len(names) >= 1, "config.json:architectures", names, f"a list naming one of {sorted(ARCHITECTURES)}")
    name = names[0]
    check(name in ARCHITECTURES, "config.json:architectures", name, f"one of {sorted(ARCHITECTURES)}")
    parse_quantization_config(cfg)  # an unknown quant_method fails here, before any weight is read
    return ARCHITECTURES[name](cfg)
