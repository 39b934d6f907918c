"""Asynchronous KV import on the decode replica (ranks on threads, real Workers, tiny checkpoint).

A puller the test holds (gated_puller.py) proves the decode replica keeps stepping its running
requests while a hand-over's KV is on its way, and that abort, replica shutdown, replica failure
and timeout during a transfer leave no block held (and no offer pinned) on either side. The
oracle is the single-process engine.
"""

import asyncio
from dataclasses import replace

import pytest

from meshserve.core.outputs import FinishReason
from meshserve.core.sampling_params import SamplingParams
from meshserve.errors import ReplicaFailedError
from meshserve.kvtransfer.nixl_agent import nixl_available
from tests.tiny_models import prompts
from tests.unit.cluster.cases import assert_no_held_blocks, holds_no_blocks, reference, serve, threads, wait_until
from tests.unit.cluster.gated_puller import GATE, GATED

GREEDY = dict(temperature=0, ignore_eos=True)
LONG = ("long", prompts(1, seed=21, min_len=20, max_len=20)[0], SamplingParams(max_tokens=200, **GREEDY))
HELD = ("held", prompts(1, seed=22, min_len=37, max_len=37)[0], SamplingParams(max_tokens=8, **GREEDY))
WAIT_S = 60  # bound of every wait; they end as soon as the awaited thing happens


@pytest.fixture(scope="module")
def ckpt(tiny_llama):
    return tiny_llama  # conftest.py's session checkpoint


@pytest.fixture(scope="module")
def want(ckpt):
    return reference(ckpt, [LONG, HELD])


@pytest.fixture(autouse=True)
def gate():
    GATE.reset()
    yield GATE
    GATE.release.set()  # a failing test must not leave a rank thread waiting
    GATE.reset()


def gated(ckpt, transport=GATED, **cluster):
    cfg = threads(ckpt, "disaggregated")
    engine = replace(cfg.engine, cache=replace(cfg.engine.cache, kv_transport=transport))
    return replace(cfg, engine=engine, **cluster)


async def stream(c, request, seen: list[int]) -> str | None:
    """Run one request, appending its tokens to `seen` as they arrive; its finish reason."""
    rid, prompt, params = request
    reason = None
    async for d in c.generate(prompt, params, request_id=rid):
        seen.extend(d.token_ids)
        reason = d.finish_reason
    return reason


def rank_calls(replica) -> list[str]:
    """The methods the replica asks of its ranks over the step channel from now on (steps aside)."""
    calls, call = [], replica.executor.call

    def counted(method, args):
        calls.append(method)
        return call(method, args)

    replica.executor.call = counted
    return calls


async def held_pull_arrived() -> None:
    assert await asyncio.to_thread(GATE.arrived.wait, WAIT_S), "the decode rank never started the held pull"


def test_running_request_keeps_decoding_while_an_import_is_held(ckpt, want):
    async def body(c):
        (decode,) = c.replicas("decode")
        long_seen, held_seen = [], []
        long_task = asyncio.ensure_future(stream(c, LONG, long_seen))
        await wait_until(lambda: len(long_seen) >= 3, "the long request to decode", timeout_s=WAIT_S)
        calls = rank_calls(decode)
        GATE.holding.set()
        held_task = asyncio.ensure_future(stream(c, HELD, held_seen))
        await held_pull_arrived()
        before = len(long_seen)
        await wait_until(lambda: len(long_seen) >= before + 20 or long_task.done(),
                         "the long request to go on decoding", timeout_s=WAIT_S)
        # The long request decoded 20 tokens while the other's KV was held on its way.
        assert len(long_seen) >= before + 20 and not GATE.release.is_set()
        assert len(decode.handover.imports) == 1 and held_seen == want["held"].token_ids[:1]  # the prefill's token only
        # 20 steps with a pull in flight, and not one question to the ranks about it: they push.
        assert [m for m in calls if m.startswith("kv_")] == ["kv_pull_start"]
        GATE.release.set()
        await asyncio.gather(long_task, held_task)
        stats = decode.stats()
        assert (stats.num_kv_imports, stats.num_recomputes, stats.handover.transports) == (2, 0, {GATED: 2})
        await wait_until(lambda: holds_no_blocks(c), "every block to be freed", timeout_s=WAIT_S)
        assert_no_held_blocks(c)
        return long_seen, held_seen

    long_seen, held_seen = serve(gated(ckpt), body)
    assert long_seen == want["long"].token_ids
    assert held_seen == want["held"].token_ids


def test_an_idle_decode_replica_learns_of_a_finished_pull_from_its_rank_unasked(ckpt, want):
    """The decode replica has nothing else to run: it waits for its rank to push the finished pull
    (channel.py PULLED) instead of asking every few milliseconds. One round trip to the ranks per
    hand-over (starting the pull), the request adopted with the pulled KV."""
    async def body(c):
        (decode,) = c.replicas("decode")
        calls = rank_calls(decode)
        GATE.holding.set()
        seen = []
        task = asyncio.ensure_future(stream(c, HELD, seen))
        await held_pull_arrived()
        pushed = decode.executor.channel.num_pulled
        GATE.release.set()
        await asyncio.wait_for(task, WAIT_S)
        assert [m for m in calls if m.startswith("kv_")] == ["kv_pull_start"]
        assert decode.executor.channel.num_pulled == pushed + 1  # the rank's push is how it learnt
        stats = decode.stats()
        assert (stats.num_kv_imports, stats.num_recomputes) == (1, 0)
        await wait_until(lambda: holds_no_blocks(c), "every block to be freed", timeout_s=WAIT_S)
        assert_no_held_blocks(c)
        return seen

    assert serve(gated(ckpt), body) == want["held"].token_ids


def test_abort_during_an_import_cancels_it_and_frees_every_block(ckpt):
    async def body(c):
        (prefill,), (decode,) = c.replicas("prefill"), c.replicas("decode")
        GATE.holding.set()
        seen = []
        task = asyncio.ensure_future(stream(c, HELD, seen))
        await held_pull_arrived()
        assert await c.abort("held")
        assert await asyncio.wait_for(task, WAIT_S) == FinishReason.ABORT
        assert await asyncio.to_thread(GATE.cancelled.wait, WAIT_S), "the held pull was not cancelled"
        await wait_until(lambda: (holds_no_blocks(c) and prefill.handover.pins.num_pinned == 0
                                  and not decode.handover.imports),
                         "the aborted import to free its blocks and the offer's pin", timeout_s=WAIT_S)
        assert_no_held_blocks(c)
        stats = decode.stats()
        assert (stats.num_kv_imports, stats.num_recomputes) == (0, 0)  # an abort is neither

    serve(gated(ckpt), body)


def test_decode_replica_shutdown_during_an_import_leaves_no_pin(ckpt):
    async def body(c):
        (prefill,), (decode,) = c.replicas("prefill"), c.replicas("decode")
        GATE.holding.set()
        task = asyncio.ensure_future(stream(c, HELD, []))
        await held_pull_arrived()
        await decode.stop()
        with pytest.raises(ReplicaFailedError, match="shut down"):
            await asyncio.wait_for(task, WAIT_S)
        assert GATE.cancelled.is_set()  # the rank stopped its pull before it stopped
        assert decode.core.kv.num_requests == 0 and not decode.handover.imports  # the reservation is freed
        await wait_until(lambda: prefill.handover.pins.num_pinned == 0 and prefill.core.kv.num_requests == 0,
                         "the prefill replica to release the offer's pin", timeout_s=WAIT_S)
        prefill.core.kv.check_invariants()
        decode.core.kv.check_invariants()

    serve(gated(ckpt), body)


def test_an_import_past_the_timeout_is_recomputed_with_identical_tokens(ckpt, want):
    async def body(c):
        (decode,) = c.replicas("decode")
        GATE.holding.set()  # never released: the pull times out after handover_timeout_s
        seen = []
        await asyncio.wait_for(stream(c, HELD, seen), WAIT_S)
        assert GATE.timed_out.is_set()
        assert decode.stats().handover.recomputes["timeout"] == 1 and decode.stats().num_kv_imports == 0
        await wait_until(lambda: holds_no_blocks(c), "every block to be freed", timeout_s=WAIT_S)
        assert_no_held_blocks(c)
        return seen

    assert serve(gated(ckpt, handover_timeout_s=0.5), body) == want["held"].token_ids


def test_decode_replica_failing_during_an_import_releases_the_offer(ckpt, monkeypatch):
    from meshserve.cluster.executors.rank_host import RankHost

    def broken(self):
        raise RuntimeError("injected: the rank lost track of its pulls")

    async def body(c):
        (prefill,), (decode,) = c.replicas("prefill"), c.replicas("decode")
        GATE.holding.set()
        task = asyncio.ensure_future(stream(c, HELD, []))
        await held_pull_arrived()
        # The rank reports a finished pull unasked (channel.py PULLED): once the held pull ends,
        # collecting it fails, the rank says so, and the replica fails.
        monkeypatch.setattr(RankHost, "kv_pull_done", broken)
        GATE.release.set()
        with pytest.raises(ReplicaFailedError, match="injected"):
            await asyncio.wait_for(task, WAIT_S)
        monkeypatch.undo()
        assert decode.state.value == "failed" and not decode.handover.imports
        await wait_until(lambda: prefill.handover.pins.num_pinned == 0 and prefill.core.kv.num_requests == 0,
                         "the prefill replica to release the offer's pin", timeout_s=WAIT_S)
        prefill.core.kv.check_invariants()

    serve(gated(ckpt), body)


@pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")
def test_the_nixl_transport_matches_the_single_process_engine(ckpt, want):
    async def body(c):
        (decode,) = c.replicas("decode")
        got = {}
        for request in (HELD, LONG):
            got[request[0]] = []
            await stream(c, request, got[request[0]])
        stats = decode.stats()
        assert (stats.num_kv_imports, stats.num_recomputes, stats.handover.transports) == (2, 0, {"nixl": 2})
        await wait_until(lambda: holds_no_blocks(c), "every block to be freed", timeout_s=WAIT_S)
        return got

    got = serve(gated(ckpt, "nixl"), body)
    assert got == {rid: want[rid].token_ids for rid in ("held", "long")}
