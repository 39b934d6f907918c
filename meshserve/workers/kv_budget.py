"""How many KV blocks a worker allocates: the byte budget and the decode graphs' share of it.

The budget is, first to apply: CacheConfig.num_kv_blocks (a count), kv_cache_memory_bytes, on
CUDA a fraction (memory_utilization, default 0.85) of the memory still free once the weights are
loaded (less what the decode graphs' activation pool will take, measured by one eager probe step),
on CPU memory_utilization of the host's available memory when it is set, else a fixed default.

A rank that reserves a fraction of its GPU (ParallelConfig.gpus_per_rank < 1: replicas sharing a
card) counts only its share: of gpus_per_rank x the card's memory, what its own tensors (weights)
do not hold yet, and never more than is free (gpu_kv_budget). That does not depend on whether the
other replicas on the card loaded first, which plain free memory would: the first to load would
take 85% of the card and leave the next too little.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from meshserve.attention.backend import AttentionBackend
from meshserve.attention.spec import AttentionSpec
from meshserve.config import CacheConfig
from meshserve.core.sampling_params import SamplingParams
from meshserve.kvstore.cache_tensors import allocate_caches
from meshserve.kvstore.groups import KVGroupLayout
from meshserve.workers.models.contract import GenerativeModel
from meshserve.workers.runner import ModelRunner
from meshserve.workers.step import NewRequest, StepPlan

CPU_DEFAULT_KV_BYTES = 256 << 20
GPU_KV_FRACTION = 0.85  # of the memory still free once weights are loaded


def available_host_memory() -> int:
    """Bytes the host can still hand out without swapping (MemAvailable; free pages where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def gpu_kv_budget(*, free: int, total: int, allocated: int, reserve: int, utilization: float,
                  gpus_per_rank: float = 1.0) -> int:
    """KV bytes of a CUDA rank's automatic budget: `utilization` of what is left of its memory,
    less `reserve` (the decode graphs' pool). free, total: the GPU's (cudaMemGetInfo); allocated:
    bytes this process's tensors hold (weights). A whole-GPU rank's memory is the free memory; a
    rank of gpus_per_rank < 1 has its share of the card, gpus_per_rank x total, less what it holds."""
    left = free if gpus_per_rank >= 1 else min(free, int(gpus_per_rank * total) - allocated)
    return int(max(left - reserve, 0) * utilization)


def num_kv_blocks(cache: CacheConfig, device: torch.device, per_block: int, *, reserve: int = 0,
                  gpus_per_rank: float = 1.0) -> int:
    """Blocks of `per_block` bytes the budget holds; reserve: bytes kept out of an automatic GPU
    budget (the decode graphs' pool); gpus_per_rank: the share of its GPU this rank has (gpu_kv_budget)."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if cache.kv_cache_memory_bytes is not None:
        budget = cache.kv_cache_memory_bytes
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = gpu_kv_budget(free=free, total=total, allocated=torch.cuda.memory_allocated(device),
                               reserve=reserve, utilization=cache.memory_utilization or GPU_KV_FRACTION,
                               gpus_per_rank=gpus_per_rank)
    elif cache.memory_utilization is not None:  # --gpu-memory-utilization on a CPU: of the host's free memory
        budget = int(available_host_memory() * cache.memory_utilization)
    else:
        budget = CPU_DEFAULT_KV_BYTES
    return budget // per_block


def decode_peak_bytes(model: GenerativeModel, backends: Sequence[AttentionBackend], specs: Sequence[AttentionSpec],
                      layout: KVGroupLayout, *, block_size: int, dtype: torch.dtype, device: torch.device,
                      batch: int, sample: bool = True) -> int:
    """Peak activation bytes of one eager decode step of `batch` sequences (the largest graph
    batch), over a two-block scratch cache: what the graphs' shared memory pool will hold, plus a
    margin. sample=False: the forward pass alone, no logits (the piecewise graphs' pool: their
    LM head runs outside them)."""
    scratch = allocate_caches(specs, num_blocks=2, block_size=block_size, dtype=dtype, device=device,
                              layer_slots=layout.layer_slots(len(specs)))
    probe = ModelRunner(model, backends=backends, kv_caches=scratch, block_size=block_size, device=device,
                        is_driver=False, layer_groups=layout.group_of_layer(len(specs)))
    ids = [f"probe-{i}" for i in range(batch)]
    params = SamplingParams(max_tokens=1).to_dict()
    # Decode rows (one token after one cached) of requests it announces.
    plan = StepPlan(0, [NewRequest(r, [0, 0], params, context_len=1, num_tokens=1, sample=sample,
                                   block_tables=[[1]] * layout.num_groups) for r in ids], finished=ids)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    probe.execute(plan)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del probe, scratch
    return int(peak * 1.25) + (64 << 20)
