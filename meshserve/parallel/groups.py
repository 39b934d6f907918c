"""Process groups of one replica: TP over all its ranks, DCP and EP over consecutive TP ranks.

Rank, world size and the rendezvous address are passed in (never a hard-coded port). gloo on
CPU, NCCL on CUDA. A single-rank replica creates no group and every collective is skipped.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from meshserve.config import ParallelConfig
from meshserve.errors import check


@dataclass(frozen=True)
class ParallelContext:
    """Where this rank sits in its replica.

    rank: TP rank in [0, tp). DCP groups are [g*dcp, (g+1)*dcp); dcp_rank = rank % dcp.
    The ranks of one DCP group hold the same KV heads and split their tokens (token p on
    dcp_rank p % dcp). EP groups are [g*ep, (g+1)*ep): ep_rank = rank % ep picks the experts a
    rank holds, and the tp // ep groups slice those experts' features (expert_tp_rank).
    """

    rank: int = 0
    tp: int = 1
    dcp: int = 1
    tp_group: dist.ProcessGroup | None = None
    dcp_group: dist.ProcessGroup | None = None
    ep: int = 1
    ep_group: dist.ProcessGroup | None = None

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    @property
    def expert_tp(self) -> int:
        """Ways each expert's intermediate features are split (tp // ep)."""
        return self.tp // self.ep

    @property
    def expert_tp_rank(self) -> int:
        return self.rank // self.ep

    @property
    def dcp_rank(self) -> int:
        return self.rank % self.dcp

    @property
    def kv_group_index(self) -> int:
        """Which of the tp // dcp KV-head groups this rank serves."""
        return self.rank // self.dcp

    @property
    def num_kv_groups(self) -> int:
        return self.tp // self.dcp

    @property
    def is_driver(self) -> bool:
        """Rank 0 samples and reports tokens."""
        return self.rank == 0


def init_parallel(config: ParallelConfig, *, rank: int, init_method: str | None, device: str = "cpu",
                  timeout_s: float = 120.0) -> ParallelContext:
    """Join the replica's process group and build its DCP groups.

    init_method: a torch.distributed rendezvous: local_rendezvous() (a replica's ranks share a
    node), or "tcp://HOST:PORT" (None for tp=1).
    Every rank must call this with the same config.
    """
    check(0 <= rank < config.tp, "rank", rank, f"an integer in [0, {config.tp - 1}]")
    if config.tp == 1:
        return ParallelContext()
    check(init_method is not None, "init_method", init_method, "a rendezvous address when tp > 1")
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=config.tp,
                            timeout=timedelta(seconds=timeout_s))
    return ParallelContext(rank=rank, tp=config.tp, dcp=config.dcp, tp_group=dist.group.WORLD,
                           dcp_group=_consecutive_group(config.dcp, config.tp, rank), ep=config.ep,
                           ep_group=_consecutive_group(config.ep, config.tp, rank))  # fmt: skip


def _consecutive_group(size: int, world: int, rank: int) -> dist.ProcessGroup | None:
    """This rank's group among [0, size), [size, 2 size), ... (None for size 1; WORLD for size world)."""
    if size == 1:
        return None
    if size == world:
        return dist.group.WORLD
    mine = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))  # every rank creates every group
        if first <= rank < first + size:
            mine = group
    return mine


def local_rendezvous() -> str:
    """A rendezvous for ranks on this machine: a torch.distributed FileStore in a new directory
    only this user can enter. Nothing listens (a TCPStore listens on every interface and takes
    keys from anyone who connects); the file is the store's, torch removes it when the last rank
    lets go, and `remove_rendezvous` removes the directory."""
    return "file://" + os.path.join(tempfile.mkdtemp(prefix="meshserve-rendezvous-"), "store")


def remove_rendezvous(init_method: str) -> None:
    """Remove what local_rendezvous made (after every rank has joined)."""
    if init_method.startswith("file://"):
        shutil.rmtree(os.path.dirname(init_method.removeprefix("file://")), ignore_errors=True)


def shutdown_parallel(ctx: ParallelContext) -> None:
    if ctx.tp > 1 and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Sum over the TP group (in place); identity on one rank."""
    if ctx.tp > 1:
        dist.all_reduce(x, group=ctx.tp_group)
    return x


def all_gather(x: torch.Tensor, ctx: ParallelContext, *, dim: int = -1, group_kind: str = "tp") -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order, over the TP or DCP group."""
    size = ctx.tp if group_kind == "tp" else ctx.dcp
    if size == 1:
        return x
    group = ctx.tp_group if group_kind == "tp" else ctx.dcp_group
    x = x.contiguous()
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)
    return torch.cat(out.view(size, *x.shape).unbind(0), dim=dim)


# torch >= 2.12 names it all_gather_single; older releases all_gather_into_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_to_all_ep(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """x [ep, ...]: part i goes to EP rank i; returns [ep, ...] where part i came from EP rank i.

    Equal parts (fixed-size buffers, so nothing is read back to the host). all_to_all_single
    works on NCCL and on gloo (which lacks the list form all_to_all).
    """
    if ctx.ep == 1:
        return x
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=ctx.ep_group)
    return out
