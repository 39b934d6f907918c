"""Ray's side of --gpus-per-rank, on a CPU machine: Ray schedules GPUs it is told of whether or not
they exist, so a node started with num_gpus=1 stands for a one-GPU host.

- Two one-rank replicas' placement groups of rank_bundle(gpus_per_rank=0.5) are both placed on the
  one GPU, and their actors are given the same device (ray.get_gpu_ids, CUDA_VISIBLE_DEVICES): the
  condition under which `auto` hands KV over by CUDA IPC (kvtransfer/transport.py).
- check_gpus_suffice reads the live cluster (ray.nodes) and refuses whole-GPU prefill + decode there.
- A coordinator whose pools need GPUs its embedded cluster does not have fails at start-up with that
  error instead of waiting for a placement that cannot come (before this, it waited forever).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from meshserve.cluster.coordinator import ClusterConfig, Coordinator
from meshserve.cluster.executors import ray_executor as rx
from meshserve.cluster.executors.gpu_placement import PoolDemand
from meshserve.config import PoolConfig
from meshserve.demo_model import DEMO_MODEL_DIR
from meshserve.errors import UnavailableError
from tests.integration.ray_cluster import _no_auth
from tests.unit.cluster.cases import engine_config


def test_pools_that_need_missing_gpus_fail_the_start_at_once():
    """No --placement-timeout would end this wait; the one given here only bounds a regression.
    (The demo checkpoint: the coordinator loads its tokenizer, no rank ever starts.)"""
    temp = tempfile.mkdtemp(prefix="msray-", dir="/tmp")
    config = ClusterConfig(engine=engine_config(DEMO_MODEL_DIR),
                           pools=PoolConfig(mode="disaggregated", placement_timeout_s=60), device="cuda",
                           ray_num_cpus=1, ray_temp_dir=temp)
    try:
        with _no_auth(), pytest.raises(UnavailableError) as err:
            asyncio.run(Coordinator(config).start())
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert "the pools' ranks need 2 GPU(s) (prefill 1 x tp=1 x 1 GPU, decode 1 x tp=1 x 1 GPU)" in str(err.value)
    assert "embedded one-node Ray cluster cannot grow" in str(err.value)
    assert "placement-timeout" not in str(err.value)  # refused before any placement group was made
    assert not ray.is_initialized()  # the coordinator stopped the cluster it started


@ray.remote(num_cpus=0)
class _GpuProbe:
    def gpus(self) -> tuple[list, str | None]:
        return [str(g) for g in ray.get_gpu_ids()], os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.fixture
def one_gpu_node():
    """An embedded one-node cluster that says it has one GPU, started as the server starts its own
    (rx.ray_init: loopback, and tried again when a loaded machine misses Ray's start-up deadlines)."""
    temp = tempfile.mkdtemp(prefix="msray-", dir="/tmp")
    with _no_auth():
        rx.ray_init(num_cpus=1, num_gpus=1, temp_dir=temp)
    try:
        yield
    finally:
        rx.ray_shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def test_half_gpu_ranks_of_two_replicas_share_the_one_gpu(one_gpu_node):
    halves = [PoolDemand("prefill", 1, 1, 0.5), PoolDemand("decode", 1, 1, 0.5)]
    rx.check_gpus_suffice(halves, device="cuda", embedded=True)  # fits: no error
    with pytest.raises(UnavailableError, match=r"need 2 GPU\(s\).*--gpus-per-rank 0\.5"):
        rx.check_gpus_suffice([PoolDemand("prefill", 1, 1), PoolDemand("decode", 1, 1)], device="cuda",
                              embedded=True)
    groups, probes = [], []
    try:
        for role in ("prefill", "decode"):  # as RayRanks.launch places a one-rank replica
            bundle = rx.rank_bundle(role, device="cuda", gpus_per_rank=0.5)
            assert bundle == {"GPU": 0.5}
            pg = placement_group([bundle], strategy="STRICT_PACK")
            groups.append(pg)
            ray.get(pg.ready(), timeout=60)
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
            probes.append(_GpuProbe.options(scheduling_strategy=strategy, num_gpus=bundle["GPU"]).remote())
        seen = ray.get([p.gpus.remote() for p in probes], timeout=60)
    finally:
        for probe in probes:
            ray.kill(probe)
        for pg in groups:
            remove_placement_group(pg)
    assert seen[0] == seen[1] == (["0"], "0")
