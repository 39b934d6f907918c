"""Tensor parallelism for DeepSeek models: a transform of the meta-device model, before loading.

The model code stays plain (gpt-fast style). For rank ctx.rank of a tp-way replica:
- attention: query heads split over ranks (q_proj / q_b_proj keep this rank's heads' rows,
  o_proj keeps their input columns and sums over ranks; MLA's stacked q_kv_a_proj holds this
  rank's q_proj rows then the whole kv_a_proj_with_mqa, or the whole q_a_proj with a q LoRA).
  The latent cache has one "head": without DCP every rank caches all of it; with DCP the dcp
  ranks of a group cache every dcp-th token each, and a rank attends for its whole group's
  query heads (gathered by the worker's DCP wrapper) over its tokens, so kv_b_proj keeps the
  group's heads (Split.DCP_GROUP);
- dense MLP and every expert (routed and shared): intermediate features split, partial products
  summed by one all-reduce per layer (after the routed and shared experts together); under --ep
  a rank keeps its E/ep routed experts, each split tp/ep ways (expert_parallel.py);
- embeddings and LM head split over the vocabulary; router, norms and latent projections whole.
The loader then fills each parameter with this rank's slice (workers/sharding.py).
"""

from __future__ import annotations

import torch
from torch import nn

from meshserve.errors import check
from meshserve.parallel.groups import ParallelContext, all_reduce
from meshserve.parallel.layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from meshserve.workers.models.expert_parallel import shard_experts_for
from meshserve.workers.models.moe import GatedMLP, MoE


def _shard_mlp(mlp: GatedMLP, tp: int, ctx: ParallelContext | None) -> None:
    """Split the intermediate features; ctx given: the down projection all-reduces itself."""
    hidden, inter = mlp.gate_up_proj.in_features, mlp.intermediate_size
    check(inter % tp == 0, "tp", tp, f"a divisor of the MLP intermediate size {inter}")
    mlp.intermediate_size = inter // tp
    mlp.gate_up_proj = nn.Linear(hidden, 2 * (inter // tp), bias=False)  # this rank's gate rows, then its up rows
    if ctx is None:
        mlp.down_proj = nn.Linear(inter // tp, hidden, bias=False)  # partial: the MoE sums once
    else:
        mlp.down_proj = RowParallelLinear(inter // tp, hidden, bias=False, ctx=ctx)


def _shard_moe(moe: MoE, ctx: ParallelContext) -> None:
    """Routed experts: this rank's E/ep of them (all without --ep), features split tp/ep ways;
    shared experts: features split tp/ep ways too; one all-reduce sums the layer."""
    shard = shard_experts_for(ctx, len(moe.experts))
    if shard is not None:
        moe.experts = nn.ModuleList(moe.experts[shard.first : shard.first + shard.num_local])
        moe.expert_load = torch.zeros(shard.num_local, dtype=torch.int64)
        moe.expert_shard = shard
    for expert in moe.experts:
        _shard_mlp(expert, ctx.expert_tp, None)
    if moe.shared_experts is not None:
        _shard_mlp(moe.shared_experts, ctx.expert_tp, None)
    moe.sum_in_norm = False  # the all-reduce hook reads the summed output
    moe.register_forward_hook(lambda module, args, out: all_reduce(out, ctx))


def apply_deepseek_tensor_parallel(model: nn.Module, ctx: ParallelContext) -> None:
    """Reshape a meta-device DeepseekForCausalLM in place for rank ctx.rank of ctx.tp."""
    if ctx.tp == 1:
        return
    arch, tp = model.arch, ctx.tp
    hidden, ds = arch.hidden_size, arch.deepseek
    dims = ds.mla
    check(arch.num_heads % tp == 0, "tp", tp, f"a divisor of num_attention_heads={arch.num_heads}")
    local = arch.num_heads // tp
    group = local * ctx.dcp
    body = model.model
    body.embed_tokens = VocabParallelEmbedding(arch.vocab_size, hidden, ctx=ctx)
    for layer in body.layers:
        attn = layer.self_attn
        if dims.q_lora_rank is None:
            if attn.q_kv_a_proj is None:
                attn.q_proj = nn.Linear(hidden, local * dims.qk_head_dim, bias=False)
            else:  # this rank's q_proj rows, then the whole kv_a_proj_with_mqa
                attn.q_kv_a_proj = nn.Linear(hidden, local * dims.qk_head_dim + dims.latent_size, bias=False)
        else:
            attn.q_b_proj = nn.Linear(dims.q_lora_rank, local * dims.qk_head_dim, bias=False)
        attn.kv_b_proj = nn.Linear(dims.kv_lora_rank, group * (dims.qk_nope_head_dim + dims.v_head_dim), bias=False)
        attn.o_proj = RowParallelLinear(local * dims.v_head_dim, hidden, bias=ds.attention_bias, ctx=ctx)
        attn.num_heads, attn.attn_heads = local, group
        if isinstance(layer.mlp, MoE):
            _shard_moe(layer.mlp, ctx)
        else:
            _shard_mlp(layer.mlp, tp, ctx)
    model.lm_head = ParallelLMHead(arch.vocab_size, hidden, ctx=ctx)
