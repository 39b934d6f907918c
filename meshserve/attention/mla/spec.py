"""Multi-head latent attention (DeepSeek-V2/V3) as an AttentionSpec, and DeepSeek's softmax scale.

Per token t, with c_t the normalised latent [kv_lora_rank] and k_pe_t the rope key [rope] that
every head shares, head h of MLA computes

    k_nope = W_UK[h] c_t   [qk_nope_head_dim]        v = W_UV[h] c_t   [v_head_dim]
    score  = (q_nope[h] . k_nope + q_pe[h] . k_pe_t) * softmax_scale

so an MLA layer's spec is a decoder layer with num_heads query heads, ONE key/value "head" (the
latent), head_size = qk_nope + qk_rope and head_size_v = v_head_dim. The absorbed form used by
decode kernels folds W_UK into the query: score = (W_UK[h]^T q_nope) . c_t + q_pe . k_pe_t.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from meshserve.attention.spec import AttentionSpec, AttentionType, KVCacheDtype, MLADims


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(factor) + 1 for factor > 1, else 1."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def deepseek_softmax_scale(dims: MLADims, rope_scaling: Mapping[str, object] | None = None) -> float:
    """DeepSeek's scale: 1/sqrt(qk_nope + qk_rope), times mscale(factor, mscale_all_dim)^2 under YaRN.

    rope_scaling: the HF `rope_parameters` / `rope_scaling` dict (keys rope_type or type, factor,
    mscale_all_dim); None or rope_type "default" leaves the plain scale.
    """
    scale = dims.qk_head_dim**-0.5
    if not rope_scaling:
        return scale
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    mscale_all_dim = float(rope_scaling.get("mscale_all_dim", 0) or 0)
    if kind != "default" and mscale_all_dim:
        m = yarn_mscale(float(rope_scaling["factor"]), mscale_all_dim)
        scale *= m * m
    return scale


def mla_spec(
    num_heads: int,
    dims: MLADims,
    *,
    scale: float | None = None,
    kv_cache_dtype: KVCacheDtype | str = KVCacheDtype.AUTO,
) -> AttentionSpec:
    """The AttentionSpec of an MLA layer with `num_heads` query heads (those this rank computes).

    scale: the softmax scale; None gives 1/sqrt(qk_nope + qk_rope) (DeepSeek without YaRN).
    """
    return AttentionSpec(
        num_heads=num_heads,
        num_kv_heads=1,
        head_size=dims.qk_head_dim,
        head_size_v=dims.v_head_dim,
        scale=scale if scale is not None else dims.qk_head_dim**-0.5,
        attn_type=AttentionType.DECODER,
        kv_cache_dtype=kv_cache_dtype,
        mla=dims,
    )


def mla_reasons(spec: AttentionSpec) -> list[str]:
    """Why `spec` is not a consistent MLA layer (empty when it is); MLA backends report these."""
    dims = spec.mla
    if dims is None:
        return ["not an MLA layer (spec.mla is None): MLA backends serve multi-head latent attention only"]
    out = []
    if spec.num_kv_heads != 1:
        out.append(f"num_kv_heads={spec.num_kv_heads}: an MLA layer has one latent KV head")
    if spec.head_size != dims.qk_head_dim:
        out.append(f"head_size={spec.head_size} != qk_nope_head_dim + qk_rope_head_dim = {dims.qk_head_dim}")
    if spec.v_size != dims.v_head_dim:
        out.append(f"head_size_v={spec.v_size} != v_head_dim={dims.v_head_dim}")
    if spec.attn_type is not AttentionType.DECODER:
        out.append(f"attention type '{spec.attn_type}': MLA layers are decoder self-attention")
    return out
