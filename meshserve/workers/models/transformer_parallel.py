"""Tensor parallelism for the generic transformer (transformer.py): a transform of the plain model.

gpt-fast style: `apply_tensor_parallel(model, ctx)` runs on the meta-device model before weights
are loaded; it shrinks each layer to this rank's shard and swaps in the layers that communicate
(parallel/layers.py). The model code itself knows nothing of ranks. Which KV heads a rank holds
is decided in parallel/transform.py; the loader then fills each parameter with this rank's
slice (workers/sharding.py). DeepSeek models have their own transform (deepseek_parallel.py).
"""

from __future__ import annotations

import torch
from torch import nn

from meshserve.errors import check
from meshserve.parallel.groups import ParallelContext
from meshserve.parallel.layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from meshserve.parallel.transform import local_kv_heads
from meshserve.workers.models.gptoss_moe import shard_swiglu_moe


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
            shard_swiglu_moe(mlp, ctx)
            continue
        mlp.intermediate_size = arch.intermediate_size // tp
        mlp.gate_up_proj = nn.Linear(hidden, 2 * mlp.intermediate_size, bias=arch.mlp_bias)
        mlp.down_proj = RowParallelLinear(mlp.intermediate_size, hidden, bias=arch.mlp_bias, ctx=ctx)
    model.lm_head = ParallelLMHead(arch.vocab_size, hidden, ctx=ctx)
