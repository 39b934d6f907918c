"""Tensor-parallel layers. Each holds its rank's shard and does the collective its math needs.

- ColumnParallelLinear: output features split; no communication (the next row-parallel layer
  consumes the shard). Fused projections (QKV, gate/up) are split part by part, so every rank
  gets the matching slice of each part.
- RowParallelLinear: input features split; partial products summed by all-reduce.
- VocabParallelEmbedding: vocabulary rows split; each rank embeds its ids, zeros the others,
  all-reduce.
- ParallelLMHead: vocabulary rows split; logits all-gathered along the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from meshserve.errors import check
from meshserve.parallel.groups import ParallelContext, all_gather, all_reduce


def shard(tensor: torch.Tensor, dim: int, ctx: ParallelContext, *, parts: Sequence[int] | None = None) -> torch.Tensor:
    """This rank's slice of `tensor` along `dim`.

    parts: sizes of fused sub-tensors along `dim` (e.g. [q, k, v] rows); each is split
    separately and the slices are concatenated again.
    """
    if ctx.tp == 1:
        return tensor
    sizes = list(parts) if parts is not None else [tensor.shape[dim]]
    check(sum(sizes) == tensor.shape[dim], "parts", list(sizes), f"sizes summing to {tensor.shape[dim]}")
    pieces = []
    for piece in torch.split(tensor, sizes, dim=dim):
        n = piece.shape[dim]
        check(n % ctx.tp == 0, "tp", ctx.tp, f"a divisor of {n} (dimension {dim} of a weight)")
        pieces.append(piece.narrow(dim, ctx.rank * (n // ctx.tp), n // ctx.tp))
    return torch.cat(pieces, dim=dim).contiguous()


class ColumnParallelLinear(nn.Module):
    """y_local = x @ W_local^T (+ b_local): W rows (output features) split over ranks."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ctx: ParallelContext, *,
                 parts: Sequence[int] | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(shard(weight, 0, ctx, parts=parts), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(shard(bias, 0, ctx, parts=parts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum_ranks x_local @ W_local^T, then + b once: W columns (input features) split."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ctx: ParallelContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.weight = nn.Parameter(shard(weight, 1, ctx), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(nn.functional.linear(x, self.weight), self.ctx)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * V/tp, (rank+1) * V/tp) of the table on each rank; ids elsewhere embed to 0."""

    def __init__(self, weight: torch.Tensor, ctx: ParallelContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.weight = nn.Parameter(shard(weight, 0, ctx), requires_grad=False)
        self.start = ctx.rank * self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = nn.functional.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        out = out.masked_fill(outside[..., None], 0)
        return all_reduce(out, self.ctx)


class ParallelLMHead(nn.Module):
    """logits = h @ W^T with W's vocabulary rows split; the full logits are gathered on every rank."""

    def __init__(self, weight: torch.Tensor, ctx: ParallelContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.weight = nn.Parameter(shard(weight, 0, ctx), requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return all_gather(nn.functional.linear(h, self.weight), self.ctx, dim=-1)
