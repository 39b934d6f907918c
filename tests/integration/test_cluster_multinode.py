"""A real multi-node Ray cluster on this machine: `ray start --head` plus two `ray start --address`
nodes, one advertising two units of `meshserve_prefill`, the other one of `meshserve_decode`. The
coordinator joins it by address; the prefill replica (tp=2: both ranks) must land on the prefill
node and the decode replica (tp=1) on the decode node, and the disaggregated outputs (KV moved
between the nodes over zmq, re-sharded from two ranks to one) equal the single-process engine's."""

import asyncio

import pytest

from meshserve.cluster.coordinator import ClusterConfig, Coordinator
from meshserve.config import ParallelConfig, PoolConfig
from tests.integration.ray_cluster import multi_node_ray
from tests.tiny_models import write_checkpoint
from tests.unit.cluster.cases import (
    assert_no_held_blocks,
    assert_same,
    engine_config,
    mixed_requests,
    reference,
    run_all,
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("multinode") / "llama"
    write_checkpoint(path, "llama", seed=4)
    return path


def test_prefill_and_decode_replicas_on_separate_nodes(ckpt):
    requests = mixed_requests()
    want = reference(ckpt, requests)
    with multi_node_ray([{"meshserve_prefill": 2}, {"meshserve_decode": 1}]) as address:
        import ray

        node_of = {res: n["NodeID"] for n in ray.nodes() for res in n["Resources"] if res.startswith("meshserve_")}

        async def main():
            config = ClusterConfig(engine=engine_config(ckpt), pools=PoolConfig(mode="disaggregated",
                                                                                ray_address=address),
                                   prefill_parallel=ParallelConfig(tp=2))
            async with Coordinator(config) as c:
                (prefill,), (decode,) = c.replicas("prefill"), c.replicas("decode")
                placed = {"prefill": prefill.executor.ranks.nodes(), "decode": decode.executor.ranks.nodes()}
                got = await run_all(c, requests)
                assert decode.stats().num_kv_imports > 0 and decode.stats().num_recomputes == 0
                assert_no_held_blocks(c)
                return placed, got

        placed, got = asyncio.run(main())
    assert [n["node_id"] for n in placed["prefill"]] == [node_of["meshserve_prefill"]] * 2
    assert [n["node_id"] for n in placed["decode"]] == [node_of["meshserve_decode"]]
    assert_same(got, want)
