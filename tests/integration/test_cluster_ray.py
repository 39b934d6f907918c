"""The cluster on a local Ray: unified and disaggregated pools against the single-process engine,
KV hand-over failures, a killed worker actor, and a tp=2 replica gang-scheduled as two actors.

One Ray session and one coordinator per mode serve the whole module (actors load in seconds
each on two busy cores). The oracle is the single-process engine on the same tiny checkpoint.
"""

import asyncio
import os
import signal
import time

import pytest

from meshserve.cluster.coordinator import ClusterConfig, Coordinator
from meshserve.cluster.engine import EngineConfig, EngineCore
from meshserve.cluster.null_worker import next_token
from meshserve.cluster.ray_executor import RayExecutor
from meshserve.config import CacheConfig, ModelConfig, ParallelConfig, PoolConfig
from meshserve.errors import ReplicaFailedError
from meshserve.workers.sampling_params import SamplingParams
from tests.integration.ray_cluster import embedded_ray
from tests.tiny_models import write_checkpoint
from tests.unit.cluster.cases import (
    Result,
    assert_no_held_blocks,
    assert_same,
    collect,
    engine_config,
    mixed_requests,
    reference,
    run_all,
)

LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
LONG_REQUESTS = [(f"long-{i}", [10 + i, 20, 30, 40], LONG) for i in range(4)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ray") / "llama"
    write_checkpoint(path, "llama", seed=4)
    return path


@pytest.fixture(scope="module")
def want(ckpt):
    return reference(ckpt, mixed_requests() + LONG_REQUESTS)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def coordinators(ckpt, loop):
    """Unified (2 replicas) and disaggregated (1 prefill + 1 decode), started together."""
    with embedded_ray():
        engine = engine_config(ckpt)
        unified = Coordinator(ClusterConfig(engine=engine, pools=PoolConfig(replicas=2), health_period_s=0.5))
        disagg = Coordinator(ClusterConfig(engine=engine, pools=PoolConfig(mode="disaggregated")))
        loop.run_until_complete(_both(unified.start(), disagg.start()))
        try:
            yield {"unified": unified, "disaggregated": disagg}
        finally:
            loop.run_until_complete(_both(unified.shutdown(drain=False), disagg.shutdown(drain=False)))


async def _both(a, b):
    await asyncio.gather(a, b)


def test_unified_pool_on_ray_matches_the_single_process_engine(coordinators, want, loop):
    c = coordinators["unified"]
    got = loop.run_until_complete(run_all(c, mixed_requests()))
    assert_same(got, want)
    assert all(r.stats().prompt_tokens > 0 for r in c.replicas())  # both replicas served
    assert_no_held_blocks(c)


def test_disaggregated_pools_on_ray_hand_kv_over(coordinators, want, loop):
    c = coordinators["disaggregated"]
    got = loop.run_until_complete(run_all(c, mixed_requests()))
    assert_same(got, want)
    (decode,) = c.replicas("decode")
    handed = sum(1 for r in want.values() if 1 < len(r.token_ids)) - len(LONG_REQUESTS)
    assert decode.stats().num_kv_imports == handed and decode.stats().num_recomputes == 0
    assert_no_held_blocks(c)


def test_failed_hand_overs_on_ray_are_recomputed_with_identical_tokens(coordinators, want, loop):
    c = coordinators["disaggregated"]
    (prefill,), (decode,) = c.replicas("prefill"), c.replicas("decode")
    before = decode.stats().num_recomputes
    picked = [mixed_requests()[i] for i in (2, 12)]
    for fault in ("checksum", "withdraw"):
        prefill.inject_fault(fault)

    async def one_at_a_time():  # each hand-over meets its own fault
        return {rid: await collect(c, rid, p, sp) for rid, p, sp in picked}
    got = loop.run_until_complete(one_at_a_time())
    assert_same(got, {rid: want[rid] for rid, _, _ in picked})
    assert decode.stats().num_recomputes == before + 2
    assert_no_held_blocks(c)


def test_a_killed_worker_actor_fails_its_requests_fast_and_is_rebuilt(coordinators, want, loop):
    c = coordinators["unified"]
    victim = c.replicas()[0]
    pid = victim.executor.ranks.nodes()[0]["pid"]

    async def scenario():
        streams = {rid: asyncio.ensure_future(collect(c, rid, p, sp)) for rid, p, sp in LONG_REQUESTS}
        while victim.stats().num_running == 0 or victim.stats().generated_tokens < 8:
            await asyncio.sleep(0.01)  # mid-generation on the victim
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        done = await asyncio.gather(*streams.values(), return_exceptions=True)
        failed_at = time.monotonic()
        while not (c.health().serving and c.health().healthy_replicas == 2):
            await asyncio.sleep(0.1)
        after = await run_all(c, mixed_requests()[:6])
        return dict(zip(streams, done)), failed_at - killed, after

    done, latency, after = loop.run_until_complete(scenario())
    failures = {rid: r for rid, r in done.items() if isinstance(r, BaseException)}
    assert failures, "no request was on the killed replica"
    for exc in failures.values():
        assert isinstance(exc, ReplicaFailedError), exc
        assert "unified-0 failed" in str(exc) and "actor" in str(exc) and "died" in str(exc), str(exc)
    for rid, r in done.items():
        if rid not in failures:
            assert isinstance(r, Result) and r.token_ids == want[rid].token_ids
    assert latency < 5.0  # the requirement: in-flight requests learn within 5 s
    assert c.replicas()[0] is not victim and c.pools["unified"].num_rebuilds == 1
    assert_same(after, {rid: want[rid] for rid, _, _ in mixed_requests()[:6]})
    assert_no_held_blocks(c)


def test_tp2_replica_is_two_gang_scheduled_actors_on_one_node(coordinators, tmp_path):
    cfg = EngineConfig(model=ModelConfig(model=str(tmp_path)), cache=CacheConfig(num_kv_blocks=64),
                       parallel=ParallelConfig(tp=2))
    executor = RayExecutor(cfg, name="tp2", worker_class="meshserve.cluster.null_worker:NullWorker")
    core = EngineCore(cfg, executor=executor)
    try:
        nodes = executor.ranks.nodes()
        assert len({n["node_id"] for n in nodes}) == 1 and len({n["pid"] for n in nodes}) == 2
        params = SamplingParams(temperature=0, max_tokens=5)
        core.add_request([3, 1, 4, 1, 5], params, request_id="pi")
        tokens = []
        while core.has_unfinished():
            tokens += [t for d in core.step() for t in d.token_ids]
        seq = [3, 1, 4, 1, 5]
        for _ in range(5):
            seq.append(next_token(seq))
        assert tokens == seq[5:]  # each step all-reduced across both actors (NullWorker checks agreement)
        assert [h["started"] for h in executor.check_health()] == [True, True]
    finally:
        core.shutdown()
