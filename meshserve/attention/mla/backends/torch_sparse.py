"""TORCH sparse MLA: the reference. Gathers each token's chosen latent rows, expands them per head
(as HF does for dense MLA), and attends in float32. The oracle TRITON's sparse kernel is tested
against; it serves any device, in chunks of tokens so that the expanded rows stay bounded
(EXPANDED_BUDGET).
"""

from __future__ import annotations

import dataclasses

import torch

from meshserve.attention.mla.backend import MLAWeights
from meshserve.attention.mla.backends.torch_ref import MLA_REFERENCE_CAPABILITIES
from meshserve.attention.mla.cache import LatentCache
from meshserve.attention.mla.sparse import Output, SparseMLABackend, SparsePlan, row_slots

EXPANDED_BUDGET = 1 << 26  # float32 values of expanded K (and of V) held at once: 256 MiB each


class TorchSparseMLABackend(SparseMLABackend):
    name = "TORCH"
    capabilities = dataclasses.replace(
        MLA_REFERENCE_CAPABILITIES,
        sparse_mla=True,
        notes="reference: gathers each token's chosen latent rows, expands them per head (as HF), float32",
    )

    def attend_rows(self, query: torch.Tensor, cache: LatentCache, plan: SparsePlan, weights: MLAWeights,
                    rows: torch.Tensor, *, return_lse: bool) -> Output:  # fmt: skip
        dims, heads = self.dims, self.spec.num_heads
        dn, r = dims.qk_nope_head_dim, dims.kv_lora_rank
        w_uk, w_uv = weights.w_uk.float(), weights.w_uv.float()
        flat = cache.data.view(-1, cache.data.shape[2])
        slots, used = row_slots(plan, rows, cache.block_size)
        out = torch.zeros(query.shape[0], heads, dims.v_head_dim, dtype=torch.float32, device=query.device)
        lse = torch.full((query.shape[0], heads), float("-inf"), dtype=torch.float32, device=query.device)
        step = max(1, EXPANDED_BUDGET // (rows.shape[1] * heads * max(dn, dims.v_head_dim)))
        for t0 in range(0, query.shape[0], step):
            t1 = min(t0 + step, query.shape[0])
            chosen = flat[slots[t0:t1]].float()  # [t, k, R + P]
            if cache.is_fp8:
                chosen = chosen * cache.scale.float()
            k_nope = torch.einsum("tkr,hdr->tkhd", chosen[..., :r], w_uk)
            v = torch.einsum("tkr,hdr->tkhd", chosen[..., :r], w_uv)
            q = query[t0:t1].float()
            logits = torch.einsum("thd,tkhd->thk", q[..., :dn], k_nope)
            logits = (logits + torch.einsum("thp,tkp->thk", q[..., dn:], chosen[..., r:])) * self.spec.softmax_scale
            logits = logits.masked_fill(~used[t0:t1, None, :], float("-inf"))
            part_lse = torch.logsumexp(logits, dim=-1)  # [t, H]; -inf where no row is chosen
            prob = torch.exp(logits - part_lse.masked_fill(torch.isneginf(part_lse), 0)[..., None])
            out[t0:t1] = torch.einsum("thk,tkhd->thd", prob, v)
            lse[t0:t1] = part_lse
        out = out.to(query.dtype)
        return (out, lse) if return_lse else out
