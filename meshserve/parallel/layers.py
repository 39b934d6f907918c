"""Tensor-parallel layers, built at this rank's shard size (on the meta device, before loading).

The loader fills their parameters with this rank's slice of each checkpoint tensor
(workers/sharding.py says which). Column-parallel projections need no layer of their own: a
plain nn.Linear with fewer output features is one. What needs code is the communication:
- RowParallelLinear: input features split; partial products summed by all-reduce; bias once.
- VocabParallelEmbedding: vocabulary rows split; ids outside this rank's rows embed to zero;
  all-reduce.
- ParallelLMHead: vocabulary rows split; logits all-gathered along the vocabulary.
Vocabulary shards are ceil(V / tp) rows, the last one shorter when tp does not divide V.
"""

from __future__ import annotations

import torch
from torch import nn

from meshserve.core.arith import cdiv
from meshserve.parallel.groups import ParallelContext, all_gather, all_reduce


def vocab_range(vocab_size: int, ctx: ParallelContext) -> tuple[int, int]:
    """[start, stop) of the vocabulary rows rank `ctx.rank` holds."""
    per = cdiv(vocab_size, ctx.tp)
    return min(ctx.rank * per, vocab_size), min((ctx.rank + 1) * per, vocab_size)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_local @ W_local^T, plus the bias once. W: [out, in / tp]."""

    def __init__(self, in_features_local: int, out_features: int, *, bias: bool, ctx: ParallelContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.weight = nn.Parameter(torch.empty(out_features, in_features_local), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(nn.functional.linear(x, self.weight), self.ctx)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, *, ctx: ParallelContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.start, stop = vocab_range(vocab_size, ctx)
        self.weight = nn.Parameter(torch.empty(stop - self.start, hidden), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        local = ids - self.start
        outside = (local < 0) | (local >= rows)
        out = nn.functional.embedding(local.clamp(0, max(rows - 1, 0)), self.weight)
        return all_reduce(out.masked_fill(outside[..., None], 0), self.ctx)


class ParallelLMHead(nn.Module):
    """logits [N, V] on every rank from vocabulary-split weights."""

    def __init__(self, vocab_size: int, hidden: int, *, ctx: ParallelContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.vocab_size = vocab_size
        self.per_rank = cdiv(vocab_size, ctx.tp)
        start, stop = vocab_range(vocab_size, ctx)
        self.weight = nn.Parameter(torch.empty(stop - start, hidden), requires_grad=False)

    def local_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [N, hidden] -> this rank's logits [N, rows] (an FP8 head overrides it: workers/quant/layers.py)."""
        return nn.functional.linear(h, self.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        local = self.local_logits(h)  # [N, rows]
        pad = self.per_rank - local.shape[-1]
        if pad:  # all-gather needs equal shards; the padding is cut off again below
            local = nn.functional.pad(local, (0, pad))
        return all_gather(local, self.ctx, dim=-1)[..., : self.vocab_size]
