"""The NIXL data plane (kvtransfer/nixl_transport.py, nixl_agent.py) between two tiny replicas on
CPU caches: real NIXL agents (UCX, DRAM), the direct offer carried with the endpoint (no round trip
to the exporter), the receiver's blocks scattered. The oracle is the sender's cache bytes; a
refused pull must leave every block where it was and the exporter's pin must go."""

import contextlib
import dataclasses
import threading
import time

import msgpack
import pytest
import torch

from meshserve.core.secret import ClusterSecret
from meshserve.kvtransfer.export_server import KVExportServer, new_capability, pull_kv
from meshserve.kvtransfer.nixl_agent import Region
from meshserve.kvtransfer.nixl_transport import NixlAgent, NixlPuller, nixl_available
from meshserve.kvtransfer.transport import CUDA_IPC, NIXL, ZMQ, Endpoint, choose_transport
from meshserve.kvtransfer.wire import KVTransferError, as_bytes
from tests.polling import polled
from tests.unit.kvtransfer.replicas import Replica

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")

SECRET = ClusterSecret(b"test secret of the nixl transport tests")


@contextlib.contextmanager
def registered(replica: Replica, agent: NixlAgent):
    """`replica` with its caches registered with `agent` (as a rank at start-up), deregistered at
    the end (before the caches are freed)."""
    tensors = [c.data for c in replica.connector.io.caches]
    agent.register(tensors)
    try:
        yield replica
    finally:
        agent.deregister(tensors)


@pytest.fixture(scope="module")
def agents():
    """(exporter's agent, importer's agent): made once, as a rank makes its own at start-up."""
    return NixlAgent("test-exporter"), NixlAgent("test-importer")


@contextlib.contextmanager
def exporter(agent: NixlAgent, kind: str = "gqa"):
    """A sender replica registered with `agent` and its export server, polled by a thread."""
    server = KVExportServer(SECRET, nixl=agent)
    try:
        with registered(Replica(kind, seed=1), agent) as src, polled(server):
            yield src, server
    finally:
        server.close()


def offer(src: Replica, server: KVExportServer, rid: str, tokens: int = 37) -> tuple[str, Endpoint, list]:
    """Offer a new request of `tokens` tokens: (capability, the endpoint with its direct offer, its bytes)."""
    src.add_request(rid, list(range(100, 100 + tokens)))
    cap = new_capability()
    export = src.connector.export(rid)
    server.offer(export, capability=cap, release=src.connector.release)
    endpoint = Endpoint(server.address, "h", "cpu", "p", "", nixl=True,
                        direct_offer=server.describe_direct(export, [cap]))
    return cap, endpoint, src.request_bytes(rid)


def drained(server: KVExportServer) -> bool:
    """Whether the server lets go of every export within a bounded wait (notices are asynchronous)."""
    deadline = time.monotonic() + 10
    while server.num_pending and time.monotonic() < deadline:
        time.sleep(0.01)
    return server.num_pending == 0


@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("verify", [False, True])
def test_a_nixl_pull_reads_the_senders_bytes_into_scattered_blocks(agents, kind, verify):
    with exporter(agents[0], kind) as (src, server), contextlib.ExitStack() as stack:
        dst = stack.enter_context(registered(Replica(kind, seed=2), agents[1]))
        dst.fragment(3)  # receiving blocks scattered: our block ids one by one
        puller = NixlPuller(agents[1], verify=verify)
        peers = []
        for rid in ("a", "b"):
            cap, endpoint, expected = offer(src, server, rid)
            assert puller.pull(dst.connector, endpoint, cap, secret=SECRET, timeout_s=30) == NIXL
            assert all(torch.equal(a, b) for a, b in zip(dst.request_bytes(rid), expected, strict=True))
            peers.append(agents[1]._peers[agents[0].name])
        assert peers[0] is peers[1]  # the exporter's agent loaded and its list prepared once
        assert drained(server) and src.connector.pins.num_pinned == 0  # the importer's notices let go
        dst.kv.check_invariants()


def test_a_used_forged_or_altered_offer_is_refused_and_reserves_nothing(agents):
    with exporter(agents[0]) as (src, server), contextlib.ExitStack() as stack:
        dst = stack.enter_context(registered(Replica("gqa", seed=2), agents[1]))
        puller = NixlPuller(agents[1])
        cap, endpoint, _ = offer(src, server, "r")
        assert puller.pull(dst.connector, endpoint, cap, secret=SECRET, timeout_s=30) == NIXL
        free = dst.kv.num_free_blocks

        def refused(endpoint, capability, *, secret=SECRET) -> str:
            with pytest.raises(KVTransferError) as info:
                puller.pull(dst.connector, endpoint, capability, secret=secret, timeout_s=30)
            return info.value.reason

        assert refused(endpoint, cap) == "unknown_request"  # spent here
        assert drained(server)  # the notice spent it at the exporter too: zmq refuses it as well
        with pytest.raises(KVTransferError) as info:
            pull_kv(dst.connector, server.address, cap, secret=SECRET, timeout_s=30)
        assert info.value.reason == "unknown_request"
        cap2, endpoint2, expected = offer(src, server, "s")
        assert refused(endpoint2, new_capability()) == "auth"  # made for another capability
        header, body, macs = msgpack.unpackb(endpoint2.direct_offer)
        altered = msgpack.packb([header, body[:-1] + bytes([body[-1] ^ 1]), macs])
        assert refused(dataclasses.replace(endpoint2, direct_offer=altered), cap2) == "auth"
        outsider = ClusterSecret(b"not the cluster's secret")
        assert refused(endpoint2, cap2, secret=outsider) == "auth"
        assert dst.kv.num_free_blocks == free and "s" not in dst.kv
        assert puller.pull(dst.connector, endpoint2, cap2, secret=SECRET, timeout_s=30) == NIXL
        assert all(torch.equal(a, b) for a, b in zip(dst.request_bytes("s"), expected, strict=True))


class _HeldAgent:
    """The importer's NIXL agent as seen by NixlAgent.read: the READ is posted for real but shows
    as in flight until `until` is set (a READ of a few KiB ends too soon to stop it from outside)."""

    def __init__(self, agent, until: threading.Event, posted: threading.Event) -> None:
        self._agent, self._until, self._posted = agent, until, posted

    def transfer(self, handle):
        self._agent.transfer(handle)
        self._posted.set()
        return "PROC"

    def check_xfer_state(self, handle):
        state = self._agent.check_xfer_state(handle)  # progresses the agent, as a real poll does
        return "PROC" if not self._until.is_set() else state

    def __getattr__(self, name):
        return getattr(self._agent, name)


@pytest.mark.parametrize("stop", ["cancelled", "timeout"])
def test_a_pull_stopped_mid_read_frees_its_blocks_and_the_exporters_pin(agents, stop):
    with exporter(agents[0]) as (src, server):
        dst = Replica("gqa", seed=2)
        cancel, until, posted = threading.Event(), threading.Event(), threading.Event()
        held = NixlAgent(f"test-importer-held-{stop}")
        held.register([c.data for c in dst.connector.io.caches])
        held._agent = _HeldAgent(held._agent, until, posted)
        puller = NixlPuller(held)  # one per rank, kept: its zmq socket carries the notices
        free = dst.kv.num_free_blocks
        cap, endpoint, _ = offer(src, server, "r")
        errors = []

        def pull():
            try:
                puller.pull(dst.connector, endpoint, cap, secret=SECRET,
                            timeout_s=30 if stop == "cancelled" else 0.3, cancel=cancel)
            except KVTransferError as exc:
                errors.append(exc.reason)
            finally:
                until.set()

        thread = threading.Thread(target=pull)
        thread.start()
        assert posted.wait(30), "the READ was never posted"
        if stop == "cancelled":
            cancel.set()
        thread.join(30)
        assert errors == [stop]
        assert dst.kv.num_free_blocks == free and "r" not in dst.kv  # 0 blocks leaked: the prompt is recomputed
        dst.kv.check_invariants()
        assert drained(server) and src.connector.pins.num_pinned == 0  # the importer's notice let go
        held.close()


def test_frames_outside_registered_memory_come_as_bytes(agents):
    with exporter(agents[0]) as (src, server), contextlib.ExitStack() as stack:
        dst = stack.enter_context(registered(Replica("gqa", seed=2), agents[1]))
        src.add_request("r", list(range(100, 137)))
        export = src.connector.export("r")
        copies = type(export)(export.header, [f.clone() for f in export.frames])  # not registered memory
        cap = new_capability()
        server.offer(copies, capability=cap)
        assert server.describe_direct(copies, [cap]) == b""  # nothing to READ: the endpoint has no direct offer
        expected = src.request_bytes("r")
        src.connector.release(export)
        endpoint = Endpoint(server.address, "h", "cpu", "p", "", nixl=True)
        assert NixlPuller(agents[1]).pull(dst.connector, endpoint, cap, secret=SECRET, timeout_s=30) == ZMQ
        assert all(torch.equal(a, b) for a, b in zip(dst.request_bytes("r"), expected, strict=True))


def test_a_first_read_into_caches_outside_the_registered_memory_registers_them_for_that_read(agents):
    importer = NixlAgent("test-importer-staging")  # fresh: its registered regions' list is made at this pull
    with exporter(agents[0]) as (src, server), registered(Replica("gqa", seed=2), importer):
        staging = Replica("gqa", seed=3)  # like a re-sharding pull's staging caches: not registered
        generation = importer.generation
        cap, endpoint, expected = offer(src, server, "r")
        assert NixlPuller(importer).pull(staging.connector, endpoint, cap, secret=SECRET, timeout_s=30) == NIXL
        assert all(torch.equal(a, b) for a, b in zip(staging.request_bytes("r"), expected, strict=True))
        assert importer.generation == generation  # registered for that READ only: peers need nothing new
    importer.close()


def test_an_exporter_that_registers_more_memory_is_loaded_afresh():
    src_agent, dst_agent = NixlAgent("test-exporter-growing"), NixlAgent("test-importer-2")
    with exporter(src_agent) as (src, server), contextlib.ExitStack() as stack:
        dst = stack.enter_context(registered(Replica("gqa", seed=2), dst_agent))
        puller = NixlPuller(dst_agent)
        cap, endpoint, expected = offer(src, server, "a")
        assert puller.pull(dst.connector, endpoint, cap, secret=SECRET, timeout_s=30) == NIXL
        first = dst_agent._peers[src_agent.name]
        # more memory at the exporter: a new generation, new metadata
        stack.enter_context(registered(Replica("mla", seed=3), src_agent))
        cap, endpoint, expected = offer(src, server, "b")
        assert puller.pull(dst.connector, endpoint, cap, secret=SECRET, timeout_s=30) == NIXL
        assert all(torch.equal(a, b) for a, b in zip(dst.request_bytes("b"), expected, strict=True))
        assert dst_agent._peers[src_agent.name].generation == src_agent.generation != first.generation
    dst_agent.close()
    src_agent.close()


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


@pytest.mark.parametrize(("requested", "process", "gpu", "want"), [
    ("auto", "p2", "GPU-0", CUDA_IPC),  # two CUDA processes of one host: cuda_ipc measured faster
    ("auto", "p2", "GPU-9", NIXL),  # the exporter's GPU is not visible here (a Ray actor's own GPU)
    ("auto", "p1", "GPU-0", NIXL),  # one process: no CUDA IPC
    ("nixl", "p2", "GPU-0", NIXL),  # asked for: NIXL even where CUDA IPC would join the ends
    ("cuda_ipc", "p2", "GPU-9", ZMQ),
])  # fmt: skip
def test_auto_prefers_cuda_ipc_between_gpu_processes_of_one_host_then_nixl(requested, process, gpu, want):
    def end(process, gpu):
        return Endpoint("tcp://127.0.0.1:1", "h/boot", "cuda", process, gpu, nixl=True)

    got, why = choose_transport(requested, end("p1", "GPU-0"), end(process, gpu), visible_gpus={"GPU-0"})
    assert got == want and bool(why) == (want == ZMQ)


def test_an_endpoint_carries_its_direct_offer_over_the_wire():
    end = Endpoint("tcp://127.0.0.1:1", "h", "cpu", "p", "", nixl=True, direct_offer=b"\x01offer")
    assert Endpoint.from_wire(msgpack.unpackb(msgpack.packb(end.to_wire()))) == end


def test_a_description_naming_blocks_outside_the_exporters_region_is_refused_before_the_read(agents):
    """A description signed for the capability but naming blocks past the exporter's region (or of
    another size) is refused ("bad_header") before any READ: nothing reserved is kept, the
    exporter is told (its pin goes)."""
    from meshserve.kvtransfer.direct_offer import open_offer, pack_offer

    with exporter(agents[0]) as (src, server), contextlib.ExitStack() as stack:
        dst = stack.enter_context(registered(Replica("gqa", seed=2), agents[1]))
        free = dst.kv.num_free_blocks
        puller = NixlPuller(agents[1])  # kept, as a rank keeps it: a dropped one's socket drops its queued notice
        for bad in ("past the end", "a block more"):
            cap, endpoint, _ = offer(src, server, f"r-{bad}")
            opened = open_offer(SECRET, cap, endpoint.direct_offer)
            desc = dict(opened.descriptions["nixl"])
            region, first, count = desc["frames"][-1]
            num_blocks = desc["regions"][region][2]
            desc["frames"] = desc["frames"][:-1] + [[region, num_blocks - 1, count] if bad == "past the end"
                                                    else [region, first, count + 1]]
            forged = pack_offer(SECRET, [cap], opened.header, {"nixl": desc})
            with pytest.raises(KVTransferError) as info:
                puller.pull(dst.connector, dataclasses.replace(endpoint, direct_offer=forged), cap, secret=SECRET,
                            timeout_s=30)
            assert info.value.reason == "bad_header"
            assert dst.kv.num_free_blocks == free and dst.kv.num_requests == 0
        assert drained(server) and src.connector.pins.num_pinned == 0


def test_a_timed_pull_marks_its_steps_in_order(agents):
    """bench/kv_handover.py --phases: a NIXL pull marks the steps pull_phases.py lists, in its order."""
    from meshserve.kvtransfer.pull_phases import PullPhases

    with exporter(agents[0]) as (src, server), contextlib.ExitStack() as stack:
        dst = stack.enter_context(registered(Replica("gqa", seed=2), agents[1]))
        cap, endpoint, expected = offer(src, server, "r")
        phases = PullPhases()
        assert NixlPuller(agents[1]).pull(dst.connector, endpoint, cap, secret=SECRET, timeout_s=30,
                                          phases=phases) == NIXL
        steps = phases.durations()
        assert list(steps) == ["offer", "header", "peer", "indices", "prep", "post", "wait", "release", "accept",
                               "notify", "finish", "total"]
        total = steps.pop("total")
        assert all(s >= 0 for s in steps.values()) and sum(steps.values()) == pytest.approx(total)
        assert all(torch.equal(a, b) for a, b in zip(dst.request_bytes("r"), expected, strict=True))


def test_an_agent_describes_frames_by_the_region_that_holds_them():
    """describe finds each frame's region by address: whole blocks of one registered tensor are
    [region, first block, count]; a frame off a block boundary, not whole blocks, or outside
    every region makes the export undescribable (its bytes then go over zmq)."""
    agent = NixlAgent("test-describer")
    tensors = [torch.zeros(8, 4, dtype=torch.int32) for _ in range(3)]  # 16-byte blocks
    agent.register(tensors)
    try:
        order = [Region.of(t) for t in tensors]
        listed = [Region(*r) for r in agent.describe([as_bytes(tensors[0][:1])])["regions"]]
        index = [listed.index(r) for r in order]  # the description's region of each tensor
        desc = agent.describe([as_bytes(tensors[1][2:5]), as_bytes(tensors[2][7:8]), as_bytes(tensors[0])])
        assert desc["frames"] == [[index[1], 2, 3], [index[2], 7, 1], [index[0], 0, 8]]
        whole = as_bytes(tensors[1])
        assert agent.describe([whole[8:40]]) is None  # starts mid-block
        assert agent.describe([as_bytes(tensors[2][6:8]), whole[16:20]]) is None  # not whole blocks
        assert agent.describe([as_bytes(torch.zeros(4, 4, dtype=torch.int32))]) is None  # not registered
    finally:
        agent.close()
