"""Tensor parallelism as a transform of the plain model (gpt-fast style).

`apply_tensor_parallel(model, ctx)` runs on the meta-device model before weights are loaded:
it shrinks each layer to this rank's shard and swaps in the layers that communicate. The model
code itself knows nothing of ranks. Head bookkeeping (which KV heads a rank holds, with or
without DCP) lives here and in `local_attention_spec`, so the loader, the cache and the
backends agree.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from meshserve.attention.spec import AttentionSpec
from meshserve.errors import check
from meshserve.parallel.groups import ParallelContext
from meshserve.parallel.layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding


def local_kv_heads(num_kv_heads: int, tp: int, dcp: int = 1) -> int:
    """KV heads one rank stores: split over tp // dcp groups, one (replicated) when fewer heads.

    Under DCP the ranks of a DCP group hold the same KV heads and split their tokens instead.
    """
    groups = tp // dcp
    if num_kv_heads >= groups:
        check(num_kv_heads % groups == 0, "tp", tp,
              f"a value with num_key_value_heads={num_kv_heads} divisible by tp/dcp={groups}")
        return num_kv_heads // groups
    check(groups % num_kv_heads == 0, "tp", tp,
          f"a value with tp/dcp={groups} a multiple of num_key_value_heads={num_kv_heads}")
    return 1


def kv_head_offset(num_kv_heads: int, tp: int, dcp: int, rank: int) -> int:
    """The first KV head rank `rank` stores."""
    groups, group = tp // dcp, rank // dcp
    if num_kv_heads >= groups:
        return group * (num_kv_heads // groups)
    return group * num_kv_heads // groups


def local_attention_spec(spec: AttentionSpec, ctx: ParallelContext) -> AttentionSpec:
    """The layer as this rank's backend sees it: under DCP, the query heads of the whole DCP
    group (they are gathered before attention) over this rank's KV heads."""
    check(spec.num_heads % ctx.tp == 0, "tp", ctx.tp, f"a divisor of num_heads={spec.num_heads}")
    return dataclasses.replace(spec, num_heads=spec.num_heads // ctx.tp * ctx.dcp,
                               num_kv_heads=local_kv_heads(spec.num_kv_heads, ctx.tp, ctx.dcp))


def apply_tensor_parallel(model: nn.Module, ctx: ParallelContext) -> None:
    """Reshape a meta-device CausalLM in place for rank `ctx.rank` of `ctx.tp`."""
    if ctx.tp == 1:
        return
    arch = model.arch
    hidden, tp = arch.hidden_size, ctx.tp
    check(arch.intermediate_size % tp == 0, "tp", tp, f"a divisor of intermediate_size={arch.intermediate_size}")
    q_heads = arch.num_heads // tp
    kv_heads = local_kv_heads(arch.num_kv_heads, tp, ctx.dcp)
    body = model.model
    body.embed_tokens = VocabParallelEmbedding(arch.vocab_size, hidden, ctx=ctx)
    for layer in body.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.num_heads, attn.num_kv_heads = q_heads, kv_heads
        attn.qkv_proj = nn.Linear(hidden, (q_heads + 2 * kv_heads) * arch.head_dim, bias=arch.qkv_bias)
        attn.o_proj = RowParallelLinear(q_heads * arch.head_dim, hidden, bias=arch.o_bias, ctx=ctx)
        if attn.sinks is not None:  # one sink logit per query head it attends for (DCP: the group's)
            attn.sinks = nn.Parameter(torch.empty(q_heads * ctx.dcp), requires_grad=False)
        if arch.experts is not None:
            from meshserve.workers.models.gptoss_moe import shard_swiglu_moe

            shard_swiglu_moe(mlp, ctx)
            continue
        mlp.intermediate_size = arch.intermediate_size // tp
        mlp.gate_up_proj = nn.Linear(hidden, 2 * mlp.intermediate_size, bias=arch.mlp_bias)
        mlp.down_proj = RowParallelLinear(mlp.intermediate_size, hidden, bias=arch.mlp_bias, ctx=ctx)
    model.lm_head = ParallelLMHead(arch.vocab_size, hidden, ctx=ctx)
