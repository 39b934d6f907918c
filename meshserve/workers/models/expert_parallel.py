"""Expert parallelism: routed experts spread over the ranks of an EP group, tokens moved by all-to-all.

Layout (ParallelContext): the tp ranks of a replica form tp/ep EP groups of ep consecutive
ranks. Attention stays tensor-parallel over all tp ranks, so after it every rank holds every
token. In an MoE layer, EP rank r of a group holds experts [r E/ep, (r+1) E/ep) whole, sliced
tp/ep ways across the groups (expert_tp); the router is whole on every rank; shared experts are
replicated over the EP group (sliced like the routed ones across groups).

One layer on T tokens, per rank:
  1. take this rank's chunk of the tokens: [r C, (r+1) C) with C = ceil(T / ep);
  2. dispatch: each (token, slot) row goes to the rank holding its expert, in fixed-size parts
     of C * min(k, E/ep) rows per peer (the most one peer can receive: a token's k experts are
     distinct), one all_to_all_single for the rows and one for their local expert ids;
  3. the local experts run on what arrived (fused on CUDA), one expert per row;
  4. combine: the outputs return by the same all-to-all, the source weighs and sums each
     token's k rows and adds the shared experts of its chunk;
  5. the layer's all-reduce over the TP group (the same one tensor parallelism does) sums the
     chunks of the EP group and the feature slices of the groups.
Every size comes from T, k, E and ep: nothing is read back to the host. Padding rows carry
expert id -1 and are dropped by the expert kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from meshserve.core.arith import cdiv
from meshserve.errors import check
from meshserve.parallel.groups import ParallelContext, all_to_all_ep

LocalExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ExpertShard:
    """Which routed experts this rank holds: [first, first + num_local) of num_experts."""

    ctx: ParallelContext
    num_experts: int

    def __post_init__(self) -> None:
        check(self.num_experts % self.ctx.ep == 0, "ep", self.ctx.ep,
              f"a divisor of the number of routed experts ({self.num_experts})")  # fmt: skip

    @property
    def num_local(self) -> int:
        return self.num_experts // self.ctx.ep

    @property
    def first(self) -> int:
        return self.ctx.ep_rank * self.num_local


def dispatch_combine(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shard: ExpertShard,
                     run_local: LocalExperts, shared: Callable[[torch.Tensor], torch.Tensor] | None
                     ) -> torch.Tensor:  # fmt: skip
    """Routed (+ shared) experts of this rank's chunk of x [T, H]; zeros for the other tokens.

    weights, ids: [T, k] from the router (ids global). run_local(x_rows [n, H], weights [n, 1],
    local ids [n, 1]) runs this rank's experts, dropping ids outside them.
    """
    ctx, (T, k), H = shard.ctx, ids.shape, x.shape[1]
    ep, local = ctx.ep, shard.num_local
    chunk = cdiv(T, ep)
    lo, pad = ctx.ep_rank * chunk, chunk * ep - T
    xc = F.pad(x, (0, 0, 0, pad))[lo : lo + chunk]  # [C, H]
    wc = F.pad(weights, (0, 0, 0, pad))[lo : lo + chunk]  # [C, k]
    flat = F.pad(ids, (0, 0, 0, pad), value=-1)[lo : lo + chunk].reshape(-1)  # [C k]
    cap = chunk * min(k, local)  # rows one peer can receive from this rank
    owner = torch.where(flat >= 0, flat // local, ep)  # padding rows: owner ep, nowhere
    onehot = (owner[:, None] == torch.arange(ep + 1, device=owner.device)).long()  # (F.one_hot syncs on CUDA)
    pos = (onehot.cumsum(0) * onehot).sum(1) - 1  # rank of each row among its owner's rows
    dest = torch.where(owner < ep, owner * cap + pos, ep * cap)  # ep * cap: a trash row
    send_x = x.new_zeros(ep * cap + 1, H).index_copy_(0, dest, xc.repeat_interleave(k, dim=0))
    send_id = torch.full((ep * cap + 1,), -1, dtype=ids.dtype, device=ids.device)
    send_id.index_copy_(0, dest, torch.where(owner < ep, flat - owner * local, -1))
    recv_x = all_to_all_ep(send_x[: ep * cap].view(ep, cap, H), ctx).view(ep * cap, H)
    recv_id = all_to_all_ep(send_id[: ep * cap].view(ep, cap), ctx).view(ep * cap, 1)
    y = run_local(recv_x, torch.ones_like(recv_id, dtype=x.dtype), recv_id)  # [ep cap, H]
    back = all_to_all_ep(y.view(ep, cap, H), ctx).view(ep * cap, H)
    rows = torch.cat((back, back.new_zeros(1, H)))[dest].view(chunk, k, H)  # this chunk's rows
    out_c = (rows * wc[..., None].to(rows.dtype)).sum(1)
    if shared is not None:
        out_c = out_c + shared(xc)
    out = x.new_zeros(chunk * ep, H)
    out[lo : lo + chunk] = out_c
    return out[:T]


def shard_experts_for(ctx: ParallelContext, num_experts: int) -> ExpertShard | None:
    """The ExpertShard of an MoE layer on this rank (None without expert parallelism)."""
    return ExpertShard(ctx, num_experts) if ctx.ep > 1 else None
