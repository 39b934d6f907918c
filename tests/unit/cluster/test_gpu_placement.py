"""GPU placement arithmetic (cluster/executors/gpu_placement.py) and what one rank's bundle asks of
Ray (ray_executor.rank_bundle), against the cluster resources Ray would report: no Ray runs here."""

from __future__ import annotations

import pytest

from meshserve.cluster.executors.gpu_placement import PoolDemand, gpu_shortfall, rank_slots, ranks_per_gpu
from meshserve.cluster.executors.ray_executor import rank_bundle

ONE_GPU = {"CPU": 16.0, "GPU": 1.0, "memory": 1e11}
DISAGG_HALVES = [PoolDemand("prefill", 1, 1, 0.5), PoolDemand("decode", 1, 1, 0.5)]
DISAGG_WHOLE = [PoolDemand("prefill", 1, 1), PoolDemand("decode", 1, 1)]


def test_a_gpu_rank_reserves_its_fraction_of_a_gpu():
    assert rank_bundle("decode", device="cuda", resources=ONE_GPU) == {"GPU": 1.0}
    assert rank_bundle("decode", device="cuda", gpus_per_rank=0.5, resources=ONE_GPU) == {"GPU": 0.5}
    assert rank_bundle("decode", device=None, gpus_per_rank=0.25, resources=ONE_GPU) == {"GPU": 0.25}
    # the pool's own resource (worker nodes advertise it) stays one unit per rank
    with_pools = {**ONE_GPU, "meshserve_decode": 4.0}
    assert rank_bundle("decode", device="cuda", gpus_per_rank=0.5, resources=with_pools) == {
        "meshserve_decode": 1.0, "GPU": 0.5}
    # CPU ranks take no GPU, whatever the fraction
    assert rank_bundle("decode", device="cpu", gpus_per_rank=0.5, resources=ONE_GPU) == {"CPU": 0.01}
    assert rank_bundle("decode", device=None, gpus_per_rank=0.5, resources={"CPU": 2.0}) == {"CPU": 0.01}


@pytest.mark.parametrize(("fraction", "per_gpu"), [(1.0, 1), (0.5, 2), (0.6, 1), (1 / 3, 3), (0.33, 3),
                                                   (0.1, 10), (0.25, 4)])
def test_ranks_per_gpu(fraction, per_gpu):
    assert ranks_per_gpu(fraction) == per_gpu


def test_rank_slots_count_whole_shares_per_gpu():
    assert rank_slots([1.0], 0.5) == 2
    assert rank_slots([2.0, 1.0], 0.6) == 3  # 0.6 + 0.6 never share a GPU: one a GPU
    assert rank_slots([0.0], 0.5) == 0


@pytest.mark.parametrize(("demands", "nodes"), [
    (DISAGG_HALVES, [1.0]),  # the point: prefill and decode on one GPU
    (DISAGG_WHOLE, [2.0]),
    (DISAGG_WHOLE, [1.0, 1.0]),
    ([PoolDemand("unified", 4, 1, 0.25)], [1.0]),
    ([PoolDemand("prefill", 1, 4), PoolDemand("decode", 1, 2)], [4.0, 2.0]),
    ([PoolDemand("prefill", 1, 1, 0.5), PoolDemand("decode", 2, 1, 0.25)], [1.0]),  # mixed: 0.5 + 0.25 + 0.25
])
def test_layouts_that_fit_pass(demands, nodes):
    assert gpu_shortfall(demands, nodes) is None


def test_two_whole_gpu_replicas_on_one_gpu_are_refused_naming_the_fix():
    why = gpu_shortfall(DISAGG_WHOLE, [1.0])
    assert why is not None
    assert "need 2 GPU(s) (prefill 1 x tp=1 x 1 GPU, decode 1 x tp=1 x 1 GPU)" in why
    assert "room for 1 rank(s) of 1 GPU on 1 GPU(s)" in why
    assert "--gpus-per-rank 0.5" in why and "fewer replicas (--replicas, --prefill-replicas, --decode-replicas)" in why


def test_fractions_that_do_not_share_a_gpu_are_counted_per_gpu():
    why = gpu_shortfall([PoolDemand("unified", 3, 1, 0.6)], [2.0])  # 1.8 GPUs in all, but one a GPU
    assert why is not None and "need 1.8 GPU(s)" in why and "room for 2 rank(s) of 0.6 GPU on 2 GPU(s)" in why
    three = gpu_shortfall([PoolDemand("unified", 3, 1, 0.5)], [1.0])
    assert three is not None and "--gpus-per-rank 0.33" in three  # 3 x 0.33 fits one GPU


def test_no_gpus_at_all_and_tp_too_wide_for_any_node():
    none = gpu_shortfall(DISAGG_WHOLE, [])
    assert none is not None and "need 2 GPU(s)" in none and "--gpus-per-rank" not in none  # nothing to share
    wide = gpu_shortfall([PoolDemand("decode", 1, 4)], [2.0, 2.0])
    assert wide is not None and "STRICT_PACK" in wide and "--decode-tp" in wide and "largest node" in wide
    tp_over = gpu_shortfall([PoolDemand("unified", 2, 2)], [2.0])
    assert tp_over is not None and "a smaller --tp" in tp_over
