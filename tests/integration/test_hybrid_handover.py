"""KV hand-over of a hybrid model (Gemma2: windowed and full layers, one block table per layer
group) from a prefill replica to a decode replica, through the coordinator with ranks on threads:
every group's blocks cross the zmq transport, and the decode replica's tokens equal HF's."""

import asyncio
import dataclasses

import pytest

from meshserve.cluster.coordinator import ClusterConfig, Coordinator
from meshserve.config import PoolConfig
from meshserve.core.sampling_params import SamplingParams
from tests.tiny_models import hf_greedy, prompts, write_checkpoint
from tests.unit.cluster.cases import assert_no_held_blocks, collect, engine_config

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid_handover") / "gemma2"
    return path, write_checkpoint(path, "gemma2")


def test_disaggregated_hybrid_model_hands_every_group_over_and_matches_hf(gemma2):
    path, hf = gemma2
    batch = prompts(3, seed=31, min_len=40, max_len=60)  # chunks of 16: the windows release during prefill
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in batch]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine = engine_config(path)
    engine = dataclasses.replace(engine, scheduler=dataclasses.replace(engine.scheduler, max_num_batched_tokens=16))
    config = ClusterConfig(engine=engine,
                           pools=PoolConfig(mode="disaggregated"), runtime="threads")

    async def main():
        coord = await Coordinator(config).start()
        try:
            got = await asyncio.gather(*(collect(coord, f"r{i}", p, params) for i, p in enumerate(batch)))
            (prefill,), (decode,) = coord.replicas("prefill"), coord.replicas("decode")
            assert prefill.core.kv.num_groups == 3 and decode.core.kv.num_groups == 3
            assert prefill.core.kv.stats.window_released_blocks > 0  # windowed groups sent fewer blocks
            assert decode.stats().num_kv_imports == len(batch) and decode.stats().num_recomputes == 0
            assert_no_held_blocks(coord)
            return got
        finally:
            await coord.shutdown(drain=False)

    got = asyncio.run(main())
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.token_ids == w, f"prompt {i}: meshserve {g.token_ids} != HF {w}"
