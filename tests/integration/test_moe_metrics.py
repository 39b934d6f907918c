"""Per-expert load statistics of a served MoE model reach /metrics: every (token, slot) row a
layer computes is counted once (tiny GPT-OSS: 2 layers, 4 experts, top-2; CPU)."""

import asyncio

from prometheus_client import generate_latest

from meshserve.api.metrics import ServerMetrics
from meshserve.cluster.engine import EngineConfig
from meshserve.cluster.local import LocalService
from meshserve.config import CacheConfig, ModelConfig, SchedulerConfig
from meshserve.core.sampling_params import SamplingParams
from tests.tiny_models import prompts, write_checkpoint

NEW_TOKENS = 5


def test_expert_rows_are_counted_and_exported(tmp_path):
    write_checkpoint(tmp_path / "gpt_oss", "gpt_oss")
    config = EngineConfig(model=ModelConfig(model=str(tmp_path / "gpt_oss"), dtype="float32", max_model_len=128),
                          cache=CacheConfig(block_size=4, num_kv_blocks=160),
                          scheduler=SchedulerConfig(max_num_batched_tokens=16))  # fmt: skip
    batch = prompts(2, seed=4, min_len=10, max_len=30)

    async def serve():
        service = LocalService(config, device="cpu")
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

        async def one(i, prompt):
            async for _ in service.generate(prompt, params, request_id=f"r{i}"):
                pass

        await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
        try:
            return service.stats(), generate_latest(ServerMetrics(service).registry).decode()
        finally:
            await service.shutdown()

    stats, text = asyncio.run(serve())
    # Each step feeds prompt tokens and every sampled token but the last; top-2: two rows each.
    rows = 2 * sum(len(p) + NEW_TOKENS - 1 for p in batch)
    assert [len(layer) for layer in stats.expert_tokens] == [4, 4]
    assert [sum(layer) for layer in stats.expert_tokens] == [rows, rows]
    exported = [line for line in text.splitlines() if line.startswith("meshserve_moe_expert_tokens{")]
    assert len(exported) == 8 and sum(float(line.rsplit(" ", 1)[1]) for line in exported) == 2 * rows
