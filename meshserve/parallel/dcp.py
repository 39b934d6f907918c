"""Decode context parallelism: attention over token shards, merged by log-sum-exp.

Per layer, on each rank of a DCP group (vLLM semantics):
  1. `gather_queries`: all-gather the group's query heads, so every rank holds all of them;
  2. the backend attends over this rank's tokens and returns (o, lse) for those heads;
  3. `merge_outputs` gives each rank the merged output of its own heads:
     - ag_rs: all-gather the LSEs, rescale the local output, reduce-scatter over heads;
     - a2a:   all-to-all the outputs and LSEs so each rank receives every partial of its
              own heads, then merge locally (less traffic when head_size is large).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshserve.attention.backend import AttentionBackend, LayerParams
from meshserve.attention.merge import merge_attn_states_n
from meshserve.config import DcpComm
from meshserve.errors import check
from meshserve.parallel.groups import ParallelContext, all_gather

# torch >= 2.12 names it reduce_scatter_single (the old name warns FutureWarning on every call).
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def gather_queries(q: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """[T, H_local, D] -> [T, dcp * H_local, D]: the query heads of the whole DCP group."""
    return all_gather(q, ctx, dim=1, group_kind="dcp")


def merge_outputs(o: torch.Tensor, lse: torch.Tensor, ctx: ParallelContext,
                  comm: DcpComm = DcpComm.AG_RS) -> torch.Tensor:
    """Merge partial attention over the DCP group's token shards and keep this rank's heads.

    o: [T, dcp * H_local, Dv] (any float dtype), lse: [T, dcp * H_local] float32 natural log,
    both over this rank's tokens for every head of the group. Returns [T, H_local, Dv] in o.dtype.
    """
    dcp = ctx.dcp
    if dcp == 1:
        return o
    tokens, heads, dv = o.shape
    local = heads // dcp
    if comm is DcpComm.AG_RS:
        lses = all_gather(lse, ctx, dim=0, group_kind="dcp").view(dcp, tokens, heads)
        total = torch.logsumexp(lses, dim=0)  # [T, Hg]; -inf where no rank saw a key
        weight = torch.nan_to_num(torch.exp(lse - total), nan=0.0)  # exp(-inf - -inf) = nan -> 0
        scaled = (o.float() * weight[..., None]).view(tokens, dcp, local, dv).transpose(0, 1)
        scaled = scaled.reshape(dcp * tokens, local, dv)  # chunk r = the heads rank r keeps
        out = torch.empty((tokens, local, dv), dtype=torch.float32, device=o.device)
        _reduce_scatter_single(out, scaled, group=ctx.dcp_group)
        return out.to(o.dtype)
    # a2a: chunk r of the send buffer holds the heads that rank r keeps.
    send_o = o.view(tokens, dcp, local, dv).transpose(0, 1).contiguous()  # [dcp, T, Hl, Dv]
    send_lse = lse.view(tokens, dcp, local).transpose(0, 1).contiguous()  # [dcp, T, Hl]
    recv_o, recv_lse = torch.empty_like(send_o), torch.empty_like(send_lse)
    dist.all_to_all_single(recv_o, send_o, group=ctx.dcp_group)
    dist.all_to_all_single(recv_lse, send_lse, group=ctx.dcp_group)
    merged, _ = merge_attn_states_n(recv_o, recv_lse)
    return merged


class DcpAttention:
    """A backend seen through DCP: same plan and write_kv, forward over this rank's token shard.

    forward gathers the DCP group's query heads, attends over the local shard with the LSE, and
    merges across the group (ag_rs or a2a), returning this rank's heads. The wrapped backend
    must declare `capabilities.dcp` (global positions over a sharded cache) — the registry
    refuses it for a DCP problem otherwise.
    """

    fused_kv_write = False  # K/V go through the wrapped backend's write_kv, never a fused model write

    def __init__(self, backend: AttentionBackend, ctx: ParallelContext, comm: DcpComm) -> None:
        self.inner = backend
        self.ctx = ctx
        self.comm = comm
        self.name = backend.name
        self.spec = backend.spec

    def plan(self, metadata):
        return self.inner.plan(metadata)

    def write_kv(self, key, value, kv_cache, slot_mapping, *, plan=None) -> None:
        self.inner.write_kv(key, value, kv_cache, slot_mapping, plan=plan)  # the plan is the inner one

    def forward(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None, kv_cache,
                plan: object, *, layer: LayerParams | None = None, return_lse: bool = False) -> torch.Tensor:
        check(not return_lse, "return_lse", return_lse, "False under DCP (the merged LSE is not kept)")
        q_all = gather_queries(query, self.ctx)  # [T, dcp * H_local, D]
        out, lse = self.inner.forward(q_all, key, value, kv_cache, plan, layer=layer or LayerParams(),
                                      return_lse=True)
        return merge_outputs(out, lse, self.ctx, self.comm)
