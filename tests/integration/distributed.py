"""Run a function on N local ranks joined by a gloo process group (tests only)."""

from __future__ import annotations

import torch.multiprocessing as mp

from meshserve.parallel.groups import local_rendezvous


def run_ranks(fn, world: int, *args) -> None:
    """Start `world` processes running fn(rank, world, init_method, *args); re-raise any failure."""
    mp.start_processes(fn, args=(world, local_rendezvous(), *args), nprocs=world, join=True, start_method="spawn")
