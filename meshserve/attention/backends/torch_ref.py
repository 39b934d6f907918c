"""TORCH: the reference backend. Every feature, any device; the oracle other backends match.

Clarity over speed: one sequence at a time, scores materialised in float32, masks built from
absolute positions exactly as AttentionSpec's docstring states them.
"""

from __future__ import annotations

import torch

from meshserve.attention.backend import (
    FP8_DTYPES,
    AttentionBackend,
    BackendCapabilities,
    KVCache,
    LayerParams,
)
from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.spec import AttentionSpec, AttentionType, KVCacheDtype
from meshserve.core.arith import cdiv


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Store x / scale as `dtype`, saturating at the format's largest finite value."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale.float()).clamp(-limit, limit).to(dtype)


def scatter_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
    """Store key/value [T, Hkv, D] at `slot_mapping` [T] (-1 skips), quantised for an FP8 cache."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    bs = kv_cache.block_size
    blocks, offsets = slots // bs, slots % bs
    k, v = key[keep], value[keep]
    if kv_cache.is_fp8:
        k = quantize_fp8(k, kv_cache.k_scale, kv_cache.data.dtype)
        v = quantize_fp8(v, kv_cache.v_scale, kv_cache.data.dtype)
    kv_cache.data[blocks, 0, offsets] = k.to(kv_cache.data.dtype)
    kv_cache.data[blocks, 1, offsets] = v.to(kv_cache.data.dtype)


def gather_kv(kv_cache: KVCache, block_row: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first `seq_len` cached keys and values, dequantised to float32.

    block_row: [max_blocks] int32 physical block ids. Returns two [seq_len, num_kv_heads, D].
    """
    bs = kv_cache.block_size
    num_blocks = cdiv(seq_len, bs)
    blocks = kv_cache.data[block_row[:num_blocks].long()]  # [nb, 2, bs, Hkv, D]
    k = blocks[:, 0].reshape(num_blocks * bs, *blocks.shape[3:])[:seq_len].float()
    v = blocks[:, 1].reshape(num_blocks * bs, *blocks.shape[3:])[:seq_len].float()
    if kv_cache.is_fp8:
        k = k * kv_cache.k_scale.float()
        v = v * kv_cache.v_scale.float()
    return k, v


def visibility_mask(spec: AttentionSpec, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """[Lq, Lk] bool: which keys each query may attend to."""
    qp, kp = q_pos[:, None], k_pos[None, :]
    if not spec.is_causal:
        return torch.ones(qp.shape[0], kp.shape[1], dtype=torch.bool, device=q_pos.device)
    mask = kp <= qp
    if spec.sliding_window is not None:
        in_window = (qp - kp) < spec.sliding_window
        if spec.num_sink_tokens:
            in_window = in_window | (kp < spec.num_sink_tokens)
        mask = mask & in_window
    return mask


def attend(
    spec: AttentionSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    layer: LayerParams,
    *,
    with_sinks: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of one sequence in float32.

    q: [Lq, H, D], k: [Lk, Hkv, D], v: [Lk, Hkv, Dv]. Returns o [Lq, H, Dv], lse [Lq, H].
    with_sinks=False leaves learned sinks out (DCP ranks other than 0).
    """
    use_sinks = spec.has_sinks and with_sinks
    group = spec.num_queries_per_kv
    k = k.repeat_interleave(group, dim=1)  # [Lk, H, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * spec.softmax_scale  # [H, Lq, Lk]
    if spec.logits_soft_cap is not None:
        cap = spec.logits_soft_cap
        scores = cap * torch.tanh(scores / cap)
    if spec.use_alibi:
        rel = (k_pos[None, :] - q_pos[:, None]).float()  # [Lq, Lk]
        scores = scores + layer.alibi_slopes.float()[:, None, None] * rel
    mask = visibility_mask(spec, q_pos, k_pos)
    scores = scores.masked_fill(~mask, float("-inf"))
    if use_sinks:
        sink = layer.sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
        scores = torch.cat([scores, sink], dim=-1)  # the sink joins the denominator only
    lse = torch.logsumexp(scores, dim=-1)  # [H, Lq]; -inf where nothing is visible
    probs = torch.exp(scores - lse[..., None].clamp(min=torch.finfo(torch.float32).min))
    probs = torch.nan_to_num(probs, nan=0.0)
    if use_sinks:
        probs = probs[..., :-1]
    o = torch.einsum("hqk,khd->qhd", probs, v.float())
    return o, lse.transpose(0, 1).contiguous()


class TorchBackend(AttentionBackend):
    name = "TORCH"
    capabilities = BackendCapabilities(
        dtypes=frozenset({"float32", "float16", "bfloat16"}),
        kv_cache_dtypes=frozenset(KVCacheDtype),
        min_block_size=1,
        max_block_size=1 << 20,
        naive_layout=True,
        paged_layout=True,
        min_head_size=1,
        max_head_size=1024,
        head_size_multiple=1,
        attention_types=frozenset(AttentionType),
        sliding_window=True,
        learned_sinks=True,
        sink_tokens=True,
        alibi=True,
        soft_cap=True,
        mla=False,
        returns_lse=True,
        dcp=True,
        devices=frozenset({"cpu", "cuda"}),
        notes="reference: one sequence at a time, float32 math; the oracle for every test",
    )

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor, *,
        plan: object | None = None,
    ) -> None:
        scatter_kv(key, value, kv_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: KVCache | None,
        plan: object,
        *,
        layer: LayerParams = LayerParams(),
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        meta: AttentionMetadata = plan  # the reference needs nothing beyond the metadata
        spec = self.spec
        num_tokens = query.shape[0]
        out = torch.zeros(num_tokens, spec.num_heads, spec.v_size, dtype=torch.float32, device=query.device)
        lse = torch.full(
            (num_tokens, spec.num_heads), float("-inf"), dtype=torch.float32, device=query.device
        )
        starts = meta.query_start_loc.tolist()
        for s, seq_len in enumerate(meta.seq_lens_host):
            q0, q1 = starts[s], starts[s + 1]
            context_len = seq_len - (q1 - q0)
            if spec.attn_type is AttentionType.CROSS:
                k, v = gather_kv(kv_cache, meta.encoder_block_table[s], meta.encoder_seq_lens_host[s])
            elif spec.uses_kv_cache:
                k, v = gather_kv(kv_cache, meta.block_table[s], meta.local_len(seq_len))
            else:
                k, v = key[q0:q1].float(), value[q0:q1].float()
            device = query.device
            q_pos = torch.arange(context_len, seq_len, device=device)
            # Under DCP this rank holds every dcp_size-th token, starting at dcp_rank.
            k_pos = torch.arange(k.shape[0], device=device) * meta.dcp_size + meta.dcp_rank
            out[q0:q1], lse[q0:q1] = attend(spec, query[q0:q1], k, v, q_pos, k_pos, layer,
                                            with_sinks=meta.dcp_rank == 0)
        out = out.to(query.dtype)
        return (out, lse) if return_lse else out


__all__ = ["TorchBackend", "quantize_fp8", "scatter_kv", "gather_kv", "attend", "FP8_DTYPES"]
