"""The start-up warm-up (engine/warmup.py): three greedy requests through the engine before any
client's, leaving nothing behind.

Oracle: the same engine built without the warm-up. Greedy and unseeded sampled requests must get
the same tokens from both (the warm-up's rows draw nothing from the sampler's generator), the KV
pool must be as free, and no prefix of the warm-up's prompts may stay cached.
"""

from __future__ import annotations

import logging

import pytest

from meshserve.config import AttentionConfig, CacheConfig, ModelConfig, SchedulerConfig
from meshserve.core.sampling_params import SamplingParams
from meshserve.demo_model import DEMO_MODEL_DIR
from meshserve.engine import warmup as warmup_module
from meshserve.engine.engine_config import EngineConfig
from meshserve.engine.engine_core import EngineCore
from meshserve.engine.local_executor import LocalExecutor
from meshserve.errors import ConfigError

PROMPTS = ["The for statement is used to iterate over", "An exception is raised when", "Lists are"]
MAX_STEPS = 200


def _engine(warmup: bool, *, num_kv_blocks: int = 64, max_model_len: int = 256, **scheduler) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(model=str(DEMO_MODEL_DIR), dtype="float32", max_model_len=max_model_len, seed=7,
                          warmup=warmup),
        cache=CacheConfig(num_kv_blocks=num_kv_blocks, block_size=16, enable_prefix_caching=True),
        scheduler=SchedulerConfig(**scheduler),
        attention=AttentionConfig(backend="TORCH"),
    )
    return EngineCore(config, device="cpu", progress=False)


def _generate(core: EngineCore, params: SamplingParams) -> list[list[int]]:
    reqs = [core.add_request(p, params) for p in PROMPTS]
    for _ in range(MAX_STEPS):
        if not core.has_unfinished():
            return [list(r.output_ids) for r in reqs]
        core.step()
    raise AssertionError("the requests did not finish")


@pytest.fixture(scope="module")
def engines():
    warm, cold = _engine(True), _engine(False)
    yield warm, cold
    warm.shutdown()
    cold.shutdown()


def test_warmup_runs_the_cached_prefix_path_and_leaves_nothing_behind(engines):
    warm, cold = engines
    assert cold.warmup is None
    report = warm.warmup
    assert report is not None and report.requests == 3
    # the third prompt extends the first (40 tokens): its two whole 16-token blocks came from the cache
    assert report.cached_tokens == 32
    assert not warm.has_unfinished()
    assert warm.kv.num_requests == 0
    assert warm.kv.num_free_blocks == cold.kv.num_free_blocks == cold.kv.num_total_blocks
    tokens = warmup_module._tokens(warm.info.vocab_size, 40)
    assert warm.kv.lookup_prefix(tokens).num_tokens == 0  # its hashes were forgotten
    assert warm.scheduler.stats == cold.scheduler.stats  # the metrics' counters start from zero
    warm.kv.check_invariants()


def test_tokens_after_the_warmup_are_those_without_it(engines):
    warm, cold = engines
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    assert _generate(warm, greedy) == _generate(cold, greedy)
    # unseeded rows draw from the sampler's generator (seeded by ModelConfig.seed): the warm-up's
    # greedy rows must not have advanced it
    sampled = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12)
    assert _generate(warm, sampled) == _generate(cold, sampled)


def test_warmup_is_skipped_where_the_engine_cannot_hold_it(caplog):
    with caplog.at_level(logging.INFO, logger="meshserve.engine"):
        # 48 tokens of context: the warm-up's 77- and 61-token prompts are refused by admission
        core = _engine(True, num_kv_blocks=4, max_model_len=48)
    try:
        assert core.warmup is None
        assert any("warm-up skipped" in r.getMessage() for r in caplog.records)
        out = _generate(core, SamplingParams(temperature=0.0, max_tokens=4))
        assert all(len(o) == 4 for o in out) and core.kv.num_free_blocks == core.kv.num_total_blocks
    finally:
        core.shutdown()


def test_warmup_is_skipped_where_its_prompts_cannot_be_scheduled(caplog):
    with caplog.at_level(logging.INFO, logger="meshserve.engine"):  # 77 prompt tokens, 64 a step, no chunks
        core = _engine(True, max_model_len=128, enable_chunked_prefill=False, max_num_batched_tokens=64)
    try:
        assert core.warmup is None and core.kv.num_free_blocks == core.kv.num_total_blocks
        assert not core.has_unfinished()
        assert any("warm-up skipped" in r.getMessage() and "max_num_batched_tokens" in r.getMessage()
                   for r in caplog.records)
    finally:
        core.shutdown()


def test_a_failing_warmup_fails_the_start_and_stops_the_worker(monkeypatch):
    stopped = []
    real_shutdown = LocalExecutor.shutdown

    def shutdown(self):
        stopped.append(self)
        real_shutdown(self)

    def broken(core, requests):
        raise RuntimeError("kernel launch failed")

    monkeypatch.setattr(LocalExecutor, "shutdown", shutdown)
    monkeypatch.setattr(warmup_module, "_run", broken)
    with pytest.raises(RuntimeError, match="kernel launch failed"):
        _engine(True)
    assert len(stopped) == 1


def test_the_setting_is_checked_and_defaults_to_cuda_only():
    with pytest.raises(ConfigError, match="warmup"):
        ModelConfig(model=str(DEMO_MODEL_DIR), warmup="yes")
    assert warmup_module.wants_warmup(None, "cuda") and not warmup_module.wants_warmup(None, "cpu")
    assert warmup_module.wants_warmup(True, "cpu") and not warmup_module.wants_warmup(False, "cuda")


def test_the_warmups_expert_rows_are_not_counted(tmp_path):
    """A MoE model's per-expert row counts (the expert-load metric) count clients' rows only: the
    warm-up's tokens are routed like any others, and the engine zeroes the counts after it.
    Oracle: the counts after one client request equal the same request's on an engine without
    the warm-up."""
    from tests.tiny_models import write_checkpoint

    write_checkpoint(tmp_path / "moe", "gpt_oss")

    def engine(warmup: bool) -> EngineCore:
        config = EngineConfig(
            model=ModelConfig(model=str(tmp_path / "moe"), dtype="float32", max_model_len=256, warmup=warmup),
            cache=CacheConfig(num_kv_blocks=64, block_size=16, enable_prefix_caching=True),
            attention=AttentionConfig(backend="TORCH"))
        return EngineCore(config, device="cpu", progress=False)

    def loads(core: EngineCore) -> list[list[int]]:
        return core.executor.call("counters", [{}])[0]["expert_load"]

    warm, cold = engine(True), engine(False)
    try:
        assert warm.warmup is not None
        assert {n for layer in loads(warm) for n in layer} == {0}
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        for core in (warm, cold):
            core.add_request(list(range(300, 319)), params)
            while core.has_unfinished():
                core.step()
        assert loads(warm) == loads(cold) and sum(map(sum, loads(cold))) > 0
    finally:
        warm.shutdown()
        cold.shutdown()
