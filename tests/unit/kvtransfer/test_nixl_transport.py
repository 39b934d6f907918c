"""The NIXL data plane (kvtransfer/nixl_transport.py) between two tiny replicas on CPU caches:
real NIXL agents (UCX, DRAM), the zmq control exchange, the receiver's blocks scattered. The
oracle is the sender's cache bytes; a refused pull must leave every block where it was."""

import contextlib
import threading

import pytest
import torch

from meshserve.core.secret import ClusterSecret
from meshserve.kvtransfer.export_server import KVExportServer, new_capability
from meshserve.kvtransfer.nixl_transport import NixlAgent, NixlPuller, nixl_available
from meshserve.kvtransfer.transport import NIXL, ZMQ, Endpoint, choose_transport
from meshserve.kvtransfer.wire import KVTransferError
from tests.polling import polled
from tests.unit.kvtransfer.replicas import Replica

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")

SECRET = ClusterSecret(b"test secret of the nixl transport tests")


def registered(replica: Replica, agent: NixlAgent) -> Replica:
    agent.register([c.data for c in replica.connector.io.caches])
    return replica


@pytest.fixture(scope="module")
def agents():
    """(exporter's agent, importer's agent): made once, as a rank makes its own at start-up."""
    return NixlAgent("test-exporter"), NixlAgent("test-importer")


@contextlib.contextmanager
def exporter(agent: NixlAgent, kind: str = "gqa"):
    """A sender replica registered with `agent` and its export server, polled by a thread."""
    src = registered(Replica(kind, seed=1), agent)
    server = KVExportServer(SECRET, nixl=agent)
    try:
        with polled(server):
            yield src, server
    finally:
        server.close()


def offer(src: Replica, server: KVExportServer, rid: str, tokens: int = 37) -> tuple[str, list[torch.Tensor]]:
    src.add_request(rid, list(range(100, 100 + tokens)))
    cap = new_capability()
    server.offer(src.connector.export(rid), capability=cap, release=src.connector.release)
    return cap, src.request_bytes(rid)


def endpoint(server: KVExportServer) -> Endpoint:
    return Endpoint(server.address, "h", "cpu", "p", "", nixl=True)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("verify", [False, True])
def test_a_nixl_pull_reads_the_senders_bytes_into_scattered_blocks(agents, kind, verify):
    with exporter(agents[0], kind) as (src, server):
        dst = registered(Replica(kind, seed=2), agents[1])
        dst.fragment(3)  # receiving blocks in several runs: descriptors per run
        puller = NixlPuller(agents[1], verify=verify)
        for rid in ("a", "b"):  # the second pull finds the exporter's agent known (no metadata again)
            cap, expected = offer(src, server, rid)
            assert puller.pull(dst.connector, endpoint(server), cap, secret=SECRET, timeout_s=30) == NIXL
            assert all(torch.equal(a, b) for a, b in zip(dst.request_bytes(rid), expected, strict=True))
        assert server.num_pending == 0 or _drained(server)  # the importer's notices let go of the exports
        assert src.connector.pins.num_pinned == 0
        dst.kv.check_invariants()


def _drained(server: KVExportServer) -> bool:
    """Whether the server lets go of every export within a bounded wait (notices are asynchronous)."""
    import time

    deadline = time.monotonic() + 10
    while server.num_pending and time.monotonic() < deadline:
        time.sleep(0.01)
    return server.num_pending == 0


def test_a_used_or_forged_capability_is_refused_and_reserves_nothing(agents):
    with exporter(agents[0]) as (src, server):
        dst = registered(Replica("gqa", seed=2), agents[1])
        puller = NixlPuller(agents[1])
        cap, _ = offer(src, server, "r")
        assert puller.pull(dst.connector, endpoint(server), cap, secret=SECRET, timeout_s=30) == NIXL
        free = dst.kv.num_free_blocks
        for capability in (cap, new_capability()):  # spent, and never offered
            with pytest.raises(KVTransferError) as info:
                puller.pull(dst.connector, endpoint(server), capability, secret=SECRET, timeout_s=30)
            assert info.value.reason == "unknown_request"
        outsider = ClusterSecret(b"not the cluster's secret")
        cap2, _ = offer(src, server, "s")
        with pytest.raises(KVTransferError) as info:  # a pull without the secret gets no answer
            puller.pull(dst.connector, endpoint(server), cap2, secret=outsider, timeout_s=0.5)
        assert info.value.reason == "timeout"
        assert dst.kv.num_free_blocks == free and "s" not in dst.kv
        assert puller.pull(dst.connector, endpoint(server), cap2, secret=SECRET, timeout_s=30) == NIXL


class _HeldAgent:
    """The importer's NIXL agent as seen by NixlAgent.read: the READ is posted for real but shows
    as in flight until the test has cancelled the pull (a READ of a few KiB ends too soon to
    cancel it from outside)."""

    def __init__(self, agent, cancel: threading.Event, posted: threading.Event) -> None:
        self._agent, self._cancel, self._posted = agent, cancel, posted

    def transfer(self, handle):
        self._agent.transfer(handle)
        self._posted.set()
        return "PROC"

    def check_xfer_state(self, handle):
        return "PROC" if not self._cancel.is_set() else self._agent.check_xfer_state(handle)

    def __getattr__(self, name):
        return getattr(self._agent, name)


def test_a_pull_cancelled_mid_read_frees_its_blocks_and_the_exporters_pin(agents):
    with exporter(agents[0]) as (src, server):
        dst = registered(Replica("gqa", seed=2), agents[1])
        free = dst.kv.num_free_blocks
        cancel, posted = threading.Event(), threading.Event()
        held = NixlAgent("test-importer-held")
        held.register([c.data for c in dst.connector.io.caches])
        held._agent = _HeldAgent(held._agent, cancel, posted)
        cap, _ = offer(src, server, "r")
        errors = []

        def pull():
            try:
                NixlPuller(held).pull(dst.connector, endpoint(server), cap, secret=SECRET, timeout_s=30, cancel=cancel)
            except KVTransferError as exc:
                errors.append(exc.reason)
        thread = threading.Thread(target=pull)
        thread.start()
        assert posted.wait(30), "the READ was never posted"
        cancel.set()
        thread.join(30)
        assert errors == ["cancelled"]
        assert dst.kv.num_free_blocks == free and "r" not in dst.kv
        dst.kv.check_invariants()
        assert _drained(server) and src.connector.pins.num_pinned == 0  # the importer's notice let go


def test_frames_outside_registered_memory_come_as_bytes(agents):
    with exporter(agents[0]) as (src, server):
        dst = registered(Replica("gqa", seed=2), agents[1])
        src.add_request("r", list(range(100, 137)))
        export = src.connector.export("r")
        copies = [f.clone() for f in export.frames]  # not registered: the exporter cannot describe them
        cap = new_capability()
        server.offer(type(export)(export.header, copies), capability=cap)
        expected = src.request_bytes("r")
        src.connector.release(export)
        assert NixlPuller(agents[1]).pull(dst.connector, endpoint(server), cap, secret=SECRET, timeout_s=30) == ZMQ
        assert all(torch.equal(a, b) for a, b in zip(dst.request_bytes("r"), expected, strict=True))


@pytest.mark.parametrize(("requested", "mine", "theirs", "want"), [
    ("auto", True, True, NIXL), ("nixl", True, True, NIXL), ("auto", True, False, ZMQ),
    ("nixl", False, True, ZMQ), ("zmq", True, True, ZMQ),
])  # fmt: skip
def test_auto_chooses_nixl_where_both_ends_have_it(requested, mine, theirs, want):
    def end(nixl):
        return Endpoint("tcp://127.0.0.1:1", "h", "cpu", "p", "", nixl=nixl)

    got, why = choose_transport(requested, end(mine), end(theirs))
    assert got == want
    assert "NIXL" in why if (requested, want) == ("nixl", ZMQ) else "NIXL" not in why
