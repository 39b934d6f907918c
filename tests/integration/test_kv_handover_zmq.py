"""KV hand-over between two processes over zmq (tcp loopback), and every refusal path."""

import json
import os
import subprocess
import sys

import pytest
import torch

from meshserve.core.secret import ENV_SECRET, ClusterSecret
from meshserve.kvtransfer.export_server import new_capability, pull_kv
from meshserve.kvtransfer.wire import KVTransferError
from tests.integration.kv_handover_peer import sender_replica
from tests.unit.kvtransfer.replicas import Replica

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


SECRET = ClusterSecret(b"test secret of the kv handover peer")


@pytest.fixture(scope="module")
def peer():
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.kv_handover_peer", "zmq"],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, ENV_SECRET: SECRET.key.decode()},
    )
    try:
        line = proc.stdout.readline()
        assert line, "the peer process did not start"
        started = json.loads(line)
        yield proc, started["address"], started["capabilities"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_round_trip_and_refusals_between_processes(peer):
    proc, address, caps = peer
    expected = sender_replica().request_bytes("ok")

    # Before the victim pulls: an outsider without the secret (its pull is dropped, unanswered,
    # and counted), and insiders guessing by request id or with a wrong capability, are refused.
    attempts = [
        (ClusterSecret(b"an outsider's guess at the secret"), caps["ok"], "timeout"),
        (SECRET, "ok", "unknown_request"),  # the request id is not a capability
        (SECRET, caps["ok"][:-1] + ("A" if caps["ok"][-1] != "A" else "B"), "unknown_request"),
    ]
    for secret, capability, reason in attempts:
        thief = Replica("gqa", seed=7)
        free = thief.kv.num_free_blocks
        with pytest.raises(KVTransferError) as info:
            pull_kv(thief.connector, address, capability, secret=secret, timeout_s=0.5 if reason == "timeout" else 30)
        assert info.value.reason == reason, str(info.value)
        assert thief.kv.num_free_blocks == free
        thief.kv.check_invariants()

    dst = Replica("gqa", seed=2)
    dst.fragment(4)  # the receiver's new blocks are scattered: staged frames as well as direct ones
    blocks = pull_kv(dst.connector, address, caps["ok"], secret=SECRET, timeout_s=30)
    assert dst.kv.block_tables("ok") == blocks
    for ours, theirs in zip(dst.request_bytes("ok"), expected):
        assert torch.equal(ours, theirs)
    assert dst.kv.lookup_prefix(list(range(100, 137))).num_tokens == 36
    dst.kv.check_invariants()

    cases = [
        (caps["layout"], Replica("gqa", model_id="other"), "layout"),
        (caps["capacity"], Replica("gqa", num_blocks=5), "capacity"),
        (caps["truncated"], Replica("gqa", seed=3), "truncated"),
        (caps["checksum"], Replica("gqa", seed=4), "checksum"),
        (new_capability(), Replica("gqa", seed=5), "unknown_request"),
        (caps["ok"], Replica("gqa", seed=6), "unknown_request"),  # a capability serves one pull
    ]
    for cap, receiver, reason in cases:
        free = receiver.kv.num_free_blocks
        with pytest.raises(KVTransferError) as info:
            pull_kv(receiver.connector, address, cap, secret=SECRET, timeout_s=30)
        assert info.value.reason == reason, f"{reason}: {info.value}"
        assert receiver.kv.num_free_blocks == free and len(list(receiver.kv.request_ids())) == 0
        receiver.kv.check_invariants()

    out, _ = proc.communicate(input="", timeout=60)
    report = json.loads(out.strip().splitlines()[-1])
    # the sender released every export; the outsider's pull was dropped and counted
    assert report == {"pending": 0, "pinned_blocks": 0, "rejected": 1}


def test_pull_times_out_without_a_sender():
    import zmq

    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    dst = Replica()
    try:
        with pytest.raises(KVTransferError) as info:
            pull_kv(dst.connector, f"tcp://127.0.0.1:{port}", new_capability(), secret=SECRET, timeout_s=0.2)
        assert info.value.reason == "timeout"
        assert dst.kv.num_free_blocks == dst.kv.num_total_blocks
    finally:
        silent.close(linger=0)


def test_unpulled_offers_expire_and_close_releases_everything():
    import time

    from meshserve.kvtransfer.export_server import KVExportServer

    src = Replica(seed=1)
    src.add_request("a", list(range(20)))
    src.add_request("b", list(range(40, 60)))
    server = KVExportServer(SECRET)
    server.offer(src.connector.export("a"), capability=new_capability(), ttl_s=0.05, release=src.connector.release)
    server.offer(src.connector.export("b"), capability=new_capability(), ttl_s=600, release=src.connector.release)
    src.kv.free("a")
    src.kv.free("b")
    held = src.kv.num_total_blocks - src.kv.num_free_blocks
    assert held == 2 * 5 and server.num_pending == 2  # the offers pin the blocks
    time.sleep(0.1)
    server.poll(0)
    assert server.num_pending == 1 and src.kv.num_total_blocks - src.kv.num_free_blocks == 5
    server.close()
    assert src.kv.num_free_blocks == src.kv.num_total_blocks
    src.kv.check_invariants()
