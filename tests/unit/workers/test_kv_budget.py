"""A CUDA rank's automatic KV budget (workers/kv_budget.py, gpu_kv_budget) when replicas share a GPU
(ParallelConfig.gpus_per_rank < 1), in plain numbers: what cudaMemGetInfo and the caching allocator
would report to each of two replicas loading one after the other on one card."""

from __future__ import annotations

import torch

from meshserve.config import CacheConfig
from meshserve.workers.kv_budget import GPU_KV_FRACTION, gpu_kv_budget, num_kv_blocks

GIB = 1 << 30
CARD = 80 * GIB
CONTEXT = GIB // 2  # a CUDA context: outside torch's allocator, inside the card's used memory
WEIGHTS = 16 * GIB
GRAPHS = GIB  # the decode graphs' pool (reserve)


def budget(free: int, fraction: float) -> int:
    return gpu_kv_budget(free=free, total=CARD, allocated=WEIGHTS, reserve=GRAPHS, utilization=GPU_KV_FRACTION,
                         gpus_per_rank=fraction)


def test_a_whole_gpu_rank_takes_its_share_of_the_free_memory():
    free = CARD - CONTEXT - WEIGHTS
    assert budget(free, 1.0) == int((free - GRAPHS) * GPU_KV_FRACTION)


def test_two_half_gpu_replicas_get_the_same_budget_whichever_loads_first():
    first_free = CARD - CONTEXT - WEIGHTS  # the other replica has not started
    first = budget(first_free, 0.5)
    assert first == int((CARD // 2 - WEIGHTS - GRAPHS) * GPU_KV_FRACTION)
    # the second sees the first's context, weights, graphs and KV in use
    second_free = first_free - CONTEXT - WEIGHTS - GRAPHS - first
    second = budget(second_free, 0.5)
    assert second == first
    assert 2 * (CONTEXT + WEIGHTS + GRAPHS) + first + second <= CARD  # both fit the card
    # counted as a whole-GPU rank counts (the free memory), the first would take so much of the card
    # that the second could not even load its weights
    greedy = budget(first_free, 1.0)
    assert first_free - CONTEXT - GRAPHS - greedy < WEIGHTS


def test_a_share_never_exceeds_what_is_free():
    assert budget(4 * GIB, 0.5) == int((4 * GIB - GRAPHS) * GPU_KV_FRACTION)
    assert budget(GIB // 2, 0.5) == 0  # less free than the graphs' pool: nothing, not a negative budget


def test_given_bytes_or_blocks_win_over_any_fraction():
    cpu = torch.device("cpu")
    assert num_kv_blocks(CacheConfig(kv_cache_memory_bytes=64 << 20), cpu, 1 << 20, gpus_per_rank=0.5) == 64
    assert num_kv_blocks(CacheConfig(num_kv_blocks=7), cpu, 1 << 20, gpus_per_rank=0.5) == 7
