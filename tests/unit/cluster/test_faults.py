"""Faults (issue 23): a stopped rank is caught by the step deadline, a killed one by its launcher;
either way the replica is failed, killed and rebuilt, health drops at once, and its streams move
to the other replica and finish as an unfaulted run would (the NullWorker's own token function,
or the single-process engine on a tiny checkpoint, is the oracle). A crash loop (a failure, then
rebuilds that fail) ends with full capacity once the faults stop.

Rank processes are real subprocesses (`runtime="processes"`); waits are bounded waits on events
and states, never sleeps.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from dataclasses import replace

import pytest

from meshserve.cluster.coordinator import ClusterConfig
from meshserve.cluster.executors.executor import StepDeadline, WorkerDiedError, WorkerHungError
from meshserve.cluster.migration import continued, plan_failover
from meshserve.cluster.replica import ReplicaState
from meshserve.config import ParallelConfig, PoolConfig
from meshserve.core.beam_params import BeamSearchParams
from meshserve.core.sampling_params import SamplingParams
from meshserve.engine.request import Request, RequestStatus, Ticket
from meshserve.errors import ConfigError, ReplicaFailedError
from tests.null_worker import POISON_TOKEN
from tests.unit.cluster import fault_workers
from tests.unit.cluster.cases import (
    assert_no_held_blocks,
    collect,
    engine_config,
    mixed_requests,
    reference,
    serve,
    wait_for_events,
    wait_until,
)
from tests.unit.cluster.test_coordinator import null_tokens

WORKERS = "tests.unit.cluster.fault_workers"
LONG = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)


def faulty_config(model_dir, *, runtime="processes", worker="PacedNullWorker", tp=1, **pools) -> ClusterConfig:
    engine = engine_config(model_dir)
    engine = replace(engine, parallel=ParallelConfig(tp=tp))
    pools = {"replicas": 2, "step_timeout_base_s": 1.0, "step_timeout_per_token_s": 0.0, **pools}
    return ClusterConfig(engine=engine, pools=PoolConfig(**pools), runtime=runtime,
                         worker_class=f"{WORKERS}:{worker}", health_period_s=0.2)


async def start_streams(c, requests):
    """One task per (id, prompt, params), once every stream has its first delta."""
    started = {rid: asyncio.Event() for rid, _, _ in requests}
    tasks = {rid: asyncio.ensure_future(collect(c, rid, p, sp, started=started[rid])) for rid, p, sp in requests}
    await wait_for_events(started, "every stream's first token", timeout_s=60)
    return tasks


def busiest(c):
    return max(c.replicas(), key=lambda r: r.load)


def test_a_stopped_rank_is_declared_hung_killed_and_its_streams_migrate(tmp_path):
    """One replica of two rank processes (tp=2, the NullWorker all-reducing every step): rank 1
    stopped, rank 0 waits in the all-reduce; the pool has no replica left until the rebuild, and
    the streams continue there."""
    requests = [(f"r{i}", [i + 1, 2, 3], LONG) for i in range(3)]

    async def body(c):
        tasks = await start_streams(c, requests)
        (victim,) = c.replicas()
        rank1 = victim.executor.ranks.procs[1]
        os.kill(rank1.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        await wait_until(lambda: victim.state is ReplicaState.FAILED, "the stopped replica to be declared hung",
                         timeout_s=30, state=c.health)
        detected_s = time.monotonic() - t0
        h = c.health()  # at once: no replica left in the pool
        assert (h.serving, h.healthy_replicas, h.total_replicas) == (False, 0, 1), h
        assert "unified-0 failed: step" in h.detail and "a rank is hung" in h.detail
        assert isinstance(victim.error, WorkerHungError) and "step deadline" in str(victim.error)
        assert 1.5 <= detected_s < 10.0
        results = {rid: await t for rid, t in tasks.items()}
        for rid, prompt, _ in requests:  # a pause, not an error: every token as without the fault
            assert (results[rid].token_ids, results[rid].finish_reason) == (null_tokens(prompt, 100), "length")
        assert rank1.poll() == -signal.SIGKILL  # killed before the slot was rebuilt
        s = c.stats()
        assert (s.num_hung_replicas, s.num_migrations, s.num_migrations_refused) == (1, len(requests), 0)
        assert 1.5 <= s.hung_detection_s < 10.0
        assert c.health().serving and c.pools["unified"].num_rebuilds == 1
        assert_no_held_blocks(c)

    (tmp_path / "null").mkdir()
    serve(faulty_config(tmp_path / "null", tp=2, replicas=1, step_timeout_base_s=1.5), body)


def test_a_killed_rank_process_is_reported_and_its_streams_migrate_at_once(tmp_path):
    """Two replicas of one rank process each; SIGKILL on the busier one's rank: no deadline
    involved (its launcher reports it), the streams move to the other replica."""
    requests = [(f"k{i}", [i + 7, 8, 9], LONG) for i in range(4)]

    async def body(c):
        tasks = await start_streams(c, requests)
        victim = busiest(c)
        held = victim.load  # streams that cannot finish now: a killed rank takes no further step
        (rank0,) = victim.executor.ranks.procs
        os.kill(rank0.pid, signal.SIGKILL)
        results = {rid: await t for rid, t in tasks.items()}
        for rid, prompt, _ in requests:
            assert (results[rid].token_ids, results[rid].finish_reason) == (null_tokens(prompt, 100), "length")
        assert f"rank 0 process (pid {rank0.pid}) died: killed by SIGKILL" in str(victim.error)
        s = c.stats()
        assert (s.num_migrations, s.num_hung_replicas) == (held, 0) and held >= 1
        await wait_until(lambda: c.health().healthy_replicas == 2, "the slot to be rebuilt", timeout_s=60,
                         state=c.health)
        assert_no_held_blocks(c)

    (tmp_path / "null").mkdir()
    serve(faulty_config(tmp_path / "null", step_timeout_base_s=5.0), body)


def test_a_dead_decode_rank_s_greedy_seeded_and_stop_string_streams_continue_token_identical(tiny_llama):
    """The real model, disaggregated (ranks on threads): the streams were handed over with their
    KV to two decode replicas; the rank of the one holding `seeded` dies, and its streams continue
    on the other decode replica, which recomputes their KV. Tokens, text and finish reasons equal
    the single-process engine's."""
    picked = [r for r in mixed_requests() if r[0] in ("text-0", "seeded", "stop-str", "ids-9", "shared-1")]
    want = reference(tiny_llama, picked)

    async def body(c):
        tasks = await start_streams(c, picked)
        await wait_until(lambda: any(t.client_id == "seeded" for r in c.replicas("decode") for t in r._held.values())
                         or tasks["seeded"].done(), "`seeded` to reach a decode replica", timeout_s=60)
        (victim,) = [r for r in c.replicas("decode") if any(t.client_id == "seeded" for t in r._held.values())]
        fault_workers.DyingWorker.doomed = "seeded"
        got = {rid: await t for rid, t in tasks.items()}
        assert isinstance(victim.error, WorkerDiedError) and "rank 0 thread ended" in str(victim.error)
        assert c.stats().num_migrations >= 1  # `seeded` at least moved mid-way
        await wait_until(lambda: c.health().healthy_replicas == 3, "the decode slot to be rebuilt", timeout_s=60,
                         state=c.health)
        return got

    try:
        got = serve(faulty_config(tiny_llama, runtime="threads", worker="DyingWorker", mode="disaggregated",
                                  decode_replicas=2, step_timeout_base_s=5.0), body)
    finally:
        fault_workers.DyingWorker.doomed = None
    for rid, _, _ in picked:
        g, w = got[rid], want[rid]
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason), rid


def test_a_crash_loop_then_quiet_returns_to_full_capacity(tmp_path):
    async def body(c):
        fault_workers.FlakyNullWorker.start_failures = 2  # the crashed slot's next two starts fail
        with pytest.raises(ReplicaFailedError, match="poisoned request"):  # a step that raised: not moved
            await collect(c, "poison", [1, POISON_TOKEN], LONG)
        degraded = c.health()
        assert degraded.serving and degraded.healthy_replicas == 1
        ok = await collect(c, "meanwhile", [4, 5], LONG)  # the other replica serves on
        assert ok.token_ids == null_tokens([4, 5], 100)
        await wait_until(lambda: c.health().healthy_replicas == 2, "full capacity after the crash loop",
                         timeout_s=30, state=c.health)
        h = c.health()
        assert (h.num_rebuilds, h.num_rebuild_failures, h.degraded_s) == (1, 2, 0.0)

    (tmp_path / "null").mkdir()
    try:
        serve(faulty_config(tmp_path / "null", runtime="threads", worker="FlakyNullWorker"), body)
    finally:
        fault_workers.FlakyNullWorker.start_failures = 0


def _ticket(rid, prompt, output, *, streamed, status=RequestStatus.RUNNING):
    req = Request(rid, prompt, SamplingParams(max_tokens=9, seed=3), 0, output_ids=list(output))
    req.status = status
    t = Ticket(rid, req)
    t.num_streamed = streamed
    return t


def test_failover_policy_reruns_untouched_migrates_streamed_and_fails_step_errors():
    def held():
        return {"new": _ticket("new", [1, 2], [], streamed=0, status=RequestStatus.WAITING),
                "mid": _ticket("mid", [1, 2], [7, 8, 9], streamed=2), "spent": _ticket("spent", [3], [4], streamed=1)}

    hung = WorkerHungError("step got no answer", waited_s=1.5)
    h = held()
    h["spent"].migrations = 2
    out = plan_failover("unified-0", h, set(), hung, str(hung), max_migrations=2)
    assert [t.client_id for t in out.rerun] == ["new", "mid"] and (out.num_migrated, out.num_refused) == (1, 1)
    mid = out.rerun[1].request  # continues after the 2 streamed tokens, not the 3 computed
    assert (mid.prompt_ids, mid.output_ids, mid.status, mid.params.seed) == ([1, 2], [7, 8], RequestStatus.WAITING, 3)
    assert out.rerun[1].migrations == 1 and out.rerun[0].request.output_ids == []
    [(spent, err)] = out.failed
    assert spent.client_id == "spent" and "--max-migrations=2" in str(err)

    out = plan_failover("unified-0", held(), set(), RuntimeError("boom"), "RuntimeError: boom", max_migrations=2)
    assert [t.client_id for t in out.rerun] == ["new"]
    assert sorted(t.client_id for t, _ in out.failed) == ["mid", "spent"]
    assert continued(_ticket("x", [1], [2, 3], streamed=0)).output_ids == []


def test_failover_fails_queued_or_running_n_and_beam_requests_and_reruns_them_only_before_the_engine_had_them():
    group = _ticket("group", [1, 2], [], streamed=0, status=RequestStatus.WAITING)
    group.request.params = SamplingParams(max_tokens=9, n=2)
    beam = _ticket("beam", [1, 2], [5], streamed=1)
    beam.request.beam = BeamSearchParams(beam_width=2, max_tokens=9)
    inbox = _ticket("inbox", [1], [], streamed=0, status=RequestStatus.WAITING)
    inbox.request.beam = BeamSearchParams(beam_width=3, max_tokens=4)
    died = WorkerDiedError("rank 0 exited")
    out = plan_failover("unified-0", {"group": group, "beam": beam, "inbox": inbox}, {"inbox"}, died, str(died),
                        max_migrations=2)
    assert [t.client_id for t in out.rerun] == ["inbox"] and out.rerun[0].request.beam.beam_width == 3
    assert sorted(t.client_id for t, _ in out.failed) == ["beam", "group"] and out.num_migrated == 0


def test_step_deadline_grows_with_the_step_and_bad_settings_name_the_field():
    assert StepDeadline(2.0, 0.01).seconds(1000) == pytest.approx(12.0)
    for field, value, allowed in (("step_timeout_base_s", 0.0, r"\[0.1, 604800\]"),
                                  ("step_timeout_per_token_s", -1.0, r"\[0, 10\]"),
                                  ("max_migrations", 101, r"\[0, 100\]")):
        with pytest.raises(ConfigError, match=allowed):
            PoolConfig(**{field: value})


def test_the_progress_watchdog_fails_a_step_thread_that_never_returns(tmp_path):
    """The backstop for executors without their own deadline (the in-process rank)."""
    from meshserve.cluster.replica import Replica

    replica = Replica("unified-0", "unified", engine_config(tmp_path), lambda: None,
                      deadline=StepDeadline(0.1, 0.0))
    release = threading.Event()

    async def main():
        assert await replica._in_thread(lambda x: x + 1, 6) == 7
        with pytest.raises(WorkerHungError, match=r"no progress for 1.2 s \(the progress watchdog\)") as caught:
            await replica._in_thread(release.wait)  # longest step 0.1 s + a call's 0.1 s + the 1 s margin
        release.set()
        return caught.value.waited_s

    try:
        assert asyncio.run(main()) == pytest.approx(1.2)
    finally:
        release.set()
