"""Run a function on N local ranks joined by a gloo process group (tests only)."""

from __future__ import annotations

import multiprocessing
import os

import torch.multiprocessing as mp

from meshserve.parallel.groups import local_rendezvous, remove_rendezvous

# Ranks start from a fork server that imported these once per test session, not each from a bare
# interpreter: a spawned rank spent ~2.4 s of CPU importing them (torch._dynamo alone ~1.2 s: the
# loader's meta-device init imports it), which on two cores was most of a small layout's run.
# Each rank is still a fresh process forked from that server (no test's state, no threads); the
# server inherits this process's environment when it starts (TRITON_INTERPRET, set by
# tests/conftest.py first): a test that needs other variables in its ranks cannot use run_ranks.
PRELOAD = ["pytest", "torch", "torch._dynamo", "torch.distributed", "triton", "triton.experimental.gluon",
           "tokenizers", "meshserve.cluster.executors.spmd", "meshserve.engine.engine_core",
           "meshserve.workers.worker", "meshserve.workers.models.transformer_parallel",
           "meshserve.attention.backends.triton_paged", "tests.triton_interpreter"]
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)


def run_on_rank(config, rank: int, init_method: str, work, out_file: str) -> None:
    """Drive this process's rank of `config`'s layout (its Worker on the CPU) with an EngineCore:
    `work(core)`; rank 0 writes what it returns to `out_file` as JSON."""
    import json

    import torch

    from meshserve.cluster.executors.spmd import SpmdExecutor
    from meshserve.engine.engine_core import EngineCore
    from meshserve.workers.worker import Worker

    torch.set_num_threads(1)
    if os.environ.get("TRITON_INTERPRET") == "1":
        from tests.triton_interpreter import skip_repeated_patching

        skip_repeated_patching()  # as tests/conftest.py does in the test process
    worker = Worker(config.model, config.cache, config.attention, config.parallel, rank=rank, device="cpu",
                    progress=False, init_method=init_method)
    core = EngineCore(config, executor=SpmdExecutor(worker))
    try:
        results = work(core)
    finally:
        core.shutdown()
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(results, f)


def run_ranks(fn, world: int, *args) -> None:
    """Start `world` processes running fn(rank, world, init_method, *args); re-raise any failure."""
    init_method = local_rendezvous()
    try:
        mp.start_processes(fn, args=(world, init_method, *args), nprocs=world, join=True,
                           start_method="forkserver")
    finally:
        remove_rendezvous(init_method)
