"""DeepSeek-V2 / V3 / V3.2 as architecture data: MLA dimensions (V3.2: its lightning indexer), YaRN
rope, MoE routing, dense first layers.

`parse_deepseek` turns an HF config.json into the `DeepseekArch` record that a `ModelArch`'s
`deepseek` field carries (what the generic record has no place for); arch.py builds the generic
part from `deepseek_generic_config`. The model itself is `deepseek.DeepseekForCausalLM`; it
reads only these records.

Differences between the two, as HF transformers implements them:
  V2: softmax router scores; top-k "greedy" or "group_limited_greedy" (groups ranked by their
      best expert); no bias, no renormalisation; rope always on interleaved pairs.
  V3: sigmoid router scores plus a per-expert correction bias for the choice only; groups ranked
      by the sum of their two best experts; weights renormalised (norm_topk_prob); rope on
      interleaved pairs unless rope_interleave is false.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshserve.attention.mla.spec import deepseek_softmax_scale
from meshserve.attention.spec import IndexerDims, MLADims
from meshserve.errors import ConfigError, check


@dataclass(frozen=True)
class YarnRope:
    """Rotary embedding of the rope part of q and k (qk_rope_head_dim wide).

    kind "default" or "yarn". attention_factor scales cos and sin (YaRN's "mscale"), None = derived
    from factor, mscale and mscale_all_dim as the YaRN paper does. interleaved: rotate pairs
    (x0, x1), (x2, x3), ... rather than the two halves.
    """

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    interleaved: bool = True

    def __post_init__(self) -> None:
        check(self.kind in ("default", "yarn"), "rope_type", self.kind, "'default' or 'yarn' for DeepSeek models")
        check(self.theta > 0, "rope_theta", self.theta, "a number > 0")
        if self.kind == "yarn":
            check(self.factor > 0, "rope factor", self.factor, "a number > 0")
            check(self.original_max_position_embeddings is not None, "original_max_position_embeddings", None,
                  "an integer >= 1 for yarn rope scaling")  # fmt: skip


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts plus always-on shared experts, on every layer from first_k_dense_replace on."""

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    num_shared_experts: int
    num_groups: int
    topk_groups: int
    routed_scaling_factor: float
    scoring: str  # "softmax" (V2) or "sigmoid" (V3)
    group_by: str  # "none" (plain top-k), "max" (V2 group_limited_greedy) or "top2_sum" (V3)
    norm_topk_prob: bool
    correction_bias: bool  # V3: e_score_correction_bias shifts the choice, not the weights
    first_k_dense_replace: int

    def __post_init__(self) -> None:
        check(self.num_experts >= 1, "n_routed_experts", self.num_experts, "an integer >= 1")
        check(1 <= self.top_k <= self.num_experts, "num_experts_per_tok", self.top_k,
              f"an integer in [1, n_routed_experts={self.num_experts}]")  # fmt: skip
        check(self.num_groups >= 1 and self.num_experts % self.num_groups == 0, "n_group", self.num_groups,
              f"a divisor of n_routed_experts={self.num_experts}")  # fmt: skip
        if self.group_by != "none":
            check(1 <= self.topk_groups <= self.num_groups, "topk_group", self.topk_groups,
                  f"an integer in [1, n_group={self.num_groups}]")  # fmt: skip
            per_group = self.num_experts // self.num_groups
            check(self.topk_groups * per_group >= self.top_k, "topk_group", self.topk_groups,
                  f"enough groups to hold num_experts_per_tok={self.top_k} experts ({per_group} per group)")
        check(self.first_k_dense_replace >= 0, "first_k_dense_replace", self.first_k_dense_replace,
              "an integer >= 0")  # fmt: skip


@dataclass(frozen=True)
class DeepseekArch:
    mla: MLADims
    rope: YarnRope
    moe: MoEConfig
    softmax_scale: float  # 1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN
    attention_bias: bool = False  # biases on q_a_proj, kv_a_proj_with_mqa and o_proj
    # V3/R1 releases append multi-token-prediction layers (model.layers.<num_hidden_layers>...):
    # weights for speculative decoding, which the model here does not run (the loader skips them).
    num_mtp_layers: int = 0


def _rope(cfg: dict[str, Any], interleaved: bool) -> tuple[YarnRope, dict[str, Any]]:
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    kind = str(params.get("rope_type", params.get("type", "default")))

    def num(key: str) -> float | None:
        return None if params.get(key) is None else float(params[key])

    rope = YarnRope(
        theta=float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        kind=kind,
        factor=float(params.get("factor") or 1.0),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=num("mscale"),
        mscale_all_dim=num("mscale_all_dim"),
        attention_factor=num("attention_factor"),
        truncate=bool(params.get("truncate", True)),
        interleaved=interleaved,
    )
    return rope, params


def _dims(cfg: dict[str, Any]) -> MLADims:
    def need(key: str) -> Any:
        if cfg.get(key) is None:
            raise ConfigError(f"config.json:{key}", None, "required for DeepSeek (MLA) models")
        return cfg[key]

    return MLADims(kv_lora_rank=need("kv_lora_rank"), qk_nope_head_dim=need("qk_nope_head_dim"),
                   qk_rope_head_dim=need("qk_rope_head_dim"), v_head_dim=need("v_head_dim"),
                   q_lora_rank=cfg.get("q_lora_rank"), indexer=_indexer(cfg))  # fmt: skip


def _indexer(cfg: dict[str, Any]) -> IndexerDims | None:
    """DeepSeek-V3.2's lightning indexer, switched on by `index_topk` (sparse MLA); None: dense MLA."""
    if cfg.get("index_topk") is None:
        return None
    for key in ("index_n_heads", "index_head_dim"):
        if cfg.get(key) is None:
            raise ConfigError(f"config.json:{key}", None, "an integer >= 1 when index_topk is set (sparse MLA)")
    check(cfg.get("q_lora_rank") is not None, "config.json:q_lora_rank", None,
          "an integer >= 1 when index_topk is set: the indexer's queries come from the q LoRA")  # fmt: skip
    return IndexerDims(num_heads=cfg["index_n_heads"], head_dim=cfg["index_head_dim"], topk=cfg["index_topk"])


def _moe(cfg: dict[str, Any], *, v3: bool) -> MoEConfig:
    if v3:
        scoring, group_by = "sigmoid", "top2_sum"
    else:
        method = cfg.get("topk_method", "greedy")
        check(method in ("greedy", "group_limited_greedy"), "topk_method", method,
              "'greedy' or 'group_limited_greedy' for DeepSeek-V2")  # fmt: skip
        scoring, group_by = "softmax", ("none" if method == "greedy" else "max")
    return MoEConfig(
        num_experts=int(cfg.get("n_routed_experts") or 1),
        top_k=int(cfg.get("num_experts_per_tok") or 1),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        num_shared_experts=int(cfg.get("n_shared_experts") or 0),
        num_groups=int(cfg.get("n_group") or 1),
        topk_groups=int(cfg.get("topk_group") or 1),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        scoring=scoring,
        group_by=group_by,
        # HF's V2 router never renormalises (the released V2 checkpoints set it false anyway).
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)) if v3 else False,
        correction_bias=v3,
        first_k_dense_replace=int(cfg.get("first_k_dense_replace", 0)),
    )


def _interleaved(cfg: dict[str, Any], v3: bool) -> bool:
    return bool(cfg.get("rope_interleave", True)) if v3 else True


def deepseek_generic_config(cfg: dict[str, Any], *, v3: bool) -> dict[str, Any]:
    """`cfg` as the generic parser (arch.py) reads it for a DeepSeek model.

    num_key_value_heads in DeepSeek configs is a formality: MLA caches one latent per token.
    The generic rope record stays at its default: YarnRope is the one the model reads.
    """
    dims = _dims(cfg)
    rope, _ = _rope(cfg, interleaved=_interleaved(cfg, v3))
    return {**cfg, "head_dim": dims.qk_head_dim, "num_key_value_heads": 1, "rope_parameters": None,
            "rope_scaling": None, "rope_theta": rope.theta}  # fmt: skip


def parse_deepseek(cfg: dict[str, Any], *, v3: bool) -> DeepseekArch:
    """What a DeepSeek-V2 (v3=False) or V3 model needs beyond the generic record."""
    dims = _dims(cfg)
    rope, params = _rope(cfg, interleaved=_interleaved(cfg, v3))
    return DeepseekArch(mla=dims, rope=rope, moe=_moe(cfg, v3=v3),
                        softmax_scale=deepseek_softmax_scale(dims, params),
                        attention_bias=bool(cfg.get("attention_bias", False)),
                        num_mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0))  # fmt: skip
