"""Run a function on N local ranks joined by a gloo process group (tests only)."""

from __future__ import annotations

import socket

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn, world: int, *args) -> None:
    """Start `world` processes running fn(rank, world, init_method, *args); re-raise any failure."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    mp.start_processes(fn, args=(world, init_method, *args), nprocs=world, join=True, start_method="spawn")
