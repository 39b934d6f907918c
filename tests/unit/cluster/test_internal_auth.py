"""Authenticated internal channels (issue 23 item 2): forged step-channel frames and KV pulls
without the capability are refused, counted, and the victim requests finish token-identical.

The ranks are real Workers on a tiny checkpoint on threads; steps and hand-overs cross the real
zmq channel and KV export server. The oracle is the single-process engine (cases.reference).
"""

import asyncio
import struct
import threading

import msgpack
import pytest
import zmq

from meshserve.cluster.executors.channel import ERR, HELLO, OUT, ChannelAuth, DriverChannel, rank_identity, serve_rank
from meshserve.cluster.executors.executor import WorkerDiedError
from meshserve.core.secret import ClusterSecret
from meshserve.kvtransfer.export_server import new_capability, pull_kv
from meshserve.kvtransfer.rank_agent import KVRankAgent
from meshserve.kvtransfer.transport import Endpoint
from meshserve.kvtransfer.wire import KVTransferError
from tests.unit.cluster.cases import (
    assert_no_held_blocks,
    assert_same,
    mixed_requests,
    reference,
    run_all,
    serve,
    threads,
    wait_until,
)

VICTIMS = [mixed_requests()[i] for i in (3, 7, 9, 10, 14)]


@pytest.fixture(scope="module")
def ckpt(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def want(ckpt):
    return reference(ckpt, VICTIMS)


def forge(address: str, next_seq: int) -> int:
    """An outsider's frames at a driver channel: the ERR that used to fail the replica (no tag, a
    wrong tag, from a peer that calls itself rank 0), a hello for rank 0 and an OUT for the next
    step. Returns how many were sent."""
    ctx = zmq.Context.instance()
    seq = struct.pack("<Q", next_seq)
    err = msgpack.packb({"rank": 0, "error": "forged", "traceback": ""})
    frames = [[ERR, seq, err], [ERR, seq, err, b"\0" * 32], [HELLO, struct.pack("<Q", 0), b"rank-0", b"x" * 32],
              [OUT, seq, b"\x90", b"y" * 32]]
    for identity in (None, rank_identity(0)):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 2000)  # the frames leave even though we close at once
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        sock.connect(address)
        for f in frames:
            sock.send_multipart(f)
        sock.close()
    return 2 * len(frames)


def test_forged_step_frames_are_dropped_and_counted_while_victims_finish(ckpt, want):
    async def body(c):
        replicas = c.replicas()
        channels = [r.executor.channel for r in replicas]
        sent = [forge(ch.address, ch._next_seq) for ch in channels]
        victims = asyncio.ensure_future(run_all(c, VICTIMS))
        await wait_until(lambda: all(ch.rejected.count >= n for ch, n in zip(channels, sent)) or victims.done(),
                         "the forged frames to be read", timeout_s=60)
        got = await victims
        assert [ch.rejected.count for ch in channels] == sent, "every forged frame dropped and counted"
        assert c.replicas() == replicas and all(r.alive for r in replicas)  # none failed, none rebuilt
        assert_no_held_blocks(c)
        return got
    assert_same(serve(threads(ckpt, "unified", replicas=2), body), want)


def test_kv_pulls_without_the_capability_are_refused_and_the_victim_is_untouched(ckpt, want, monkeypatch):
    rid, prompt, params = VICTIMS[1]
    servers, refusals = [], []
    real_offer, real_pull = KVRankAgent.offer, KVRankAgent.pull

    def offer(self, *args, **kw):
        address = real_offer(self, *args, **kw)
        servers.append(self.server)
        return address

    class Thief:  # an import target that must never see a header
        device = None

        def begin_import(self, header):
            raise AssertionError("an unauthorised pull received the victim's KV header")

    def pull(self, capability, addresses, *args, **kw):
        wrong = capability[:-1] + ("A" if capability[-1] != "A" else "B")
        attempts = [(self.secret, rid, "unknown_request"),  # by request id, as the attack did
                    (self.secret, wrong, "unknown_request"), (self.secret, new_capability(), "unknown_request"),
                    (ClusterSecret(b"an outsider without the secret"), capability, "timeout")]
        for secret, cap, reason in attempts:
            try:
                pull_kv(Thief(), Endpoint.from_wire(addresses[0]).address, cap, secret=secret, timeout_s=0.5)
            except KVTransferError as exc:
                refusals.append((reason, exc.reason))
        return real_pull(self, capability, addresses, *args, **kw)

    monkeypatch.setattr(KVRankAgent, "offer", offer)
    monkeypatch.setattr(KVRankAgent, "pull", pull)

    async def body(c):
        got = await run_all(c, [VICTIMS[1]])
        (decode,) = c.replicas("decode")
        assert decode.stats().num_kv_imports == 1 and decode.stats().num_recomputes == 0  # the offer survived
        assert [s.rejected.count for s in servers] == [1]  # the outsider's pull: dropped, counted
        assert_no_held_blocks(c)
        return got
    got = serve(threads(ckpt, "disaggregated"), body)
    assert refusals == [("unknown_request", "unknown_request")] * 3 + [("timeout", "timeout")]
    assert_same(got, {rid: want[rid]})


class _EchoHost:
    """The smallest rank host: echoes steps (the channel's own behaviour is under test)."""

    has_pending_exports = False
    pulls_done = None  # no KV agent: nothing to push
    secret = None

    def execute_step(self, plan: bytes) -> bytes:
        return plan

    def call(self, method, args):
        return method

    def poll_exports(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def test_frames_of_another_session_and_second_hellos_are_dropped():
    secret = ClusterSecret.generate()
    auth, stale = ChannelAuth.new(secret), ChannelAuth.new(secret)  # same secret, an earlier channel
    driver = DriverChannel(1, auth)
    ctx = zmq.Context.instance()
    intruder = ctx.socket(zmq.DEALER)
    intruder.setsockopt(zmq.LINGER, 0)
    intruder.connect(driver.address)
    name, seq0 = rank_identity(0), struct.pack("<Q", 0)
    intruder.send_multipart([HELLO, seq0, name, stale.sign(b"step<", name, HELLO, seq0, name)])
    with pytest.raises(WorkerDiedError, match="did not connect"):
        driver.wait_ready(lambda: None, timeout_s=0.5)  # the stale hello does not make a rank
    assert driver.rejected.count == 1

    host = _EchoHost()
    rank = threading.Thread(target=serve_rank, args=(host, driver.address, auth), kwargs={"rank": 0}, daemon=True)
    rank.start()
    try:
        driver.wait_ready(lambda: None, timeout_s=30)
        assert host.secret is secret  # handed over with the start-up config
        # A copy of the real hello from another connection (a replay) does not take rank 0 over.
        intruder.send_multipart([HELLO, seq0, name, auth.sign(b"step<", name, HELLO, seq0, name)])
        for i in range(1000):  # the driver reads the intruder's pipe between the rank's answers
            assert driver.step(b"plan-%d" % i, lambda: None) == b"plan-%d" % i  # still the real rank
            if driver.rejected.count == 2:
                break
        assert driver.rejected.count == 2
        assert driver.call("check_health", [{}], lambda: None) == ["check_health"]
    finally:
        driver.close()
        intruder.close()
        rank.join(timeout=10)
    assert not rank.is_alive()
