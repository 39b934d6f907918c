"""MoE routing: router logits -> (weights, expert ids) for both MoE families, as one spec.

    scores  = softmax(logits) | sigmoid(logits) | logits            (scoring)
    choice  = scores + correction_bias                              (V3; chooses, does not weigh)
    groups  : keep the topk_groups best of num_groups groups of experts, scored by their best
              expert (group_by "max", V2) or the sum of their best two ("top2_sum", V3); the
              other experts' choice becomes 0 (softmax) or -inf (sigmoid)
    ids     = the top_k experts by choice
    weights = softmax:       their choice values (V2: the masked scores themselves)
              sigmoid:       their scores (without the bias)
              topk_softmax:  softmax over their logits (GPT-OSS)
              then / sum (norm_topk_prob), then * routed_scaling_factor

Ties: an expert (or a group) with a lower index wins a tie, and the k ids come out by
descending choice. `route_torch` gets that from a stable descending sort; the Triton kernel
(routing_kernel.py, CUDA) picks the k best one at a time, the lowest index among equal maxima.
`route_torch` is the CPU path and the oracle the kernel is tested against; moe.select_experts
chooses between them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshserve.errors import check

SCORINGS = ("softmax", "sigmoid", "topk_softmax")
GROUP_BY = ("none", "max", "top2_sum")


@dataclass(frozen=True)
class RoutingSpec:
    """How one MoE layer turns router logits [T, num_experts] into (weights, ids) [T, top_k]."""

    num_experts: int
    top_k: int
    scoring: str = "softmax"
    group_by: str = "none"
    num_groups: int = 1
    topk_groups: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        check(self.num_experts >= 1, "num_experts", self.num_experts, "an integer >= 1")
        check(1 <= self.top_k <= self.num_experts, "top_k", self.top_k, f"an integer in [1, {self.num_experts}]")
        check(self.scoring in SCORINGS, "scoring", self.scoring, " / ".join(SCORINGS))
        check(self.group_by in GROUP_BY, "group_by", self.group_by, " / ".join(GROUP_BY))
        if self.group_by != "none":
            check(self.num_groups >= 1 and self.num_experts % self.num_groups == 0, "num_groups", self.num_groups,
                  f"a divisor of num_experts={self.num_experts}")  # fmt: skip
            per_group = self.num_experts // self.num_groups
            check(1 <= self.topk_groups <= self.num_groups and self.topk_groups * per_group >= self.top_k,
                  "topk_groups", self.topk_groups,
                  f"in [1, num_groups={self.num_groups}] holding top_k={self.top_k} experts")  # fmt: skip
            check(self.group_by != "top2_sum" or per_group >= 2, "group_by", self.group_by,
                  "'max' when a group holds a single expert")  # fmt: skip

    @property
    def per_group(self) -> int:
        return self.num_experts // self.num_groups


def _top(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of values [T, n] by row, descending; among equal values the lower index first."""
    ordered, index = torch.sort(values, dim=-1, descending=True, stable=True)
    return ordered[:, :k], index[:, :k]


DROPPED = -1  # the expert id of a padding row's slots: outside [0, E), so no expert runs it


def route_torch(logits: torch.Tensor, spec: RoutingSpec, bias: torch.Tensor | None = None, *,
                num_real_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """logits [T, E] (any float dtype), bias [E] or None -> (weights [T, k], ids [T, k] int64).

    Scores are computed in the logits' dtype: float32 for DeepSeek (its router runs in float32),
    the model dtype for GPT-OSS (its router is a plain linear layer). weights have that dtype.
    num_real_tokens ([1] int tensor, or None: all rows): rows at and after it pad a CUDA-graph
    bucket; their ids are DROPPED and their weights 0.
    """
    weights, ids = _route(logits, spec, bias)
    if num_real_tokens is None:
        return weights, ids
    padding = (torch.arange(ids.shape[0], device=ids.device) >= num_real_tokens)[:, None]  # [T, 1]
    return weights.masked_fill(padding, 0.0), ids.masked_fill(padding, DROPPED)


def _route(logits: torch.Tensor, spec: RoutingSpec, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if spec.scoring == "topk_softmax":
        top, ids = _top(logits, spec.top_k)
        weights = top.softmax(dim=-1)
    else:
        scores = logits.softmax(dim=-1) if spec.scoring == "softmax" else logits.sigmoid()
        choice = scores if bias is None else scores + bias.to(scores.dtype)
        if spec.group_by != "none":
            choice = _keep_best_groups(choice, spec)
        top, ids = _top(choice, spec.top_k)
        weights = top if spec.scoring == "softmax" else scores.gather(1, ids)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return weights, ids


def _keep_best_groups(choice: torch.Tensor, spec: RoutingSpec) -> torch.Tensor:
    """Mask every expert outside the topk_groups best groups (0 for softmax scores, -inf else)."""
    tokens = choice.shape[0]
    grouped = choice.view(tokens, spec.num_groups, spec.per_group)
    if spec.group_by == "max":
        group_scores = grouped.max(dim=-1).values
    else:  # "top2_sum"
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    best = _top(group_scores, spec.topk_groups)[1]  # [T, topk_groups]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    keep = keep[:, :, None].expand_as(grouped).reshape(tokens, spec.num_experts)
    return choice.masked_fill(~keep, 0.0 if spec.scoring == "softmax" else float("-inf"))
