"""GPT-OSS's mixture of experts: plain top-k routing over clamped-SwiGLU experts with biases.

Per token x [hidden]:

    logits      = router(x)                              [E]   (with bias)
    ids, top    = topk(logits, k);  w = softmax(top)     [k]
    expert e:     g, u = (x @ gate_up_proj[e] + b)[0::2], [1::2]    (gate and up interleaved)
                  g = min(g, limit);  u = clamp(u, -limit, limit)
                  y_e = ((u + 1) * g * sigmoid(alpha * g)) @ down_proj[e] + down_proj_bias[e]
    out         = sum_j w_j * y_{ids_j}

Parameters keep HF's names and layouts ([E, in, out], "transposed" against nn.Linear), so each
checkpoint tensor loads as one parameter. Each expert runs once per step on its tokens
(moe.run_moe; fused kernels on CUDA). Tensor parallelism (`shard_swiglu_moe`, called by
transformer_parallel.py) splits every expert's intermediate columns: gate/up pairs stay together
because they are interleaved; expert parallelism spreads whole experts over ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from meshserve.errors import check
from meshserve.parallel.groups import ParallelContext, all_reduce
from meshserve.workers.models.arch import SwigluExperts
from meshserve.workers.models.expert_layer import ExpertLayer
from meshserve.workers.models.expert_parallel import shard_experts_for
from meshserve.workers.models.fused_moe import ACT_SWIGLU_CLAMP, ExpertActivation, ExpertWeights
from meshserve.workers.models.fused_ops import DeferredSum
from meshserve.workers.models.moe import run_moe, select_experts
from meshserve.workers.models.moe_routing import RoutingSpec


class SwigluExpertBank(nn.Module):
    """All experts' weights, HF layout.

    gate_up_proj [E, hidden, 2 * I] (gate in even columns, up in odd), gate_up_proj_bias [E, 2 * I],
    down_proj [E, I, hidden], down_proj_bias [E, hidden]. Under tensor parallelism I is this
    rank's share and only rank 0 adds down_proj_bias (the partial outputs are summed).
    """

    def __init__(self, hidden: int, intermediate: int, cfg: SwigluExperts) -> None:
        super().__init__()
        e = cfg.num_experts
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(e, hidden, 2 * intermediate), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * intermediate), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, intermediate, hidden), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(e, hidden), requires_grad=False)
        self.add_down_bias = True

    def run(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert` on its tokens x [n, hidden] -> [n, hidden]."""
        gate_up = x @ self.gate_up_proj[expert] + self.gate_up_proj_bias[expert]  # [n, 2I]
        gate = gate_up[..., 0::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        h = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))  # [n, I]
        y = h @ self.down_proj[expert]
        return y + self.down_proj_bias[expert] if self.add_down_bias else y

    def packed(self) -> ExpertWeights:
        """These weights in the fused kernels' layout: gate and up de-interleaved, every matrix
        [out, in] with the reduction dimension contiguous (new tensors)."""
        gate_up, bias = self.gate_up_proj, self.gate_up_proj_bias
        w13 = torch.cat((gate_up[..., 0::2], gate_up[..., 1::2]), dim=-1).transpose(1, 2).contiguous()
        b13 = torch.cat((bias[:, 0::2], bias[:, 1::2]), dim=-1).contiguous()
        return ExpertWeights(w13=w13, w2=self.down_proj.transpose(1, 2).contiguous(), b13=b13,
                             b2=self.down_proj_bias.detach().clone() if self.add_down_bias else None,
                             activation=ExpertActivation(ACT_SWIGLU_CLAMP, self.alpha, self.limit))


class SwigluMoE(ExpertLayer):
    """router (nn.Linear with bias, [E, hidden]) + experts (SwigluExpertBank); x [T, hidden] -> [T, hidden]."""

    def __init__(self, hidden: int, intermediate: int, cfg: SwigluExperts) -> None:
        super().__init__(cfg.num_experts)
        self.top_k = cfg.top_k
        self.num_experts = cfg.num_experts
        self.routing = RoutingSpec(cfg.num_experts, cfg.top_k, scoring="topk_softmax")
        self.router = nn.Linear(hidden, cfg.num_experts, bias=True)
        self.experts: SwigluExpertBank | None = SwigluExpertBank(hidden, intermediate, cfg)

    def route(self, x: torch.Tensor, *, num_real_tokens: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """x [T, hidden] -> (weights [T, k] in x's dtype, expert ids [T, k] int64); rows at and
        after num_real_tokens (padding) get DROPPED ids."""
        return select_experts(self.router(x), self.routing, num_real_tokens=num_real_tokens)

    def pack_experts(self) -> None:
        """Switch to the fused kernels: the experts move to their layout; HF's copy is freed."""
        self.fused = self.experts.packed()
        self.experts = None

    def forward(self, x: torch.Tensor, *, num_real_tokens: torch.Tensor | None = None) -> torch.Tensor | DeferredSum:
        """x [T, hidden] -> [T, hidden] (or unsummed, for the next norm: moe.run_moe);
        num_real_tokens: ForwardContext's (padding rows run no expert)."""
        weights, ids = self.route(x, num_real_tokens=num_real_tokens)
        return run_moe(self, x, weights, ids, None if self.experts is None else self.experts.run,
                       num_real_tokens=num_real_tokens)  # fmt: skip


def shard_swiglu_moe(moe: SwigluMoE, ctx: ParallelContext) -> None:
    """Tensor (and expert) parallelism on the meta-device model: every expert keeps
    intermediate/expert_tp of its features (loader: workers/sharding.py EXPERT_SPLITS; without
    expert parallelism expert_tp is tp), and under --ep a rank keeps only its E/ep experts
    (expert_parallel.py). The router stays whole, so each rank routes alike; partial outputs are
    summed by one all-reduce per layer, and only one rank per expert adds its down-projection bias."""
    bank = moe.experts
    experts, hidden, two_i = bank.gate_up_proj.shape
    inter, split = two_i // 2, ctx.expert_tp
    check(inter % split == 0, "tp", ctx.tp, f"tp/ep dividing the experts' intermediate_size={inter} (ep={ctx.ep})")
    shard = shard_experts_for(ctx, experts)
    local, num = inter // split, experts if shard is None else shard.num_local
    bank.gate_up_proj = nn.Parameter(torch.empty(num, hidden, 2 * local), requires_grad=False)
    bank.gate_up_proj_bias = nn.Parameter(torch.empty(num, 2 * local), requires_grad=False)
    bank.down_proj = nn.Parameter(torch.empty(num, local, hidden), requires_grad=False)
    bank.down_proj_bias = nn.Parameter(torch.empty(num, hidden), requires_grad=False)
    bank.add_down_bias = ctx.expert_tp_rank == 0
    moe.expert_shard = shard
    moe.expert_load = torch.zeros(num, dtype=torch.int64)
    moe.sum_in_norm = False  # the all-reduce hook reads the summed output
    moe.register_forward_hook(lambda module, args, out: all_reduce(out, ctx))
