"""Per-expert load statistics of a served MoE model reach /metrics: every (token, slot) row a
layer computes is counted once (tiny GPT-OSS: 2 layers, 4 experts, top-2; CPU; the default
serve's one in-process replica)."""

import asyncio

from prometheus_client import generate_latest

from meshserve.api.metrics import ServerMetrics
from meshserve.cluster.coordinator import ClusterConfig, Coordinator
from meshserve.config import CacheConfig, ModelConfig, SchedulerConfig
from meshserve.core.sampling_params import SamplingParams
from meshserve.engine.engine_config import EngineConfig
from tests.tiny_models import prompts, write_checkpoint

NEW_TOKENS = 5


def test_expert_rows_are_counted_and_exported(tmp_path):
    write_checkpoint(tmp_path / "gpt_oss", "gpt_oss")
    config = EngineConfig(model=ModelConfig(model=str(tmp_path / "gpt_oss"), dtype="float32", max_model_len=128),
                          cache=CacheConfig(block_size=4, num_kv_blocks=160),
                          scheduler=SchedulerConfig(max_num_batched_tokens=16))  # fmt: skip
    batch = prompts(2, seed=4, min_len=10, max_len=30)
    # Each step feeds prompt tokens and every sampled token but the last; top-2: two rows each.
    rows = 2 * sum(len(p) + NEW_TOKENS - 1 for p in batch)

    async def serve():
        # The replica refreshes its counts every RANK_COUNTERS_PERIOD steps and when idle for a health period.
        service = await Coordinator(ClusterConfig(engine=config, runtime="in-process", device="cpu",
                                                  health_period_s=0.1)).start()
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

        async def one(i, prompt):
            async for _ in service.generate(prompt, params, request_id=f"r{i}"):
                pass

        try:
            await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
            deadline = asyncio.get_running_loop().time() + 30
            while (sum(map(sum, service.stats().expert_tokens)) < 2 * rows
                   and asyncio.get_running_loop().time() < deadline):  # bounded: the idle refresh
                await asyncio.sleep(0.05)
            return service.stats(), generate_latest(ServerMetrics(service).registry).decode()
        finally:
            await service.shutdown(drain=False)

    stats, text = asyncio.run(serve())
    assert [len(layer) for layer in stats.expert_tokens] == [4, 4]
    assert [sum(layer) for layer in stats.expert_tokens] == [rows, rows]
    exported = [line for line in text.splitlines() if line.startswith("meshserve_moe_expert_tokens{")]
    assert len(exported) == 8 and sum(float(line.rsplit(" ", 1)[1]) for line in exported) == 2 * rows
