"""A pull that asks the exporter nothing first (kvtransfer/direct_offer.py) and the CUDA IPC copy's
device-independent half (cuda_ipc.copy_described, check_ranges), run on CPU tensors: the bytes a
CUDA IPC pull copies out of the exporter's mapped allocations, with or without one batched launch,
into fresh or scattered blocks. The oracle is the sender's cache bytes; a refused description must
leave nothing reserved."""

import msgpack
import pytest
import torch

from meshserve.core.secret import ClusterSecret
from meshserve.kvtransfer.cuda_ipc import check_ranges, copy_described
from meshserve.kvtransfer.direct_offer import SpentCapabilities, open_offer, pack_offer
from meshserve.kvtransfer.nixl_agent import _POLL_FRACTION, _POLL_SLEEP_S, _SPIN_S, poll_pause_s
from meshserve.kvtransfer.wire import KVTransferError, as_bytes
from tests.unit.kvtransfer.replicas import Replica

SECRET = ClusterSecret(b"test secret of the direct pull tests")


def described(src: Replica, rid: str) -> tuple[bytes, list[torch.Tensor], list[list[int]]]:
    """(header, the sender's cache tensors as flat bytes, each frame as [tensor, byte offset, bytes]):
    what an importer holds once it mapped the exporter's allocations (IpcExporter.describe's
    ranges, computed here from the frames' addresses as torch's storage offsets give them)."""
    export = src.connector.export(rid)
    sources = [as_bytes(c.data) for c in src.connector.io.caches]
    ranges = []
    for frame in export.frames:
        i = next(i for i, s in enumerate(sources) if 0 <= frame.data_ptr() - s.data_ptr() < s.numel())
        ranges.append([i, frame.data_ptr() - sources[i].data_ptr(), frame.numel()])
    return export.header_bytes, sources, ranges


@pytest.mark.parametrize("kind", ["gqa", "hybrid", "sparse_mla"])
@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("batch_bytes", [0, 1 << 30])  # a copy per frame, or one batched launch
@pytest.mark.parametrize("verify", [False, True])
def test_described_frames_are_copied_into_our_blocks(kind, scattered, batch_bytes, verify):
    src, dst = Replica(kind, seed=1), Replica(kind, seed=2)
    src.add_request("r", list(range(100, 137)))
    if scattered:
        dst.fragment(3)
    header, sources, ranges = described(src, "r")
    with dst.connector.begin_import(header) as session:
        if not verify:
            session.trust_frames()
        assert all(d is not None for d in session.destinations()) != scattered
        copy_described(session, sources, ranges, batch_bytes=batch_bytes)
        session.finish()  # verify: the checksum of what landed in our blocks
    assert all(torch.equal(a, b) for a, b in zip(dst.request_bytes("r"), src.request_bytes("r"), strict=True))
    dst.kv.check_invariants()


def test_a_corrupted_source_is_caught_by_a_verifying_copy_and_frees_the_blocks():
    src, dst = Replica("gqa", seed=1), Replica("gqa", seed=2)
    src.add_request("r", list(range(100, 137)))
    header, sources, ranges = described(src, "r")
    sources[0][ranges[0][1] + 5] ^= 0x40  # the exporter's memory changed under the offer
    free = dst.kv.num_free_blocks
    with pytest.raises(KVTransferError) as info, dst.connector.begin_import(header) as session:
        copy_described(session, sources, ranges, batch_bytes=1 << 30)
        session.finish()
    assert info.value.reason == "checksum"
    assert dst.kv.num_free_blocks == free and dst.kv.num_requests == 0


@pytest.mark.parametrize(("change", "reason"), [
    (lambda r, n: r[:-1], "truncated"),  # a frame fewer than the header lists
    (lambda r, n: r + [r[-1]], "truncated"),
    (lambda r, n: [[s, o, b - 1] for s, o, b in r], "truncated"),  # sizes that differ from the header's
    (lambda r, n: [[s, o + n, b] for s, o, b in r], "bad_header"),  # past the end of the allocation
    (lambda r, n: [[s, -1, b] for s, o, b in r], "bad_header"),
    (lambda r, n: [[s, 2**63 - 8, b] for s, o, b in r], "bad_header"),  # offset + bytes would wrap around
    (lambda r, n: [[7, o, b] for s, o, b in r], "bad_header"),  # an allocation not described
    (lambda r, n: [[s, o] for s, o, b in r], "bad_header"),
    (lambda r, n: "frames", "bad_header"),
])  # fmt: skip
def test_a_description_that_does_not_match_the_header_is_refused_before_any_copy(change, reason):
    src, dst = Replica("gqa", seed=1), Replica("gqa", seed=2)
    src.add_request("r", list(range(100, 137)))
    header, sources, ranges = described(src, "r")
    before = [as_bytes(c.data).clone() for c in dst.connector.io.caches]  # bytes: bf16 NaNs never compare equal
    free = dst.kv.num_free_blocks
    with pytest.raises(KVTransferError) as info, dst.connector.begin_import(header) as session:
        copy_described(session, sources, change(ranges, max(s.numel() for s in sources)))
    assert info.value.reason == reason
    assert dst.kv.num_free_blocks == free and dst.kv.num_requests == 0  # nothing reserved is kept
    assert all(torch.equal(a, as_bytes(c.data)) for a, c in zip(before, dst.connector.io.caches, strict=True))


def test_check_ranges_names_the_first_bad_frame():
    with pytest.raises(KVTransferError, match="frame 1 lies outside"):
        check_ranges([[0, 0, 8], [0, 8, 9]], [16], [8, 9])
    with pytest.raises(KVTransferError, match="frame 1 has 8 bytes, expected 9"):
        check_ranges([[0, 0, 8], [0, 8, 8]], [16], [8, 9])
    assert check_ranges([], [16], []) == []


def test_a_direct_offer_opens_only_for_its_capabilities_and_kinds():
    header = b"\x81\xa1h\x01"
    blob = pack_offer(SECRET, ["cap-a", "cap-b"], header, {"ipc": {"frames": [[0, 0, 8]]}, "nixl": {"agent": "x"}})
    offer = open_offer(SECRET, "cap-b", blob)
    assert offer.header == header and offer.descriptions["ipc"] == {"frames": [[0, 0, 8]]}
    for capability, secret in (("cap-c", SECRET), ("cap-a", ClusterSecret(b"not the cluster's secret"))):
        with pytest.raises(KVTransferError) as info:
            open_offer(secret, capability, blob)
        assert info.value.reason == "auth"
    _, body, macs = msgpack.unpackb(blob)
    with pytest.raises(KVTransferError) as info:  # the body altered after signing
        open_offer(SECRET, "cap-a", msgpack.packb([header, body[:-1] + b"\x00", macs]))
    assert info.value.reason == "auth"
    odd = pack_offer(SECRET, ["cap-a"], header, {"rdma": {}})  # signed, but not a kind this importer reads
    with pytest.raises(KVTransferError) as info:
        open_offer(SECRET, "cap-a", odd)
    assert info.value.reason == "bad_header"
    with pytest.raises(KVTransferError) as info:
        open_offer(SECRET, "cap-a", b"\x00not msgpack")
    assert info.value.reason == "bad_header"


def test_a_capability_is_spent_once_per_exporter():
    spent = SpentCapabilities()
    spent.spend("tcp://a", "cap")
    spent.spend("tcp://b", "cap")  # a re-sharding rank pulls one key from several exporters
    with pytest.raises(KVTransferError) as info:
        spent.spend("tcp://a", "cap")
    assert info.value.reason == "unknown_request"


def test_a_reads_poll_spins_then_sleeps_a_share_of_the_time_waited():
    assert poll_pause_s(0.0) == 0.0 and poll_pause_s(_SPIN_S) == 0.0  # most READs end while it spins
    waits = [_SPIN_S * 1.01, 1e-3, 3e-3, 8e-3, 1.0]
    pauses = [poll_pause_s(w) for w in waits]
    assert pauses == sorted(pauses) and pauses[-1] == _POLL_SLEEP_S[1]
    for waited, pause in zip(waits, pauses, strict=True):  # a READ is seen done at most a share late
        assert _POLL_SLEEP_S[0] <= pause <= max(_POLL_SLEEP_S[0], waited * _POLL_FRACTION)


def test_a_direct_pull_asks_nothing_first_spends_its_capability_and_lets_the_exporter_go():
    """pull_direct (what a CUDA IPC pull runs, with the copy done here by copy_described over the
    sender's CPU caches): the bytes land, the exporter lets go at the done notice, the capability
    is spent on both ends, a refused description keeps nothing and still lets the exporter go, and
    an offer without a description of the asked kind is left to zmq."""
    import time

    from meshserve.kvtransfer.direct_offer import pull_direct
    from meshserve.kvtransfer.export_server import KVExportServer, new_capability, pull_kv
    from meshserve.kvtransfer.pull_sockets import PullSockets
    from meshserve.kvtransfer.transport import Endpoint
    from tests.polling import polled

    src, dst = Replica("gqa", seed=1), Replica("gqa", seed=2)
    server, spent, sockets = KVExportServer(SECRET), SpentCapabilities(), PullSockets()

    def offered(rid: str, frames=None) -> tuple[str, Endpoint, list[torch.Tensor]]:
        src.add_request(rid, list(range(100, 137)))
        header, sources, ranges = described(src, rid)
        cap = new_capability()
        export = src.connector.export(rid)  # the offer's own pin, let go at the notice
        server.offer(export, capability=cap, release=src.connector.release)
        blob = pack_offer(SECRET, [cap], header, {"ipc": {"frames": ranges if frames is None else frames}})
        return cap, Endpoint(server.address, "h", "cpu", "p", "", direct_offer=blob), sources

    def drained() -> bool:
        deadline = time.monotonic() + 10
        while server.num_pending and time.monotonic() < deadline:
            time.sleep(0.01)
        return server.num_pending == 0

    try:
        with polled(server):
            cap, endpoint, sources = offered("a")
            pins = src.connector.pins.num_pinned

            def move(session, desc):
                copy_described(session, sources, desc["frames"])

            assert pull_direct(dst.connector, endpoint, cap, "ipc", move, secret=SECRET, spent=spent, sockets=sockets)
            assert all(torch.equal(a, b) for a, b in zip(dst.request_bytes("a"), src.request_bytes("a"), strict=True))
            assert drained() and src.connector.pins.num_pinned == pins - 1  # the notice let go of the offer
            with pytest.raises(KVTransferError) as info:  # spent here
                pull_direct(dst.connector, endpoint, cap, "ipc", move, secret=SECRET, spent=spent, sockets=sockets)
            assert info.value.reason == "unknown_request"
            with pytest.raises(KVTransferError) as info:  # and at the exporter
                pull_kv(dst.connector, server.address, cap, secret=SECRET, timeout_s=30)
            assert info.value.reason == "unknown_request"

            free = dst.kv.num_free_blocks
            cap, endpoint, sources = offered("b", frames=[[0, 0, 8]])  # fewer frames than the header
            with pytest.raises(KVTransferError) as info:
                pull_direct(dst.connector, endpoint, cap, "ipc", move, secret=SECRET, spent=spent, sockets=sockets)
            assert info.value.reason == "truncated" and dst.kv.num_free_blocks == free and "b" not in dst.kv
            assert drained()  # refused, and the exporter was told all the same

            cap, endpoint, _ = offered("c")
            assert not pull_direct(dst.connector, endpoint, cap, "nixl", move, secret=SECRET, spent=spent,
                                   sockets=sockets)  # no NIXL description: nothing done, zmq's turn
            pull_kv(dst.connector, server.address, cap, secret=SECRET, timeout_s=30)
            assert all(torch.equal(a, b) for a, b in zip(dst.request_bytes("c"), src.request_bytes("c"), strict=True))
            dst.kv.check_invariants()
    finally:
        server.close()
        sockets.close()


def test_an_importer_reuses_an_exporters_mapped_views_until_a_mapping_closes(monkeypatch):
    """IpcImporter resolves an exporter's storages list (each allocation mapped, its views made)
    once and reuses it at later pulls; once a mapping of it is closed (the exporter forgotten, or
    evicted beyond max_open) the list is resolved afresh, so no kept view holds a closed mapping
    open. Mapping is faked with CPU storages (no GPU here)."""
    from meshserve.kvtransfer import cuda_ipc

    opened = []

    def new_shared(device, handle, size, *rest):
        opened.append(bytes(handle))
        return torch.UntypedStorage(size)

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", staticmethod(new_shared), raising=False)
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    monkeypatch.setattr(cuda_ipc, "local_gpus", lambda: {"gpu-0": 0})
    entry = lambda h, size: ["gpu-0", h, size, 0, b"rc", 0, None, False]  # noqa: E731
    storages = [entry(b"handle-a", 64), entry(b"handle-b", 40)]
    importer = cuda_ipc.IpcImporter(max_open=2)
    first = importer._sources("p1", storages)
    assert opened == [b"handle-a", b"handle-b"] and first.nbytes.tolist() == [64, 40]
    assert first.words[0] is not None and first.words[1] is not None  # 8-byte sized: copied as words
    assert importer._sources("p1", [list(e) for e in storages]) is first and len(opened) == 2  # kept
    importer.forget("p1")
    assert importer.num_open == 0 and importer._sources("p1", storages) is not first and len(opened) == 4
    importer._sources("p2", [entry(b"handle-c", 8)])  # a third mapping: handle-a's is closed (max_open 2)
    assert importer.num_open == 2
    again = importer._sources("p1", storages)  # mapped afresh, not served from the kept list
    assert opened[-2:] == [b"handle-a", b"handle-b"] and again is not first and again.flat[0].numel() == 64
