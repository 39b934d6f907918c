"""A direct puller's done notice (pull_client.send_done, PullSockets.notify) reaches the exporter
even when the puller is closed right after queueing it, and closing never waits long on an
exporter that is gone. Real zmq sockets and a real export server, reached through a TCP relay that
takes LINK_SETUP_S to open each connection (a remote or loaded exporter: the notice is queued
before the connection is up, which on an idle loopback is a race the puller usually wins); the
pull is pull_direct with the copy done by copy_described over CPU caches (what a CUDA IPC pull
runs). The oracle is the exporter's own block reference counts and held offers before the offer."""

import contextlib
import socket
import threading
import time

import torch
import zmq

from meshserve.core.secret import ClusterSecret
from meshserve.kvtransfer.cuda_ipc import copy_described
from meshserve.kvtransfer.direct_offer import SpentCapabilities, pack_offer, pull_direct
from meshserve.kvtransfer.export_server import KVExportServer, new_capability
from meshserve.kvtransfer.pull_client import send_done
from meshserve.kvtransfer.pull_sockets import NOTICE_LINGER_MS, PullSockets
from meshserve.kvtransfer.transport import Endpoint
from meshserve.kvtransfer.wire import as_bytes
from tests.polling import polled
from tests.unit.kvtransfer.replicas import Replica

SECRET = ClusterSecret(b"test secret of the done notice tests")
TTL_S = 30.0  # the offers' TTL: a release well before it came from the notice
NOTICE_WAIT_S = 10.0  # how long the test waits for the notice's effect (a third of the TTL)
LINK_SETUP_S = 0.3  # the relay's delay before it opens a connection to the exporter (< NOTICE_LINGER_MS)


@contextlib.contextmanager
def slow_link(address: str):
    """A TCP relay to `address` ("tcp://host:port") that opens each connection LINK_SETUP_S late;
    yields its own "tcp://127.0.0.1:port"."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def pump(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(1 << 16):
                b.sendall(data)
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_WR)

    def relay(client: socket.socket) -> None:
        if done.wait(LINK_SETUP_S):
            client.close()
            return
        upstream = socket.create_connection((host, int(port)))
        back = threading.Thread(target=pump, args=(upstream, client), daemon=True)
        back.start()
        pump(client, upstream)
        back.join(10)
        client.close()
        upstream.close()

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = listener.accept()
                threading.Thread(target=relay, args=(client,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        done.set()
        listener.close()


def offer_direct(src: Replica, server: KVExportServer, rid: str,
                 address: str) -> tuple[str, Endpoint, list[torch.Tensor]]:  # fmt: skip
    """Offer `rid`'s KV under a new capability with a direct ("ipc") description of its frames as
    [cache tensor, byte offset, bytes]: (capability, endpoint at `address`, the sender's caches as
    flat bytes)."""
    export = src.connector.export(rid)  # the offer's pin, let go at the notice (or at the TTL)
    sources = [as_bytes(c.data) for c in src.connector.io.caches]
    ranges = []
    for frame in export.frames:
        i = next(i for i, s in enumerate(sources) if 0 <= frame.data_ptr() - s.data_ptr() < s.numel())
        ranges.append([i, frame.data_ptr() - sources[i].data_ptr(), frame.numel()])
    cap = new_capability()
    server.offer(export, capability=cap, ttl_s=TTL_S, release=src.connector.release)
    blob = pack_offer(SECRET, [cap], export.header_bytes, {"ipc": {"frames": ranges}})
    return cap, Endpoint(address, "h", "cpu", "p", "", direct_offer=blob), sources


def let_go(server: KVExportServer) -> bool:
    """Whether the server holds no offer within NOTICE_WAIT_S (a notice is asynchronous)."""
    deadline = time.monotonic() + NOTICE_WAIT_S
    while server.num_pending and time.monotonic() < deadline:
        time.sleep(0.01)
    return server.num_pending == 0


def test_a_puller_closed_right_after_its_done_notice_still_lets_the_exporter_go():
    src, dst = Replica("gqa", seed=1), Replica("gqa", seed=2)
    server = KVExportServer(SECRET)
    try:
        with polled(server), slow_link(server.address) as address:
            for i in range(3):  # each a fresh puller, closed at once: its notice socket was never connected before
                rid = f"r{i}"
                src.add_request(rid, list(range(100, 137)))
                refs, pins = list(src.kv.pool.ref_counts), src.connector.pins.num_pinned
                cap, endpoint, sources = offer_direct(src, server, rid, address)
                assert src.connector.pins.num_pinned == pins + 1 and src.kv.pool.ref_counts != refs

                sockets = PullSockets()  # the puller's kept sockets (a NixlPuller's or CudaIpcPuller's)

                def move(session, desc, sources=sources):
                    copy_described(session, sources, desc["frames"])

                assert pull_direct(dst.connector, endpoint, cap, "ipc", move, secret=SECRET,
                                   spent=SpentCapabilities(), sockets=sockets)
                sockets.close()  # the puller dropped right after its notice was queued

                got, want = dst.request_bytes(rid), src.request_bytes(rid)
                assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
                assert let_go(server), f"pull {i}: the exporter still holds the offer (the notice was lost)"
                assert src.connector.pins.num_pinned == pins and src.kv.pool.ref_counts == refs
        src.kv.check_invariants()
    finally:
        server.close()


def test_closing_a_puller_whose_exporter_is_gone_ends_within_the_notice_linger():
    """The notices to a dead exporter are dropped after NOTICE_LINGER_MS: close returns at once and
    even a context's term (which waits for what its sockets still hold) ends within that bound."""
    gone = zmq.Context.instance().socket(zmq.ROUTER)
    port = gone.bind_to_random_port("tcp://127.0.0.1")
    gone.close(linger=0)  # nobody listens there now
    context = zmq.Context()
    sockets = PullSockets(context)
    for _ in range(20):
        send_done(f"tcp://127.0.0.1:{port}", new_capability(), secret=SECRET, sockets=sockets)

    ended = threading.Event()

    def close_and_term():
        sockets.close()
        context.term()
        ended.set()

    thread = threading.Thread(target=close_and_term, daemon=True)
    thread.start()
    bound_s = NOTICE_LINGER_MS / 1000 + 8.0  # the linger and a loaded machine's margin
    assert ended.wait(bound_s), "closing the puller waited on an exporter that is gone past the notice linger"
    thread.join(1)
