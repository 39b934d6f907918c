"""The coordinator with ranks on threads (no Ray): routing, KV hand-over, refusals, abort, failure.

The ranks are real Workers on a tiny checkpoint; steps and KV hand-overs cross the same zmq
channel and KV transport as with Ray actors. The oracle is the single-process engine.
"""

import asyncio
from dataclasses import replace

import pytest

from meshserve.cluster.coordinator import ClusterConfig, Coordinator
from meshserve.core.outputs import FinishReason
from meshserve.core.sampling_params import SamplingParams
from meshserve.errors import CapacityError, ConfigError, QueueFullError, ReplicaFailedError, UnavailableError
from meshserve.kvtransfer.nixl_transport import nixl_available
from tests.null_worker import POISON_TOKEN, next_token
from tests.unit.cluster.cases import (
    assert_no_held_blocks,
    assert_same,
    collect,
    holds_no_blocks,
    mixed_requests,
    reference,
    run_all,
    serve,
    threads,
    wait_for_events,
    wait_until,
)

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def want(ckpt):
    return reference(ckpt, mixed_requests())


def test_unified_two_replicas_match_the_single_process_engine(ckpt, want):
    async def body(c):
        got = await run_all(c, mixed_requests())
        assert [r.stats().prompt_tokens > 0 for r in c.replicas()] == [True, True]  # both served
        assert_no_held_blocks(c)
        return got
    assert_same(serve(threads(ckpt, replicas=2), body), want)


def test_disaggregated_hands_kv_over_and_matches(ckpt, want):
    async def body(c):
        got = await run_all(c, mixed_requests())
        (prefill,), (decode,) = c.replicas("prefill"), c.replicas("decode")
        handed = sum(1 for r in want.values() if len(r.token_ids) > 1)
        assert prefill.stats().num_handoffs == handed
        assert decode.stats().num_kv_imports == handed and decode.stats().num_recomputes == 0
        # kv_transport auto: NIXL moves every hand-over when it is installed (a regular dependency)
        assert decode.stats().handover.transports == ({"nixl": handed} if nixl_available() else {"zmq": handed})
        assert_no_held_blocks(c)  # the prefill side released every pin
        return got
    assert_same(serve(threads(ckpt, "disaggregated"), body), want)


@pytest.mark.parametrize("fault", ["checksum", "withdraw"])
def test_a_failed_hand_over_is_recomputed_with_identical_tokens(ckpt, want, fault):
    rid, prompt, params = mixed_requests()[7]

    async def body(c):
        (prefill,), (decode,) = c.replicas("prefill"), c.replicas("decode")
        prefill.inject_fault(fault)
        got = await collect(c, rid, prompt, params)
        assert decode.stats().num_recomputes == 1 and decode.stats().num_kv_imports == 0
        assert_no_held_blocks(c)
        return got
    got = serve(threads(ckpt, "disaggregated"), body)
    assert (got.token_ids, got.text) == (want[rid].token_ids, want[rid].text)


def test_refusals_leave_nothing_behind(ckpt):
    async def body(c):
        before = c.stats()
        bad = [([], GREEDY, ConfigError), ([1, 2, 10_000], GREEDY, ConfigError),
               (list(range(1, 300)), GREEDY, ConfigError),  # longer than max_model_len
               ([1, 2, 3], SamplingParams(stop_token_ids=(10_000,)), ConfigError)]
        for prompt, params, error in bad:
            with pytest.raises(error):
                await collect(c, "bad", prompt, params)
        with pytest.raises(ConfigError, match="max_tokens=60 is not allowed: an integer in \\[1, 57\\]"):  # 199 + 60
            await collect(c, "bad", list(range(1, 200)), SamplingParams(max_tokens=60))
        with pytest.raises(ConfigError, match="task is 'generate'"):
            await c.embed(["hello"])
        assert [m.name for m in c.models()] == ["llama"] and c.models()[0].max_model_len == 256
        assert c.stats() == before and c.health().serving
        # The same id twice at once is refused; the first goes on.
        first = c.generate([5, 6, 7], GREEDY, request_id="dup")
        await first.__anext__()
        with pytest.raises(ConfigError, match="request_id"):
            await collect(c, "dup", [5, 6], GREEDY)
        await first.aclose()
    serve(threads(ckpt), body)


def test_queue_full_then_abort_and_early_exit_free_blocks(ckpt):
    async def body(c):
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        running = c.generate([1, 2, 3], long, request_id="running")
        await running.__anext__()  # max_num_seqs=1: it holds the only slot
        waiting = asyncio.ensure_future(collect(c, "waiting", [4, 5, 6], GREEDY))
        await wait_until(lambda: c.stats().num_waiting == 1, "the second request to wait for the only slot",
                         timeout_s=10, state=c.stats)
        with pytest.raises(QueueFullError, match="max_queue=1"):
            await collect(c, "refused", [7, 8], GREEDY)
        assert await c.abort("running")
        deltas = [d async for d in running]
        assert deltas[-1].finished and deltas[-1].finish_reason is FinishReason.ABORT
        assert len((await waiting).token_ids) == 24
        assert not await c.abort("running") and not await c.abort("nobody")
        leaver = c.generate([9, 9, 9], long, request_id="leaver")
        await leaver.__anext__()
        await leaver.aclose()  # leaving the stream aborts the request
        again = await collect(c, "leaver", [4, 5, 6], GREEDY)  # the id is free again at once
        assert again.token_ids == (await waiting).token_ids and again.finish_reason is FinishReason.LENGTH
        await wait_until(lambda: holds_no_blocks(c), "the replica to free every request's blocks", timeout_s=10,
                         state=lambda: [r.core.kv.request_ids() for r in c.replicas()])
        assert_no_held_blocks(c)
    serve(threads(ckpt, scheduler={"max_num_seqs": 1, "max_queue": 1}), body)


@pytest.mark.parametrize("mode", ["unified", "disaggregated"])
def test_drain_lets_running_requests_finish_and_then_refuses(ckpt, want, mode):
    picked = mixed_requests()[3:8]

    async def main():
        c = await Coordinator(threads(ckpt, mode)).start()
        started = {rid: asyncio.Event() for rid, _, _ in picked}
        tasks = [asyncio.ensure_future(collect(c, rid, p, sp, started=started[rid])) for rid, p, sp in picked]
        await wait_for_events(started, "every request's first token", timeout_s=30)  # all in flight
        await c.shutdown(drain=True)  # a disaggregated drain waits for hand-overs to finish on decode
        with pytest.raises(UnavailableError, match="shutting down"):
            await collect(c, "late", [1, 2], GREEDY)
        assert not c.health().serving
        return {rid: await t for (rid, _, _), t in zip(picked, tasks)}
    assert_same(asyncio.run(main()), want)


def null_config(tmp_path, mode="unified", **kw) -> ClusterConfig:
    (tmp_path / "null").mkdir(exist_ok=True)
    cfg = threads(tmp_path / "null", mode, **kw)
    return ClusterConfig(engine=cfg.engine, pools=cfg.pools, runtime="threads",
                         worker_class="tests.null_worker:NullWorker", health_period_s=0.2)


def null_tokens(prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


def test_a_failing_replica_fails_its_requests_and_is_rebuilt(tmp_path):
    async def body(c):
        (old,) = c.replicas()
        ok = [asyncio.ensure_future(collect(c, f"ok-{i}", [i + 1, 2, 3], GREEDY)) for i in range(3)]
        with pytest.raises(ReplicaFailedError, match="unified-0 failed: .*poisoned request"):
            await collect(c, "poison", [1, POISON_TOKEN], GREEDY)
        results = await asyncio.gather(*ok, return_exceptions=True)
        for i, r in enumerate(results):  # each either finished before the failure, or failed with it
            assert isinstance(r, ReplicaFailedError) or r.token_ids == null_tokens([i + 1, 2, 3], 24)
        await wait_until(lambda: c.health().serving, "the pool to rebuild unified-0", timeout_s=30, state=c.health)
        (new,) = c.replicas()
        assert new is not old and c.pools["unified"].num_rebuilds == 1
        after = await collect(c, "after", [4, 5], GREEDY)
        assert after.token_ids == null_tokens([4, 5], 24)
        assert_no_held_blocks(c)
    serve(null_config(tmp_path), body)


def test_capacity_error_when_prompt_and_max_tokens_cannot_fit(tmp_path):
    async def body(c):
        # 8 blocks of 16 tokens, one of them the null block: 112 slots; 100 + 24 tokens do not fit.
        with pytest.raises(CapacityError, match="needs 124 KV slots; a replica holds 112"):
            await collect(c, "big", list(range(1, 101)), GREEDY)
        assert (await collect(c, "small", [1, 2], GREEDY)).token_ids == null_tokens([1, 2], 24)
    cfg = null_config(tmp_path)
    from dataclasses import replace

    engine = replace(cfg.engine, cache=replace(cfg.engine.cache, num_kv_blocks=8))
    serve(replace(cfg, engine=engine), body)


def test_a_reader_that_lags_gets_its_waiting_deltas_joined_and_the_same_tokens(tmp_path):
    async def body(c):
        stream = c.generate([3, 1, 4], GREEDY, request_id="slow")
        first = await anext(stream)
        # Read nothing until the request has finished: every later step's delta waits in the queue.
        ticket = c._live["slow"]
        await wait_until(lambda: ticket.num_streamed == 24, "the request to finish", timeout_s=30, state=c.health)
        rest = [d async for d in stream]
        assert len(rest) == 1  # one delta for all the tokens that waited
        (last,) = rest
        assert last.finished and last.finish_reason is FinishReason.LENGTH
        assert first.token_ids + last.token_ids == null_tokens([3, 1, 4], 24)
        # a reader that keeps up still gets one delta per step
        kept_up = [d async for d in c.generate([2, 7], GREEDY, request_id="fast")]
        assert [t for d in kept_up for t in d.token_ids] == null_tokens([2, 7], 24)
        assert len(kept_up) > 1
    serve(null_config(tmp_path), body)


def test_a_stop_in_the_turn_after_a_wake_up_ends_the_replica_loop(tmp_path):
    """Python 3.11's asyncio.wait_for returns the result of a wait that completed in the same turn
    as a cancel and drops the cancel. The idle replica's loop waited for its wake-up that way: a
    stop right after a wake-up left the loop running and the shutdown waiting on it for ever."""
    async def body(c):
        (replica,) = c.replicas()
        await wait_until(lambda: replica._idle.is_set(), "the replica to idle", timeout_s=30, state=c.health)
        await asyncio.sleep(0.05)  # now waiting for its wake-up (the health period is 60 s)
        loop_task = replica._task
        replica._wake()  # its wait completes in the next turn, the cancel comes in the turn after
        await asyncio.sleep(0)
        stop = asyncio.ensure_future(replica.stop())
        done, _ = await asyncio.wait({stop}, timeout=10)
        assert done and loop_task.done() and replica.state.value == "stopped"
    serve(replace(null_config(tmp_path), health_period_s=60.0), body)
