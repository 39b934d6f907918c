"""Whether the pools' ranks can fit the GPUs of a Ray cluster: the arithmetic, without Ray.

On CUDA every rank reserves `gpus_per_rank` of a GPU in its placement bundle (ray_executor.py,
rank_bundle). Ray gives a fractional request a share of one GPU (never parts of two), so a GPU
holds floor(1 / gpus_per_rank) such ranks; a replica's ranks are STRICT_PACKed onto one node.
A layout that cannot fit would leave a placement group pending forever; `gpu_shortfall` says so
before anything is placed, naming the settings that fix it. It checks conditions every feasible
placement meets (it never refuses a layout Ray could place); Ray still does the packing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

_EPS = 1e-9  # 1 / 0.1 is 10.000000000000002, 1 / (1 / 3) may be 2.9999999999999996


@dataclass(frozen=True)
class PoolDemand:
    """What one pool asks of the cluster: `replicas` replicas of `tp` ranks, each rank reserving
    `gpus_per_rank` of a GPU."""

    role: str
    replicas: int
    tp: int
    gpus_per_rank: float = 1.0

    @property
    def ranks(self) -> int:
        return self.replicas * self.tp

    @property
    def gpus(self) -> float:
        return self.ranks * self.gpus_per_rank


def ranks_per_gpu(gpus_per_rank: float) -> int:
    """How many ranks reserving `gpus_per_rank` each one GPU holds."""
    return math.floor(1.0 / gpus_per_rank + _EPS)


def rank_slots(node_gpus: Sequence[float], gpus_per_rank: float) -> int:
    """Ranks of `gpus_per_rank` the nodes hold (node_gpus: each node's GPU count)."""
    per_gpu = ranks_per_gpu(gpus_per_rank)
    slots = 0
    for n in node_gpus:
        whole = math.floor(n + _EPS)
        slots += whole * per_gpu + math.floor(max(n - whole, 0.0) / gpus_per_rank + _EPS)
    return slots


def gpu_shortfall(demands: Sequence[PoolDemand], node_gpus: Sequence[float]) -> str | None:
    """Why the pools' ranks cannot all be placed on nodes with these GPU counts, or None when
    they may be (Ray decides the rest)."""
    node_gpus = [max(float(n), 0.0) for n in node_gpus]
    total = sum(node_gpus)
    need = sum(d.gpus for d in demands)
    asked = ", ".join(f"{d.role} {d.replicas} x tp={d.tp} x {d.gpus_per_rank:g} GPU" for d in demands)
    fractions = {d.gpus_per_rank for d in demands}
    if len(fractions) == 1:  # one size of rank: count places, not GPU totals (0.6 + 0.6 do not share a GPU)
        (fraction,) = fractions
        ranks, slots = sum(d.ranks for d in demands), rank_slots(node_gpus, fraction)
        fits = ranks <= slots
        have = f"room for {slots} rank(s) of {fraction:g} GPU on {total:g} GPU(s)"
    else:
        fits = need <= total + _EPS
        have = f"{total:g} GPU(s)"
    if not fits:
        return (f"the pools' ranks need {need:g} GPU(s) ({asked}) but the Ray cluster has {have}: "
                + _fixes(demands, total))
    widest = max(node_gpus, default=0.0)
    for d in demands:
        if d.tp > 1 and d.tp * d.gpus_per_rank > widest + _EPS:
            return (f"a {d.role} replica's {d.tp} ranks share one node (STRICT_PACK) and need "
                    f"{d.tp * d.gpus_per_rank:g} GPU(s) there, but the largest node of the Ray cluster has "
                    f"{widest:g}: lower --tp (or --{d.role}-tp), or add a node with {d.tp} GPUs")
    return None


def _fixes(demands: Sequence[PoolDemand], total: float) -> str:
    """The settings that would make the layout fit, in words."""
    fixes = []
    ranks = sum(d.ranks for d in demands)
    whole = math.floor(total + _EPS)
    if whole >= 1 and all(d.tp == 1 for d in demands):
        share = 1.0 / math.ceil(ranks / whole)
        fixes.append(f"--gpus-per-rank {math.floor(share * 100) / 100:g} to share each GPU between one-rank replicas")
    fixes.append("fewer replicas (--replicas, --prefill-replicas, --decode-replicas)")
    if any(d.tp > 1 for d in demands):
        fixes.append("a smaller --tp")
    fixes.append("more GPU nodes (--ray-address of a larger cluster)")
    return "use " + ", or ".join(fixes)
