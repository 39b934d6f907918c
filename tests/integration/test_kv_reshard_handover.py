"""Disaggregated pools of different (tp, dcp) layouts hand KV over by re-sharding it (no
recompute), through the coordinator with ranks in processes (gloo): every request's greedy
tokens equal the single-process engine's, the decode replica imported every prompt (by NIXL
when installed), and every socket of the process tree listens on loopback only.

The pairs cover into and out of DCP and a change of both tp and dcp (the issue's prefill tp1 ->
decode tp2/dcp2 first). tests/unit/kvstore/test_reshard.py checks the
re-shard of every pair of layouts up to tp 4 against the unsharded KV; processes on two cores
make every pair here too slow for CI.
"""

import asyncio

import pytest

from meshserve.cluster.coordinator import ClusterConfig, Coordinator
from meshserve.config import ParallelConfig, PoolConfig
from meshserve.core.sampling_params import SamplingParams
from meshserve.kvtransfer.nixl_transport import nixl_available
from tests.integration.test_listen_loopback import non_loopback_listeners
from tests.tiny_models import prompts, write_checkpoint
from tests.unit.cluster.cases import Result, assert_no_held_blocks, assert_same, collect, engine_config, reference

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple:
    """(checkpoint, requests, the single-process engine's results)."""
    path = tmp_path_factory.mktemp("reshard") / "llama"
    write_checkpoint(path, "llama", seed=5)
    # 20-75 tokens: several 16-token blocks per rank, a partial last block at every dcp
    requests = [(f"r{i}", p, PARAMS) for i, p in enumerate(prompts(3, seed=41, min_len=20, max_len=75))]
    want: dict[str, Result] = reference(path, requests)
    return path, requests, want


@pytest.mark.parametrize(("src", "dst"), [((1, 1), (2, 2)), ((2, 2), (1, 1)), ((2, 2), (4, 1))],
                         ids=lambda layout: f"tp{layout[0]}dcp{layout[1]}")
def test_handover_between_layouts_reshards_with_identical_tokens(setup, src, dst):
    ckpt, requests, want = setup
    config = ClusterConfig(engine=engine_config(ckpt), pools=PoolConfig(mode="disaggregated"), runtime="processes",
                           prefill_parallel=ParallelConfig(tp=src[0], dcp=src[1]),
                           decode_parallel=ParallelConfig(tp=dst[0], dcp=dst[1]), handover_timeout_s=60.0)

    async def main():
        coord = await Coordinator(config).start()
        try:
            got = {rid: await collect(coord, rid, p, sp) for rid, p, sp in requests}
            (decode,) = coord.replicas("decode")
            stats = decode.stats()
            assert (stats.num_kv_imports, stats.num_recomputes) == (len(requests), 0), stats
            # kv_transport auto: each decode rank READs its heads and tokens by NIXL when installed
            assert set(stats.handover.transports) == ({"nixl"} if nixl_available() else {"zmq"}), stats
            assert_no_held_blocks(coord)
            # every socket the ranks (processes, gloo, export servers, NIXL/UCX) listen on: loopback
            assert non_loopback_listeners() == []
            return got
        finally:
            await coord.shutdown(drain=False)

    assert_same(asyncio.run(main()), want)
