"""The fixed costs taken off a pull (issue 19): connected sockets kept per exporter, the cache
scales read from the device only when they changed, the header checks in one pass, and the
destinations and index rows made once per import. Each keeps what the pull checked before:
bytes, refusals, and no block left held."""

import threading
import time

import pytest
import torch

from meshserve.core.secret import ClusterSecret
from meshserve.kvtransfer.export_server import KVExportServer, new_capability
from meshserve.kvtransfer.pull_sockets import PullSockets
from meshserve.kvtransfer.transport import ZMQ, Endpoint, ZmqPuller
from meshserve.kvtransfer.wire import KVHeader, KVTransferError
from tests.unit.kvtransfer.replicas import Replica

SECRET = ClusterSecret(b"test secret of the pull path tests")


def _serve(server: KVExportServer, done: threading.Event) -> threading.Thread:
    def loop():
        while not done.is_set():
            server.poll(5)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def test_a_puller_reuses_its_socket_only_after_a_whole_answer():
    src = Replica("gqa", seed=1)
    for rid in ("a", "b", "c"):
        src.add_request(rid, list(range(100, 137)))
    server = KVExportServer(SECRET)
    caps = {rid: new_capability() for rid in ("a", "b", "c")}
    for rid, cap in caps.items():
        server.offer(src.connector.export(rid), capability=cap)
    done = threading.Event()
    thread = _serve(server, done)
    try:
        endpoint = Endpoint(server.address, "", "cpu", "")
        puller = ZmqPuller()
        dst = Replica("gqa", seed=2)
        dst.fragment(3)
        assert puller.pull(dst.connector, endpoint, caps["a"], secret=SECRET, timeout_s=30) == ZMQ
        assert puller.sockets.num_created == 1 and puller.sockets.num_idle(server.address) == 1
        other = Replica("gqa", seed=3, model_id="another model")  # refuses the layout
        free = other.kv.num_free_blocks
        with pytest.raises(KVTransferError) as info:
            puller.pull(other.connector, endpoint, caps["b"], secret=SECRET, timeout_s=30)
        assert info.value.reason == "layout" and other.kv.num_free_blocks == free
        # the refused pull left messages unread on its socket: closed, not kept for the next pull
        assert puller.sockets.num_idle(server.address) == 0
        dst2 = Replica("gqa", seed=4)
        puller.pull(dst2.connector, endpoint, caps["c"], secret=SECRET, timeout_s=30)
        assert puller.sockets.num_created == 2
        for got_from, rid in ((dst, "a"), (dst2, "c")):  # bit-exact through the kept and the new socket
            assert all(torch.equal(x, y) for x, y in zip(got_from.request_bytes(rid), src.request_bytes(rid),
                                                         strict=True))
        dst.kv.check_invariants()
    finally:
        done.set()
        thread.join(10)
        server.close()
        puller.sockets.close()


def test_pull_sockets_keep_at_most_max_idle():
    pool = PullSockets(max_idle=1)
    a, b = pool.take("tcp://127.0.0.1:1"), pool.take("tcp://127.0.0.1:1")
    pool.give_back("tcp://127.0.0.1:1", a)
    pool.give_back("tcp://127.0.0.1:1", b)  # over max_idle: closed
    assert pool.num_idle("tcp://127.0.0.1:1") == 1 and b.closed and not a.closed
    assert pool.take("tcp://127.0.0.1:1") is a and pool.num_created == 2
    pool.give_back("tcp://127.0.0.1:1", a)
    pool.close()
    assert a.closed and pool.num_idle("tcp://127.0.0.1:1") == 0


def test_idle_sockets_of_an_exporter_that_went_away_are_closed():
    pool = PullSockets(idle_s=0.05)
    gone, live = pool.take("tcp://127.0.0.1:1"), pool.take("tcp://127.0.0.1:2")
    pool.give_back("tcp://127.0.0.1:1", gone)
    time.sleep(0.1)
    pool.give_back("tcp://127.0.0.1:2", live)  # prunes what idled past idle_s
    assert gone.closed and pool.num_idle("tcp://127.0.0.1:1") == 0
    assert not live.closed and pool.take("tcp://127.0.0.1:2") is live
    pool.give_back("tcp://127.0.0.1:2", live)
    pool.close()


def test_a_changed_scale_is_seen_by_the_next_import():
    src, dst = Replica("fp8", seed=1), Replica("fp8", seed=2)
    src.add_request("r", list(range(100, 137)))
    export = src.connector.export("r")
    dst.connector.io.check(export.header)  # equal scales (1.0): accepted, and remembered
    dst.caches[0].k_scale.fill_(2.0)  # an in-place torch write: the memo sees it
    with pytest.raises(KVTransferError, match="cache scales differ") as info:
        dst.connector.import_(export.header, export.frames)
    assert info.value.reason == "layout" and dst.kv.num_requests == 0
    dst.caches[0].k_scale.fill_(1.0)
    assert dst.connector.import_(export.header, export.frames)
    src.caches[1].v_scale = torch.tensor(0.5)  # a new tensor object: the sender's memo sees it too
    src.add_request("s", list(range(200, 237)))
    assert src.connector.export("s").header.scales[1] == (1.0, 0.5)


@pytest.mark.parametrize(("frames", "match"), [
    (lambda f: f + ((len(f), 0, 1),), "do not tile"),  # a layer the layout does not have
    (lambda f: f[1:], "cover 0 of"),  # a layer's first frame missing
    (lambda f: (f[0][:2] + (0,),) + f[1:], "do not tile"),  # an empty frame
])
def test_frames_that_do_not_tile_every_layer_are_refused(frames, match):
    src, dst = Replica("gqa", seed=1), Replica("gqa", seed=2)
    src.add_request("r", list(range(100, 137)))
    header = src.connector.export("r", max_frame_bytes=1 << 30).header
    bad = KVHeader(**{**header.__dict__, "frames": frames(header.frames)})
    free = dst.kv.num_free_blocks
    with pytest.raises(KVTransferError, match=match) as info:
        dst.connector.begin_import(bad.pack())
    assert info.value.reason == "bad_header" and dst.kv.num_free_blocks == free


def test_destinations_are_the_runs_of_our_reserved_blocks():
    src, dst = Replica("gqa", seed=1), Replica("gqa", seed=2)
    src.add_request("r", list(range(100, 137)))
    dst.fragment(3)  # some receiving runs scattered
    export = src.connector.export("r", max_frame_bytes=1 << 30)
    with dst.connector.begin_import(export.header) as session:
        dests = session.destinations()
        assert dests is session.destinations() and len(dests) == session.num_frames
        flat = [b for g in session.blocks for b in g]
        for (layer, first, n), dest in zip(export.header.frames, dests):
            run = flat[first : first + n]
            contiguous = run == list(range(run[0], run[0] + n))
            assert (dest is not None) == contiguous
            if dest is not None:
                cache = dst.connector.io.caches[layer].data
                assert dest.data_ptr() == cache[run[0]].data_ptr() and dest.numel() == n * cache[0].nbytes
        assert any(d is None for d in dests)  # the fragmented receiver has a scattered run
        for i, frame in enumerate(export.frames):
            session.accept(i, frame)
        session.finish()
    assert all(torch.equal(a, b) for a, b in zip(dst.request_bytes("r"), src.request_bytes("r"), strict=True))


@pytest.mark.parametrize("batch_bytes", [0, 1 << 20])  # a copy per frame, or one batched launch
@pytest.mark.parametrize("offset", [0, 1])  # 8-byte aligned frames go as words, the others as bytes
def test_the_copies_of_the_frames_move_every_byte(offset, batch_bytes):
    from meshserve.kvtransfer.cuda_ipc import _copy_all

    gen = torch.Generator().manual_seed(offset)
    srcs = [torch.randint(0, 256, (n + offset,), dtype=torch.uint8, generator=gen)[offset:] for n in (64, 4096, 24)]
    dsts = [torch.zeros(s.numel() + offset, dtype=torch.uint8)[offset:] for s in srcs]
    _copy_all(dsts, srcs, batch_bytes=batch_bytes)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))


@pytest.mark.parametrize("corrupt", [False, True])
def test_frames_written_in_place_and_passed_are_checksummed_in_order(corrupt):
    """A verified import whose frames go partly into our blocks in place (digested together at
    finish) and partly as bytes (digested at once) keeps the sender's frame order: it passes, and
    a byte changed in a frame written in place is refused, leaving nothing held."""
    src, dst = Replica("gqa", seed=1), Replica("gqa", seed=2)
    src.add_request("r", list(range(100, 137)))
    dst.fragment(3)
    export = src.connector.export("r", max_frame_bytes=2 * 256)  # two blocks a frame: some runs scattered
    free, requests = dst.kv.num_free_blocks, dst.kv.num_requests
    with dst.connector.begin_import(export.header) as session:
        dests = session.destinations()
        in_place = [i for i, d in enumerate(dests) if d is not None]
        assert in_place and len(in_place) < len(dests)
        for i, frame in enumerate(export.frames):
            if dests[i] is None:
                session.accept(i, frame)
                continue
            dests[i].copy_(frame)
            if corrupt and i == in_place[-1]:
                dests[i][7] ^= 0x20
            session.accept(i)
        if corrupt:
            with pytest.raises(KVTransferError) as info:
                session.finish()
            assert info.value.reason == "checksum"
        else:
            session.finish()
    if corrupt:
        assert dst.kv.num_free_blocks == free and dst.kv.num_requests == requests
    else:
        assert all(torch.equal(a, b) for a, b in zip(dst.request_bytes("r"), src.request_bytes("r"), strict=True))
    dst.kv.check_invariants()
