"""An MLA layer's attention seen through DCP (the main use of DCP: the latent cache has one head).

Without DCP the tp ranks would each cache every token's latent (one "KV head" cannot be split).
With DCP the dcp ranks of a group cache every dcp-th token each; per layer a rank gathers the
group's query heads, attends over its own tokens returning the LSE (MLA backends take global
positions with `metadata.dcp_size/dcp_rank`), and the partial outputs merge by LSE back to each
rank's heads. W_UV is linear, so merging after it (128 values per head, not 512) is exact.
"""

from __future__ import annotations

import torch

from meshserve.attention.mla.backend import MLAWeights
from meshserve.attention.mla.cache import LatentCache
from meshserve.attention.mla.layer import MLAAttention
from meshserve.config import DcpComm
from meshserve.errors import check
from meshserve.parallel.dcp import gather_queries, merge_outputs
from meshserve.parallel.groups import ParallelContext


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
