"""The cluster on a local Ray: unified and disaggregated pools against the single-process engine,
KV hand-over failures and a killed worker actor (its streams migrate to the other replica). The
disaggregated coordinator runs prefill at tp=1 and decode at tp=2: its decode replica is two
gang-scheduled actors, and every hand-over re-shards KV heads between the pools. After the
hand-overs nothing of this process tree listens off loopback: the embedded Ray's servers, the
channels, the prefill rank's KV export server and the ranks' NIXL agents.

One Ray session and one coordinator per mode serve the whole module (actors load in seconds
each on two busy cores). The oracle is the single-process engine on the same tiny checkpoint.
"""

import asyncio
import os
import signal

import pytest

from meshserve.cluster.coordinator import ClusterConfig, Coordinator
from meshserve.config import ParallelConfig, PoolConfig
from meshserve.core.sampling_params import SamplingParams
from meshserve.errors import UnavailableError
from tests.integration.ray_cluster import embedded_ray
from tests.integration.test_listen_loopback import non_loopback_listeners
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
    wait_until,
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
    """Unified (2 replicas) and disaggregated (1 prefill at tp=1, 1 decode at tp=2), started together."""
    with embedded_ray():
        engine = engine_config(ckpt)
        unified = Coordinator(ClusterConfig(engine=engine, pools=PoolConfig(replicas=2), health_period_s=0.5))
        disagg = Coordinator(ClusterConfig(engine=engine, pools=PoolConfig(mode="disaggregated"),
                                           decode_parallel=ParallelConfig(tp=2)))
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
    assert decode.stats().num_kv_imports == handed and decode.stats().num_recomputes == 0  # re-sharded 1 -> 2
    nodes = decode.executor.ranks.nodes()  # a tp=2 replica: two actors packed on one node
    assert len({n["node_id"] for n in nodes}) == 1 and len({n["pid"] for n in nodes}) == 2
    assert {n["ip"] for n in nodes} == {"127.0.0.1"}  # the embedded node is on loopback
    assert non_loopback_listeners() == []
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


def test_a_killed_worker_actor_s_streams_migrate_token_identical_and_it_is_rebuilt(coordinators, want, loop):
    c = coordinators["unified"]
    victim = c.replicas()[0]
    pid = victim.executor.ranks.nodes()[0]["pid"]
    before = c.stats().num_migrations

    async def scenario():
        streams = {rid: asyncio.ensure_future(collect(c, rid, p, sp)) for rid, p, sp in LONG_REQUESTS}
        await wait_until(lambda: victim.stats().num_running > 0 and victim.stats().generated_tokens >= 8,
                         "requests mid-generation on the victim replica", timeout_s=120, state=victim.stats)
        moving = victim.load  # the killed actor takes no further step: every one of them must move
        os.kill(pid, signal.SIGKILL)
        done = await asyncio.gather(*streams.values(), return_exceptions=True)
        await wait_until(lambda: c.health().serving and c.health().healthy_replicas == 2,
                         "the pool to rebuild the killed replica (2 healthy replicas)", timeout_s=240,
                         state=c.health, poll_s=0.1)
        after = await run_all(c, mixed_requests()[:6])
        return dict(zip(streams, done)), moving, after

    done, moving, after = loop.run_until_complete(scenario())
    assert moving >= 1, "no request was on the killed replica"
    for rid, r in done.items():  # the client saw a pause, not an error
        assert isinstance(r, Result) and r.token_ids == want[rid].token_ids, (rid, r)
    assert "actor" in str(victim.error) and "died" in str(victim.error), str(victim.error)
    assert c.stats().num_migrations - before == moving
    assert c.replicas()[0] is not victim and c.pools["unified"].num_rebuilds == 1
    assert_same(after, {rid: want[rid] for rid, _, _ in mixed_requests()[:6]})
    assert_no_held_blocks(c)


def test_a_placement_that_cannot_happen_times_out_or_waits_until_stopped(coordinators, ckpt, loop):
    """device cuda on a cluster without GPUs: the placement group can never be satisfied."""
    engine = engine_config(ckpt)
    bounded = Coordinator(ClusterConfig(engine=engine, pools=PoolConfig(placement_timeout_s=2), device="cuda"))
    with pytest.raises(UnavailableError, match=r"unified-0: no Ray node can host 1 rank\(s\) of \{'GPU': 1.0\} yet "
                                               r".*gave up after --placement-timeout=2 s"):
        loop.run_until_complete(asyncio.wait_for(bounded.start(), 60))

    forever = Coordinator(ClusterConfig(engine=engine, device="cuda"))  # the default: wait as long as it takes

    async def body():
        starting = asyncio.ensure_future(forever.start())
        await wait_until(lambda: bool(forever.replicas()), "the replica to start", timeout_s=30)
        health = forever.health()
        assert not health.serving and health.unserving_s is None and not starting.done()
        await forever.shutdown(drain=False)  # ends the wait within a second
        with pytest.raises(UnavailableError, match="stopped while waiting for Ray to place its ranks"):
            await asyncio.wait_for(starting, 30)

    loop.run_until_complete(body())
