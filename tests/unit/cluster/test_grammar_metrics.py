"""The driver rank's grammar compile counts reach the replica's stats and /metrics, per replica.

A runaway compile (tests/grammar_faults.py: it blocks, as a pathological schema would, and
xgrammar could not stop it) passes grammar_compile_timeout_s on a served replica: its driver
writes the compile off. The oracle is the driver's own GrammarCompiler.stats(), and the exported
text is read back with prometheus_client's parser.
"""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from meshserve.api.metrics import ServerMetrics
from meshserve.cluster.coordinator import ClusterConfig, Coordinator
from meshserve.cluster.service import ServiceHealth, ServiceStats
from meshserve.config import AttentionConfig, CacheConfig, ModelConfig, SchedulerConfig
from meshserve.core.sampling_params import SamplingParams
from meshserve.demo_model import DEMO_MODEL_DIR
from meshserve.engine.engine_config import EngineConfig
from meshserve.errors import ConfigError
from tests.grammar_faults import RUNAWAY, inject_runaways

TIMEOUT_S = 0.5
SERIES = ("meshserve_grammar_compiles_stuck", "meshserve_grammar_compiles_written_off_total",
          "meshserve_grammar_compiles_refused_total")


@pytest.fixture
def runaway_compiles(monkeypatch):
    faults = inject_runaways(monkeypatch)
    yield faults
    faults.set()


def _config() -> ClusterConfig:
    engine = EngineConfig(model=ModelConfig(model=str(DEMO_MODEL_DIR), dtype="float32", max_model_len=256),
                          cache=CacheConfig(num_kv_blocks=64),
                          scheduler=SchedulerConfig(grammar_compile_timeout_s=TIMEOUT_S),
                          attention=AttentionConfig(backend="TORCH"))
    return ClusterConfig(engine=engine, runtime="in-process", health_period_s=0.05)


def _exported(service) -> dict[str, dict[tuple[str, str], float]]:
    """The grammar series of a scrape: name -> {(pool, replica): value}."""
    text = generate_latest(ServerMetrics(service).exposition).decode()
    out: dict[str, dict[tuple[str, str], float]] = {name: {} for name in SERIES}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in out:
                out[s.name][(s.labels["pool"], s.labels["replica"])] = s.value
    return out


async def _until(done, timeout_s: float = 20.0) -> None:
    """Wait (bounded) for the replica's next idle-time read to bring done() about."""
    for _ in range(int(timeout_s / 0.02)):
        if done():
            return
        await asyncio.sleep(0.02)
    assert done()


def test_a_written_off_compile_is_counted_in_the_replicas_stats_and_exported(runaway_compiles):
    async def main():
        c = await Coordinator(_config()).start()
        try:
            (replica,) = c.replicas()
            builder = replica.core.executor.worker.runner.constraints
            await asyncio.sleep(0.2)  # a few idle reads: a model that compiled nothing reports zeros
            assert builder._compiler is None  # ... without making a compiler for it
            s = replica.stats()
            assert (s.num_grammar_stuck, s.num_grammar_written_off, s.num_grammar_refused) == (0, 0, 0)
            assert _exported(c) == {name: {("unified", "unified-0"): 0, ("unified", "unified-retired"): 0}
                                    for name in SERIES}

            params = SamplingParams(temperature=0, max_tokens=4, structured_outputs=RUNAWAY[0])
            for rid in ("runaway", "again"):  # the second is refused at once: the same grammar still runs
                with pytest.raises(ConfigError, match="structured_outputs"):
                    async for _ in c.generate("Answer:", params, request_id=rid):
                        pass
            oracle = builder.compile_stats()
            assert (oracle.num_stuck, oracle.num_written_off, oracle.num_refused) == (1, 1, 1)
            await _until(lambda: replica.stats().num_grammar_refused == 1)
            s = replica.stats()
            assert (s.num_grammar_stuck, s.num_grammar_written_off, s.num_grammar_refused) == (1, 1, 1)
            got = _exported(c)
            assert got["meshserve_grammar_compiles_stuck"][("unified", "unified-0")] == 1
            assert got["meshserve_grammar_compiles_written_off_total"][("unified", "unified-0")] == 1
            assert got["meshserve_grammar_compiles_refused_total"][("unified", "unified-0")] == 1
            assert all(got[name][("unified", "unified-retired")] == 0 for name in SERIES)

            # When the runaway ends by itself the gauge falls back; the counters stay.
            runaway_compiles.set()
            await _until(lambda: replica.stats().num_grammar_stuck == 0)
            got = _exported(c)
            assert [got[name][("unified", "unified-0")] for name in SERIES] == [0, 1, 1]
        finally:
            await c.shutdown(drain=False)

    asyncio.run(main())


def test_no_rows_no_grammar_series():
    """A service without replicas' rows (an embedding service) exports no grammar series."""
    class Empty:
        def stats(self) -> ServiceStats:
            return ServiceStats(0, 0, 0.0, 0, 0, 0, 0, 0)

        def health(self) -> ServiceHealth:
            return ServiceHealth(True, 1, 1)

        def models(self):
            return []

    assert _exported(Empty()) == {name: {} for name in SERIES}
