"""An MLA layer's attention seen through DCP (the main use of DCP: the latent cache has one head).

Without DCP the tp ranks would each cache every token's latent (one "KV head" cannot be split).
With DCP the dcp ranks of a group cache every dcp-th token each; per layer a rank gathers the
group's query heads, attends over its own tokens returning the LSE (MLA backends take global
positions with `metadata.dcp_size/dcp_rank`), and the partial outputs merge by LSE back to each
rank's heads. W_UV is linear, so merging after it (128 values per head, not 512) is exact.
Sparse MLA (DeepSeek-V3.2) adds one step: each rank scores the tokens it stores, and the ranks'
top-k lists, all-gathered, merge into the group's top-k before anyone attends.
"""

from __future__ import annotations

import torch

from meshserve.attention.mla.backend import MLAWeights
from meshserve.attention.mla.cache import LatentCache
from meshserve.attention.mla.indexer import TopK, merge_candidates
from meshserve.attention.mla.layer import MLAAttention
from meshserve.attention.mla.sparse_layer import SparseMLAAttention
from meshserve.config import DcpComm
from meshserve.errors import check
from meshserve.parallel.dcp import gather_queries, merge_outputs
from meshserve.parallel.groups import ParallelContext, all_gather


class DcpMLAAttention:
    """Same plan and write_kv as the wrapped MLAAttention; forward over this rank's token shard."""

    def __init__(self, attention: MLAAttention, ctx: ParallelContext, comm: DcpComm) -> None:
        self.inner = attention
        self.ctx = ctx
        self.comm = comm
        self.name = attention.name

    def plan(self, metadata):
        return self.inner.plan(metadata)

    def write_kv(self, latent: torch.Tensor, k_pe: torch.Tensor, cache: LatentCache, plan) -> None:
        self.inner.write_kv(latent, k_pe, cache, plan)

    def forward(self, query: torch.Tensor, cache: LatentCache, plan, weights: MLAWeights, *,
                return_lse: bool = False) -> torch.Tensor:  # fmt: skip
        """query [T, H_local, nope + rope] -> o [T, H_local, v]; weights: the whole group's heads."""
        check(not return_lse, "return_lse", return_lse, "False under DCP (the merged LSE is not kept)")
        q_group = gather_queries(query, self.ctx)  # [T, dcp * H_local, nope + rope]
        out, lse = self.inner.forward(q_group, cache, plan, weights, return_lse=True)
        return merge_outputs(out, lse, self.ctx, self.comm)


class DcpSparseMLAAttention(DcpMLAAttention):
    """Sparse MLA over this rank's token shard: the ranks' top-k candidates merge exactly into the
    group's top-k (every rank then attends to the chosen rows it stores), then outputs merge by LSE.
    Same plan and write_kv as the wrapped SparseMLAAttention."""

    inner: SparseMLAAttention

    def index(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, cache: LatentCache,
              plan) -> torch.Tensor:  # fmt: skip
        """Rows [T, k] of this rank's cache among the group's top-k (-1 elsewhere)."""
        mine = self.inner.candidates(q, weights, keys, cache, plan)  # over the tokens this rank stores
        # The group's top-k lies inside the union of the ranks' top-k lists: merging them is exact.
        every = TopK(all_gather(mine.scores, self.ctx, dim=1, group_kind="dcp"),
                     all_gather(mine.positions, self.ctx, dim=1, group_kind="dcp"))  # fmt: skip
        chosen = merge_candidates([every], self.inner.width(plan))
        return chosen.local_rows(self.ctx.dcp, self.ctx.dcp_rank)

    def forward(self, query: torch.Tensor, cache: LatentCache, plan, weights: MLAWeights, *, rows: torch.Tensor,
                return_lse: bool = False) -> torch.Tensor:  # fmt: skip
        """query [T, H_local, nope + rope] -> o [T, H_local, v]; weights: the whole group's heads."""
        check(not return_lse, "return_lse", return_lse, "False under DCP (the merged LSE is not kept)")
        q_group = gather_queries(query, self.ctx)
        out, lse = self.inner.forward(q_group, cache, plan, weights, rows=rows, return_lse=True)
        return merge_outputs(out, lse, self.ctx, self.comm)
