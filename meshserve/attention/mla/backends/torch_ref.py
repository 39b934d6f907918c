"""TORCH MLA: the reference. Expands the latent to per-head K/V exactly as HF does, then attends.

Serves both phases (it sits in the decode and the prefill tables). One sequence at a time, in
float32, through the standard reference's `attend`, so masks and DCP positions follow the same
rules as every other layer: the oracle the other MLA backends are tested against.
"""

from __future__ import annotations

import torch

from meshserve.attention.backend import BackendCapabilities, LayerParams
from meshserve.attention.backends.torch_ref import attend
from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.mla.backend import MLABackend, MLAWeights
from meshserve.attention.mla.cache import LatentCache, gather_latent
from meshserve.attention.spec import AttentionSpec, AttentionType, KVCacheDtype

MLA_REFERENCE_CAPABILITIES = BackendCapabilities(
    dtypes=frozenset({"float32", "float16", "bfloat16"}),
    kv_cache_dtypes=frozenset(KVCacheDtype),
    min_block_size=1,
    max_block_size=1 << 20,
    naive_layout=True,
    paged_layout=True,
    min_head_size=1,
    max_head_size=1024,
    head_size_multiple=1,
    attention_types=frozenset({AttentionType.DECODER}),
    sliding_window=False,
    learned_sinks=False,
    sink_tokens=False,
    alibi=False,
    soft_cap=False,
    mla=True,
    returns_lse=True,
    dcp=True,
    devices=frozenset({"cpu", "cuda"}),
    notes="reference: expands the latent to per-head K/V (as HF), float32, one sequence at a time",
)


class TorchMLABackend(MLABackend):
    name = "TORCH"
    capabilities = MLA_REFERENCE_CAPABILITIES

    def forward(
        self,
        query: torch.Tensor,
        cache: LatentCache,
        plan: object,
        weights: MLAWeights,
        *,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        meta: AttentionMetadata = plan
        self._check_inputs(query, weights, meta.num_tokens)
        heads, dims = self.spec.num_heads, self.dims
        # The expanded layer: every head has its own K/V (no sharing left after expansion).
        expanded = AttentionSpec(
            num_heads=heads, num_kv_heads=heads, head_size=dims.qk_head_dim, head_size_v=dims.v_head_dim,
            scale=self.spec.softmax_scale,
        )  # fmt: skip
        w32 = MLAWeights(weights.w_uk.float(), weights.w_uv.float())
        out = torch.zeros(query.shape[0], heads, dims.v_head_dim, dtype=torch.float32, device=query.device)
        lse = torch.full((query.shape[0], heads), float("-inf"), dtype=torch.float32, device=query.device)
        starts = meta.query_start_loc.tolist()
        for s, seq_len in enumerate(meta.seq_lens_host):
            q0, q1 = starts[s], starts[s + 1]
            latent, k_pe = gather_latent(cache, meta.block_table[s], meta.local_len(seq_len))
            k_nope, v = w32.expand(latent)
            k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, heads, -1)], dim=-1)
            q_pos = torch.arange(seq_len - (q1 - q0), seq_len, device=query.device)
            # Under DCP this rank holds every dcp_size-th token, starting at dcp_rank.
            k_pos = torch.arange(k.shape[0], device=query.device) * meta.dcp_size + meta.dcp_rank
            out[q0:q1], lse[q0:q1] = attend(expanded, query[q0:q1], k, v, q_pos, k_pos, LayerParams())
        out = out.to(query.dtype)
        return (out, lse) if return_lse else out
