"""Tensor and decode-context parallelism for DeepSeek's attention: a transform of a loaded model.

The model code stays plain (gpt-fast style); this transform, applied once to a model holding
the checkpoint's full weights, makes its attention one rank's share of a tp-way replica:
- query heads split over the tp ranks: q_proj / q_b_proj keep the rows of this rank's heads,
  o_proj keeps their input columns and sums the ranks' products (RowParallelLinear);
- the latent cache has one "head", so without DCP every rank would hold all of it. With DCP the
  dcp consecutive ranks of a group hold every dcp-th token each: a rank gathers its group's
  query heads, attends over its own tokens returning the LSE, and the partial outputs merge
  by LSE (parallel/dcp.py) back to each rank's heads. kv_b_proj keeps the group's heads.
The MLP, MoE, embeddings and LM head stay whole on every rank (each computes them in full, the
same on all ranks): sharding those is the engine's tensor parallelism, not MLA's.
"""

from __future__ import annotations

import types

import torch

from meshserve.attention.mla.backend import MLAWeights
from meshserve.config import DcpComm
from meshserve.errors import check
from meshserve.parallel.dcp import gather_queries, merge_outputs
from meshserve.parallel.groups import ParallelContext
from meshserve.parallel.layers import RowParallelLinear
from meshserve.workers.models.transformer import LayerAttention


def _keep_rows(linear: torch.nn.Linear, start: int, rows: int) -> None:
    linear.weight = torch.nn.Parameter(linear.weight.data[start : start + rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias.data[start : start + rows].clone(), requires_grad=False)
    linear.out_features = rows


def parallelize_deepseek(model: torch.nn.Module, ctx: ParallelContext, *, comm: DcpComm = DcpComm.AG_RS) -> None:
    """Shard `model`'s attention for rank ctx.rank of a (tp, dcp) replica, in place."""
    arch = model.arch
    heads = arch.num_heads
    check(heads % ctx.tp == 0, "tp", ctx.tp, f"a divisor of num_attention_heads={heads}")
    local = heads // ctx.tp
    group = local * ctx.dcp  # heads a rank attends for: its whole DCP group's
    first_local, first_group = ctx.rank * local, ctx.kv_group_index * group
    for layer in model.model.layers:
        attn = layer.self_attn
        dims = attn.dims
        q_proj = attn.q_proj if dims.q_lora_rank is None else attn.q_b_proj
        _keep_rows(q_proj, first_local * dims.qk_head_dim, local * dims.qk_head_dim)
        per_head = dims.qk_nope_head_dim + dims.v_head_dim
        _keep_rows(attn.kv_b_proj, first_group * per_head, group * per_head)
        dv = dims.v_head_dim
        full = attn.o_proj
        o_proj = RowParallelLinear(local * dv, full.out_features, bias=full.bias is not None, ctx=ctx)
        o_proj.weight.data = full.weight.data[:, first_local * dv : (first_local + local) * dv].clone()
        if full.bias is not None:
            o_proj.bias.data = full.bias.data.clone()
        attn.o_proj = o_proj
        attn.num_heads, attn.attn_heads = local, group
        if ctx.dcp > 1:
            attn.attend = types.MethodType(_dcp_attend(ctx, comm), attn)


def _dcp_attend(ctx: ParallelContext, comm: DcpComm):
    def attend(self, q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
               layer: LayerAttention) -> torch.Tensor:  # fmt: skip
        """q [T, local heads, nope + rope] -> o [T, local heads, v], over the group's token shards."""
        q_group = gather_queries(q, ctx)  # [T, group heads, nope + rope]
        # The step's slot mapping (built with this rank's dcp_rank) writes only this rank's tokens.
        layer.backend.write_kv(latent, k_pe, layer.kv_cache, layer.plan)
        weights = MLAWeights.from_kv_b_proj(self.kv_b_proj.weight, self.attn_heads, self.dims)
        o, lse = layer.backend.forward(q_group, layer.kv_cache, layer.plan, weights, return_lse=True)
        return merge_outputs(o, lse, ctx, comm)

    return attend
