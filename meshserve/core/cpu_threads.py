"""How many intra-op threads torch runs a CPU model with, when the user has not said.

torch's own default is one thread per physical core. meshserve's step is not all torch: the
scheduler, sampling bookkeeping, detokenizer and (under `serve`) the event loop run in Python
beside it, and with every core in torch's pool they fight the pool's threads for cores; libgomp's
threads also spin-wait after each parallel region (torch's CPU wheel links libgomp), so on a
machine shared with other jobs a step at torch's default ran 3-10x slower at random. The default
here is one core left to Python: max(1, cores // ranks_on_host - 1). On the 2-core machine
(docs/performance.md, issue 41 item 4) that one thread never collapsed and served faster; on a
quiet, dedicated machine torch's two threads ran large offline batches 15-31% faster (the user
can say so with OMP_NUM_THREADS). libgomp's passive wait policy would need setting before torch
is imported, before an application asks meshserve anything; it was not faster when quiet anyway.

What the user said wins: OMP_NUM_THREADS in the environment (also what the process executor and
Ray give each rank), or a torch.set_num_threads(n) call made before the model starts, with n
other than torch's own default.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

log = logging.getLogger("meshserve.cpu_threads")

ENV = "OMP_NUM_THREADS"


@dataclass(frozen=True)
class CpuThreads:
    """torch's intra-op thread count for a CPU model, and who chose it."""

    threads: int
    source: str  # "OMP_NUM_THREADS", "torch.set_num_threads" or "meshserve default"
    cores: int  # the cores this process may run on


def usable_cores() -> int:
    """Cores this process may use: its CPU affinity, at most the physical cores (torch's unit)."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        allowed = os.cpu_count() or 1
    return max(1, min(allowed, torch_default_threads()))


def torch_default_threads() -> int:
    """The thread count torch picks on its own: its physical cores (as psutil counts them)."""
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def default_threads(cores: int, ranks_on_host: int = 1) -> int:
    """meshserve's choice for `ranks_on_host` ranks sharing `cores` cores: one core of each rank's
    share left to its Python threads (step loop, event loop), at least one thread."""
    return max(1, cores // max(1, ranks_on_host) - 1)


# The choice this process made last: a later engine in the same process (a second LLM) sees
# torch at that count and must not take it for the user's own call.
_applied: CpuThreads | None = None


def choose(*, ranks_on_host: int = 1) -> CpuThreads:
    """What torch's thread count should be (nothing is changed)."""
    cores = usable_cores()
    env = os.environ.get(ENV, "").strip()
    if env:
        return CpuThreads(torch.get_num_threads(), ENV, cores)
    current = torch.get_num_threads()
    ours = _applied is not None and _applied.source == "meshserve default" and current == _applied.threads
    if current != torch_default_threads() and not ours:
        return CpuThreads(current, "torch.set_num_threads", cores)
    return CpuThreads(default_threads(cores, ranks_on_host), "meshserve default", cores)


def apply_cpu_threads(*, ranks_on_host: int = 1) -> CpuThreads:
    """Set torch's intra-op threads to `choose()`'s count (call before a CPU model runs); logs
    the choice once per process and change."""
    global _applied
    choice = choose(ranks_on_host=ranks_on_host)
    if choice.threads != torch.get_num_threads():
        torch.set_num_threads(choice.threads)
    if choice != _applied:
        how = (f"meshserve's default, one core left to Python; set {ENV} to choose"
               if choice.source == "meshserve default" else f"as set by {choice.source}")
        log.info("CPU threads: %d torch intra-op thread(s) on %d usable core(s) (%s)", choice.threads, choice.cores,
                 how)
    _applied = choice
    return choice
