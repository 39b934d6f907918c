"""An outsider who reaches an internal zmq socket (the step channel's driver end, a rank's KV
export server) and sends one 64 MiB frame must not make the process allocate it: each socket has a
maximum message size (zmq.MAXMSGSIZE), so zmq drops the peer when the frame's size arrives, before
the HMAC check would have dropped the frame. The oracle is the process's resident memory (psutil)
and zmq's own disconnect event; the socket keeps serving its legitimate peers afterwards."""

import gc

import psutil
import zmq
from zmq.utils.monitor import recv_monitor_message

from meshserve.cluster.executors.channel import ChannelAuth, DriverChannel
from meshserve.core.secret import ClusterSecret
from meshserve.kvtransfer.export_server import KVExportServer, new_capability, pull_kv
from tests.polling import polled
from tests.unit.kvtransfer.replicas import Replica

SECRET = ClusterSecret(b"test secret of the forged frame tests")
FORGED_BYTES = 64 << 20
RSS_SLACK = 8 << 20
WAIT_MS = 30_000  # bound of the wait for zmq's disconnect: ends as soon as it comes


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def forge_and_wait(sock: zmq.Socket, address: str, poll=lambda: None) -> int:
    """Send one FORGED_BYTES frame to `address` (the bound `sock`) and wait until zmq drops the
    sender; returns the resident memory growth meanwhile."""
    payload = bytes(FORGED_BYTES)  # allocated (and touched) before the baseline
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    before = rss()
    outsider = zmq.Context.instance().socket(zmq.DEALER)
    outsider.setsockopt(zmq.LINGER, 0)
    outsider.connect(address)
    try:
        outsider.send(payload, copy=False)
        got = None
        for _ in range(WAIT_MS // 100):
            poll()
            if monitor.poll(100):
                got = recv_monitor_message(monitor)
                break
        growth = rss() - before
        assert got is not None and got["event"] == zmq.EVENT_DISCONNECTED, "zmq did not drop the forged frame's sender"
        return growth
    finally:
        outsider.close(linger=0)
        sock.disable_monitor()
        monitor.close(linger=0)
        del payload


def test_a_forged_64_mib_frame_to_a_kv_export_server_is_dropped_unbuffered():
    server = KVExportServer(SECRET)
    try:
        assert forge_and_wait(server._sock, server.address, lambda: server.poll(0)) < RSS_SLACK
        src, dst = Replica("gqa", seed=1), Replica("gqa", seed=2)  # a legitimate pull still works
        src.add_request("r", list(range(100, 137)))
        cap = new_capability()
        server.offer(src.connector.export("r"), capability=cap, release=src.connector.release)
        with polled(server, timeout_ms=10):
            pull_kv(dst.connector, server.address, cap, secret=SECRET, timeout_s=30)
        assert dst.request_bytes("r")[0].equal(src.request_bytes("r")[0])
    finally:
        server.close()


def test_a_forged_64_mib_frame_to_the_step_channel_is_dropped_unbuffered():
    channel = DriverChannel(1, ChannelAuth.new(SECRET))
    try:
        assert forge_and_wait(channel._sock, channel.address) < RSS_SLACK
    finally:
        channel.close()


def test_without_a_limit_the_same_frame_would_be_buffered():
    """The oracle's own check: a plain ROUTER (no maximum) takes the whole frame in."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    payload = bytes(FORGED_BYTES)
    before = rss()
    outsider = zmq.Context.instance().socket(zmq.DEALER)
    outsider.connect(f"tcp://127.0.0.1:{port}")
    outsider.send(payload, copy=False)
    assert sock.poll(WAIT_MS)
    frames = sock.recv_multipart(copy=False)
    assert rss() - before > FORGED_BYTES // 2 and len(frames[-1].buffer) == FORGED_BYTES
    outsider.close(linger=0)
    sock.close(linger=0)
