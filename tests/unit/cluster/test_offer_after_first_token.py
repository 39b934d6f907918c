"""The prefill replica delivers a request's first token before its ranks answer the KV offer
(ranks on threads, real Workers, tiny checkpoint).

The test holds the rank's `kv_offer` (RankHost, shared with the ranks' threads) until it lets it
go: the first token reaches the client meanwhile (before, the offer's round trip came first and
the token waited for it). An abort in that window, a failing offer and a held offer's order
against the decode side leave no block held and no pin on either side; the oracle is the
single-process engine.
"""

import asyncio
import threading

import pytest

from meshserve.cluster.executors.rank_host import RankHost
from meshserve.core.outputs import FinishReason
from meshserve.core.sampling_params import SamplingParams
from tests.tiny_models import prompts
from tests.unit.cluster.cases import assert_no_held_blocks, holds_no_blocks, reference, serve, threads, wait_until

GREEDY = dict(temperature=0, ignore_eos=True)
REQUEST = ("offered", prompts(1, seed=31, min_len=37, max_len=37)[0], SamplingParams(max_tokens=8, **GREEDY))
WAIT_S = 60  # bound of every wait; they end as soon as the awaited thing happens


@pytest.fixture(scope="module")
def ckpt(tiny_llama):
    return tiny_llama  # conftest.py's session checkpoint


@pytest.fixture(scope="module")
def want(ckpt):
    return reference(ckpt, [REQUEST])


class OfferGate:
    """Holds every rank's kv_offer until `release` (or makes it fail: `fail`)."""

    def __init__(self) -> None:
        self.arrived = threading.Event()  # a rank is in kv_offer, held
        self.release = threading.Event()
        self.answered = threading.Event()  # a held kv_offer returned (or raised)
        self.fail = False

    def install(self, monkeypatch) -> None:
        offer = RankHost.kv_offer
        gate = self

        def held(host, **args):
            gate.arrived.set()
            try:
                if not gate.release.wait(WAIT_S):
                    raise RuntimeError("the test never released the offer")
                if gate.fail:
                    raise RuntimeError("injected: the rank cannot offer")
                return offer(host, **args)
            finally:
                gate.answered.set()

        monkeypatch.setattr(RankHost, "kv_offer", held)


@pytest.fixture
def gate(monkeypatch):
    g = OfferGate()
    g.install(monkeypatch)
    yield g
    g.release.set()  # a failing test must not leave a rank thread waiting


async def stream(c, seen: list[int]) -> FinishReason | None:
    rid, prompt, params = REQUEST
    reason = None
    async for d in c.generate(prompt, params, request_id=rid):
        seen.extend(d.token_ids)
        reason = d.finish_reason
    return reason


async def first_token_while_offer_held(c, gate: OfferGate, seen: list[int]) -> None:
    await wait_until(lambda: len(seen) >= 1, "the first token while the rank holds the offer", timeout_s=WAIT_S)
    assert gate.arrived.is_set() and not gate.answered.is_set()


def test_the_first_token_is_delivered_before_the_ranks_answer_the_offer(ckpt, want, gate):
    async def body(c):
        (prefill,), (decode,) = c.replicas("prefill"), c.replicas("decode")
        seen = []
        task = asyncio.ensure_future(stream(c, seen))
        await first_token_while_offer_held(c, gate, seen)
        # The token is out; the request is detached from the prefill engine, its KV pinned, its
        # offer not answered and nothing handed to the decode side yet.
        assert seen == want["offered"].token_ids[:1]
        assert len(prefill.handover.offers) == 1 and prefill.handover.pins.num_pinned == 1
        assert not prefill.core.has_unfinished() and decode.load == 0
        gate.release.set()
        assert await asyncio.wait_for(task, WAIT_S) == FinishReason.LENGTH
        assert (decode.stats().num_kv_imports, decode.stats().num_recomputes) == (1, 0)
        await wait_until(lambda: holds_no_blocks(c) and prefill.handover.pins.num_pinned == 0,
                         "every block and the offer's pin to be freed", timeout_s=WAIT_S)
        assert_no_held_blocks(c)
        return seen

    assert serve(threads(ckpt, "disaggregated"), body) == want["offered"].token_ids


def test_an_abort_between_the_first_token_and_the_offers_answer_frees_everything(ckpt, gate):
    async def body(c):
        (prefill,), (decode,) = c.replicas("prefill"), c.replicas("decode")
        seen = []
        task = asyncio.ensure_future(stream(c, seen))
        await first_token_while_offer_held(c, gate, seen)
        assert await c.abort("offered")
        assert await asyncio.wait_for(task, WAIT_S) == FinishReason.ABORT
        assert prefill.handover.pins.num_pinned == 1  # the rank may still read the blocks: kept
        gate.release.set()
        await wait_until(lambda: (prefill.handover.pins.num_pinned == 0 and not prefill.handover.offers
                                  and holds_no_blocks(c)),
                         "the aborted request's pin and blocks to be freed", timeout_s=WAIT_S)
        assert_no_held_blocks(c)
        # Never handed over: the decode replica saw nothing of it.
        assert decode.load == 0 and decode.stats().num_kv_imports == decode.stats().num_recomputes == 0
        assert prefill.load == 0 and seen == seen[:1]

    serve(threads(ckpt, "disaggregated"), body)


def test_a_failed_offer_is_recomputed_by_the_decode_replica_with_identical_tokens(ckpt, want, gate):
    async def body(c):
        (prefill,), (decode,) = c.replicas("prefill"), c.replicas("decode")
        gate.fail = True
        seen = []
        task = asyncio.ensure_future(stream(c, seen))
        await first_token_while_offer_held(c, gate, seen)
        gate.release.set()
        assert await asyncio.wait_for(task, WAIT_S) == FinishReason.LENGTH
        recomputes = decode.stats().handover.recomputes
        assert recomputes["offer_failed"] == sum(recomputes.values()) == 1 and decode.stats().num_kv_imports == 0
        await wait_until(lambda: holds_no_blocks(c) and prefill.handover.pins.num_pinned == 0,
                         "every block and the offer's pin to be freed", timeout_s=WAIT_S)
        assert_no_held_blocks(c)
        assert prefill.state.value == "ready"  # a failed offer fails the hand-over, not the replica
        return seen

    assert serve(threads(ckpt, "disaggregated"), body) == want["offered"].token_ids

