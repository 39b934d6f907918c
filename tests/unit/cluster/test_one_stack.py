"""The one serving stack: the default `serve` and `LLM.stream` run the Coordinator with in-process
ranks. Oracle: the single-process engine (cases.reference) on a tiny checkpoint."""

import argparse
import asyncio

import pytest

from meshserve.api.serve import add_serve_parser, build_service, configs_of
from meshserve.cluster.coordinator import ClusterConfig, Coordinator, Runtime
from meshserve.config import PoolConfig
from meshserve.errors import ConfigError
from tests.unit.cluster import cases


@pytest.fixture(scope="module")
def ckpt(tiny_llama):
    return tiny_llama


def test_in_process_pool_of_two_overlapping_replicas_matches_the_engine(ckpt):
    want = cases.reference(ckpt, cases.mixed_requests())

    async def main():
        config = ClusterConfig(engine=cases.engine_config(ckpt, async_scheduling=True), pools=PoolConfig(replicas=2),
                               runtime="in-process")  # overlap asked for: unset, a CPU rank steps synchronously
        c = await Coordinator(config).start()
        try:
            assert all(r.core.overlap for r in c.replicas())  # step N+1 is submitted before N is collected
            got = await cases.run_all(c, cases.mixed_requests())
            assert [r.stats().prompt_tokens > 0 for r in c.replicas()] == [True, True]
            cases.assert_no_held_blocks(c)
            return got
        finally:
            await c.shutdown(drain=False)
    cases.assert_same(asyncio.run(main()), want)


def test_in_process_runtime_refuses_what_it_cannot_run(ckpt):
    engine = cases.engine_config(ckpt)
    with pytest.raises(ConfigError, match="pools='disaggregated' is not allowed: 'unified' with runtime=in-process"):
        ClusterConfig(engine=engine, pools=PoolConfig(mode="disaggregated"), runtime="in-process")
    with pytest.raises(ConfigError, match="worker_class"):
        ClusterConfig(engine=engine, runtime="in-process", worker_class="tests.null_worker:NullWorker")
    with pytest.raises(ConfigError, match="core=.*one unified in-process replica"):
        Coordinator(ClusterConfig(engine=engine, runtime="threads"), core=object())


def _service(*flags):
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", *flags])
    engine, pools, _ = configs_of(args)
    return build_service(engine, pools, model_name=None, device="cpu", progress=False)


def test_serve_builds_the_coordinator_for_every_layout():
    """Nothing is started here: the runtime is the only difference between layouts."""
    default = _service()
    assert isinstance(default, Coordinator) and default.config.runtime is Runtime.IN_PROCESS
    assert default.config.pools.replicas == 1 and not default.pools  # not started: run_server starts it
    for flags in (["--replicas", "2"], ["--tp", "2"], ["--pools", "disaggregated"], ["--ray-address", "auto"]):
        service = _service(*flags)
        assert isinstance(service, Coordinator) and service.config.runtime is Runtime.RAY, flags
