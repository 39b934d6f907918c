"""DeepSeek's mixture of experts: grouped top-k routing, routed experts, always-on shared experts.

Plain torch, written to be read: the router scores every expert, keeps the best `topk_groups`
groups of experts, picks `top_k` experts among them, and weighs their outputs; the shared
experts see every token. Each routed expert runs once per step on the tokens sent to it.
Module and parameter names are HF's, so checkpoints load one tensor per parameter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from meshserve.workers.models.deepseek_arch import MoEConfig


def combine_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    run_expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t, grouped per expert.

    x [T, hidden]; weights [T, k]; ids [T, k] int64; run_expert(e, x_e [n, hidden]) -> [n, hidden].
    Each chosen expert runs once on all its tokens, in ascending expert order (the order HF
    accumulates in, so float sums match it). Returns [T, hidden] in x's dtype.
    """
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():
        token, slot = torch.where(ids == expert)
        y = run_expert(expert, x[token]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense layers, each routed expert and the shared experts."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Chooses top_k experts per token and their weights.

    weight: [E, hidden] (kept float32 when the model is: HF scores in float32)
    e_score_correction_bias: [E] (V3) added to the scores to choose experts, not to weigh them
    """

    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden), requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(moe.num_experts), requires_grad=False) if moe.correction_bias else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, top_k] float32, expert ids [T, top_k] int64)."""
        moe = self.moe
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        scores = logits.softmax(dim=-1) if moe.scoring == "softmax" else logits.sigmoid()
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias.float()
        if moe.group_by != "none":
            choice = self._keep_best_groups(choice)
        if moe.scoring == "softmax":
            # V2: the masked scores themselves are the weights (masked experts score 0).
            weights, ids = torch.topk(choice, moe.top_k, dim=-1, sorted=False)
        else:
            ids = torch.topk(choice, moe.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling_factor, ids

    def _keep_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Mask every expert outside the topk_groups best groups (0 for softmax scores, -inf else)."""
        moe = self.moe
        tokens = choice.shape[0]
        grouped = choice.view(tokens, moe.num_groups, moe.num_experts // moe.num_groups)
        if moe.group_by == "max":
            group_scores = grouped.max(dim=-1).values
        else:  # "top2_sum"
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best = torch.topk(group_scores, moe.topk_groups, dim=-1, sorted=False)[1]  # [T, topk_groups]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        keep = keep[:, :, None].expand_as(grouped).reshape(tokens, moe.num_experts)
        return choice.masked_fill(~keep, 0.0 if moe.scoring == "softmax" else float("-inf"))


class MoE(nn.Module):
    """Routed experts (weighted by the router) plus shared experts (every token)."""

    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__()
        self.gate = Router(hidden, moe)
        self.experts = nn.ModuleList(GatedMLP(hidden, moe.moe_intermediate_size) for _ in range(moe.num_experts))
        self.shared_experts = (
            GatedMLP(hidden, moe.moe_intermediate_size * moe.num_shared_experts) if moe.num_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        weights, ids = self.gate(x)  # [T, k] each
        out = combine_experts(x, weights, ids, lambda e, xe: self.experts[e](xe))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
