"""KV hand-over in one process: round trips byte for byte, and every refusal frees everything."""

from dataclasses import replace

import pytest
import torch

from meshserve.kvtransfer.wire import FrameDigest, KVHeader, KVTransferError, plan_frames
from tests.kv_connector import KVExport
from tests.unit.kvtransfer.replicas import Replica

TOKENS = list(range(100, 137))  # 37 tokens: 9 full blocks of 4 and one partial


@pytest.mark.parametrize("kind", ["gqa", "fp8", "mla", "sparse_mla", "sparse_mla_fp8"])
@pytest.mark.parametrize("fragmented", [False, True])
def test_round_trip_copies_every_layer_byte_for_byte(kind, fragmented):
    src = Replica(kind, seed=1)
    dst = Replica(kind, seed=2)
    if fragmented:
        src.fragment(6)
        dst.fragment(6)
    src.add_request("r", TOKENS)
    export = src.connector.export("r", max_frame_bytes=3 * 2 * 4 * 2 * 8 * 2)  # several frames per layer
    assert len(export.frames) > 2
    blocks = dst.connector.import_(export.header_bytes, [bytes(f.numpy()) for f in export.frames])
    src.connector.release(export)
    assert dst.kv.block_tables("r") == blocks and dst.kv.num_tokens("r") == len(TOKENS)
    for ours, theirs in zip(dst.request_bytes("r"), src.request_bytes("r")):
        assert torch.equal(ours, theirs)
    # the receiver can serve the same prefix to later requests
    assert dst.kv.lookup_prefix(TOKENS).num_tokens == 36
    dst.kv.check_invariants()
    src.kv.check_invariants()


def test_windowed_request_sends_only_the_blocks_it_holds():
    src, dst = Replica("window", seed=1), Replica("window", seed=2)
    src.add_request("w", TOKENS, step=5)
    held = src.held_positions("w")
    assert len(held[0]) < len(src.kv.block_tables("w")[0])  # sinks + window only
    dst.connector.transfer_from(src.connector, "w")
    assert dst.held_positions("w") == held
    for ours, theirs in zip(dst.request_bytes("w"), src.request_bytes("w")):
        assert torch.equal(ours, theirs)
    assert dst.kv.allocate_slots("w", 1, TOKENS + [5])  # decoding goes on on the receiver
    dst.kv.check_invariants()


def test_hybrid_round_trip_sends_each_groups_blocks_once_per_shared_tensor():
    """Two groups (window 6, full) of two layers; the windowed group holds fewer blocks, and
    its held blocks and the full group's arrive byte for byte in the receiver's own groups."""
    src, dst = Replica("hybrid", seed=1), Replica("hybrid", seed=2)
    src.fragment(3)
    src.add_request("h", TOKENS, step=5)
    held = src.held_positions("h")
    assert len(src.connector.caches) == 2 and len(held[0]) < len(held[1]) == 10  # 2 tensors; window frees
    blocks = dst.connector.transfer_from(src.connector, "h")
    assert dst.held_positions("h") == held and [len(b) for b in blocks] == [len(p) for p in held]
    for ours, theirs in zip(dst.request_bytes("h"), src.request_bytes("h"), strict=True):
        assert torch.equal(ours, theirs)
    assert dst.kv.block_hashes("h") == src.kv.block_hashes("h")
    assert dst.kv.lookup_prefix(TOKENS).num_tokens == 36  # both groups' hashes were registered
    assert dst.kv.allocate_slots("h", 1, TOKENS + [5])
    dst.kv.check_invariants()
    src.kv.check_invariants()


@pytest.mark.parametrize("receiver,match", [
    ("gqa", "KV layer groups"),  # one group (and one tensor per layer)
    ("hybrid_w10", "KV layer groups"),  # two groups, another window
])
def test_a_receiver_with_another_group_layout_is_refused(receiver, match):
    src, dst = Replica("hybrid", seed=1), Replica(receiver, seed=2)
    src.add_request("h", TOKENS)
    before = (dst.kv.num_free_blocks, list(dst.kv.pool.ref_counts))
    with pytest.raises(KVTransferError, match=match) as info:
        dst.connector.transfer_from(src.connector, "h")
    assert info.value.reason == "layout"
    assert (dst.kv.num_free_blocks, list(dst.kv.pool.ref_counts)) == before and "h" not in dst.kv
    assert src.kv.num_total_blocks - src.kv.num_free_blocks == sum(len(t) for t in src.kv.block_tables("h"))


def test_hybrid_import_without_room_for_every_group_is_refused_whole():
    src, dst = Replica("hybrid", seed=1), Replica("hybrid", seed=2, num_blocks=16)
    src.add_request("h", TOKENS)  # 10 blocks in each group: 20 > 15
    with pytest.raises(KVTransferError) as info:
        dst.connector.transfer_from(src.connector, "h")
    assert info.value.reason == "capacity" and "h" not in dst.kv
    assert dst.kv.num_free_blocks == dst.kv.num_total_blocks
    dst.kv.check_invariants()


def test_export_pins_blocks_until_released():
    src = Replica()
    src.add_request("r", TOKENS)
    held = src.kv.num_total_blocks - src.kv.num_free_blocks
    export = src.connector.export("r")
    src.kv.free("r")  # the prefill replica is done with the request
    assert src.kv.num_total_blocks - src.kv.num_free_blocks == held
    src.connector.release(export)
    assert src.kv.num_free_blocks == src.kv.num_total_blocks
    src.kv.check_invariants()


def _tamper(export: KVExport, **changes) -> KVExport:
    return KVExport(header=replace(export.header, **changes), frames=export.frames, pin_id=export.pin_id)


def _refusals():
    """(name, receiver factory, function export -> (header, frames), expected reason)."""

    def frames(e):
        return [bytes(f.numpy()) for f in e.frames]

    def flip(e):
        out = frames(e)
        out[1] = out[1][:7] + bytes([out[1][7] ^ 1]) + out[1][8:]
        return e.header_bytes, out

    def reorder(e):
        out = frames(e)
        return e.header_bytes, [out[1], out[0], *out[2:]]

    def bad_plan(e):
        h = e.header
        plan = tuple(plan_frames(list(range(h.num_blocks)), [1], 1 << 30))
        return _tamper(
            e, frames=plan, nbytes=sum(replace(h, frames=plan).frame_nbytes())
        ).header_bytes, frames(e)

    return [
        ("other model", lambda: Replica(model_id="other"), lambda e: (e.header_bytes, frames(e)), "layout"),
        ("block size", lambda: Replica(block_size=8), lambda e: (e.header_bytes, frames(e)), "layout"),
        ("dtype", lambda: Replica(dtype="float16"), lambda e: (e.header_bytes, frames(e)), "layout"),
        ("fp8 vs bf16", lambda: Replica("fp8"), lambda e: (e.header_bytes, frames(e)), "layout"),
        ("capacity", lambda: Replica(num_blocks=6), lambda e: (e.header_bytes, frames(e)), "capacity"),
        ("missing frame", Replica, lambda e: (e.header_bytes, frames(e)[:-1]), "truncated"),
        (
            "short frame",
            Replica,
            lambda e: (e.header_bytes, [*frames(e)[:-1], frames(e)[-1][:-3]]),
            "truncated",
        ),
        ("flipped bit", Replica, flip, "checksum"),
        ("swapped frames", Replica, reorder, "checksum"),
        (
            "bad checksum",
            Replica,
            lambda e: (_tamper(e, checksum=e.header.checksum ^ 1).header_bytes, frames(e)),
            "checksum",
        ),
        ("garbage header", Replica, lambda e: (b"\x93not a header", frames(e)), "bad_header"),
        ("frames do not tile", Replica, bad_plan, "bad_header"),
        (
            "fingerprint",
            Replica,
            lambda e: (_tamper(e, fingerprint="0" * 32).header_bytes, frames(e)),
            "bad_header",
        ),
    ]


@pytest.mark.parametrize("name,receiver,mangle,reason", _refusals(), ids=[r[0] for r in _refusals()])
def test_refusals_leave_no_block_behind(name, receiver, mangle, reason):
    src = Replica(seed=1)
    src.add_request("r", TOKENS)
    dst = receiver()
    dst.add_request("other", [1, 2, 3, 4, 5])  # something already running there stays untouched
    before = (dst.kv.num_free_blocks, list(dst.kv.block_tables("other")[0]), list(dst.kv.pool.ref_counts))
    export = src.connector.export("r", max_frame_bytes=4096)
    header, frames = mangle(export)
    with pytest.raises(KVTransferError) as info:
        dst.connector.import_(header, frames)
    assert info.value.reason == reason, str(info.value)
    assert "r" not in dst.kv
    assert (dst.kv.num_free_blocks, list(dst.kv.block_tables("other")[0]), list(dst.kv.pool.ref_counts)) == before
    dst.kv.check_invariants()
    src.connector.release(export)


def test_scale_mismatch_is_a_layout_refusal():
    src, dst = Replica("fp8", seed=1), Replica("fp8", seed=2)
    dst.caches[0].k_scale.fill_(0.5)
    src.add_request("r", TOKENS)
    free = dst.kv.num_free_blocks
    with pytest.raises(KVTransferError, match="scales"):
        dst.connector.transfer_from(src.connector, "r")
    assert dst.kv.num_free_blocks == free and "r" not in dst.kv
    assert src.kv.num_total_blocks - src.kv.num_free_blocks == len(src.kv.block_tables("r")[0])  # export released


def test_duplicate_request_is_refused_without_touching_the_running_one():
    src, dst = Replica(seed=1), Replica(seed=2)
    src.add_request("r", TOKENS)
    dst.add_request("r", [9, 9, 9])
    table = list(dst.kv.block_tables("r")[0])
    with pytest.raises(KVTransferError, match="already holds blocks"):
        dst.connector.transfer_from(src.connector, "r")
    assert dst.kv.block_tables("r")[0] == table
    dst.kv.check_invariants()


def test_digest_sees_every_byte_and_the_order():
    data = torch.randint(0, 256, (100_003,), dtype=torch.uint8)

    def digest(*frames):
        d = FrameDigest()
        for f in frames:
            d.update(f)
        return d.value

    base = digest(data[:50_000], data[50_000:])
    for pos in (0, 4095 * 8, 99_999, 100_002):  # head, chunk edge, word tail, byte tail
        bad = data.clone()
        bad[pos] ^= 0x10
        assert digest(bad[:50_000], bad[50_000:]) != base
    assert digest(data[50_000:], data[:50_000]) != base
    assert digest(data[:50_000], data[50_000:-1]) != base


def test_header_round_trips_through_msgpack():
    rep = Replica()
    rep.add_request("x", [1, 2, 3, 4, 5])
    header = rep.connector.export("x").header
    back = KVHeader.unpack(header.pack())
    assert back == header and header.fingerprint == header.layout.fingerprint
    assert back.num_tokens == 5 and back.block_positions == ((0, 1),) and [len(h) for h in back.block_hashes] == [1]


def test_driver_and_rank_sides_apart_move_a_hybrid_request():
    """The split a distributed replica uses: the drivers pin and reserve in their managers (KVPins),
    the ranks only read and write cache tensors (KVRankIO) from what the drivers tell them, as
    msgpack; the receiving driver commits the sender's hashes."""
    import msgpack

    from meshserve.kvtransfer.pins import HandoverBlocks, KVPins
    from meshserve.kvtransfer.rank_io import KVRankIO

    src, dst = Replica("hybrid", seed=1), Replica("hybrid", seed=2)
    src.fragment(2)
    dst.fragment(3)
    src.add_request("h", TOKENS, step=5)
    sender, receiver = KVPins(src.kv), KVPins(dst.kv)
    pin = sender.pin("h")
    src.kv.free("h")  # the pin alone keeps the blocks
    assert sender.num_pinned == 1 and pin.blocks.block_hashes == tuple(map(tuple, src.kv.block_hashes(pin.pin_id)))
    wire = HandoverBlocks.from_wire(msgpack.unpackb(msgpack.packb(pin.blocks.to_wire()), raw=False))
    assert wire == pin.blocks
    rank_io = KVRankIO(src.caches, model_id="tiny", block_size=4, retentions=src.layout.retentions)
    export = rank_io.export(wire, max_frame_bytes=512)
    reserved = receiver.reserve("h", wire.num_tokens, wire.block_positions, extra_keys=wire.extra_keys)
    dst_io = KVRankIO(dst.caches, model_id="tiny", block_size=4, retentions=dst.layout.retentions)
    with dst_io.into(reserved).begin_import(export.header_bytes) as session:
        for i, frame in enumerate(export.frames):
            session.accept(i, bytes(frame.numpy()))
        assert session.finish() == reserved
    receiver.commit("h", wire.block_hashes)
    assert dst.held_positions("h") == [list(p) for p in wire.block_positions]
    expected = [c.data.view(torch.uint8)[wire.blocks].clone() for c in src.caches]
    for layer, cache in enumerate(dst.caches):
        assert torch.equal(cache.data.view(torch.uint8)[[b for g in reserved for b in g]], expected[layer])
    assert dst.kv.lookup_prefix(TOKENS).num_tokens == 36  # both groups' hashes were committed
    assert sender.release(pin.pin_id) and not sender.release(pin.pin_id)  # a second release is a no-op
    assert sender.num_pinned == 0 and src.kv.num_free_blocks == src.kv.num_total_blocks - 4  # the fragmentation
    src.kv.check_invariants()
    dst.kv.check_invariants()


def test_a_rank_refuses_frames_for_blocks_its_driver_did_not_reserve():
    from meshserve.kvtransfer.pins import KVPins
    from meshserve.kvtransfer.rank_io import KVRankIO

    src = Replica("hybrid", seed=1)
    src.add_request("h", TOKENS)
    pin = KVPins(src.kv).pin("h")
    io = KVRankIO(src.caches, model_id="tiny", block_size=4, retentions=src.layout.retentions)
    export = io.export(pin.blocks)
    short = [list(range(1, 11)), list(range(11, 20))]  # the header lists 10 + 10 blocks
    with pytest.raises(KVTransferError, match="blocks per group") as info:
        io.into(short).begin_import(export.header_bytes)
    assert info.value.reason == "bad_header"


def test_sparse_and_dense_mla_replicas_do_not_exchange():
    """The index key cache is part of the layout: a dense MLA receiver refuses a sparse sender."""
    src, dst = Replica("sparse_mla", seed=1), Replica("mla", seed=2)
    src.add_request("r", TOKENS)
    export = src.connector.export("r")
    with pytest.raises(KVTransferError, match="layout"):
        dst.connector.import_(export.header_bytes, [bytes(f.numpy()) for f in export.frames])
    dst.kv.check_invariants()


def _digest_one_frame_at_a_time(frames) -> int:
    """The digest as first written (every frame's total and weighted sum reduced on its own):
    the values the batched FrameDigest must keep, so that both ends of a hand-over agree
    whichever version computed them."""
    chunk, mask, value = 4096, (1 << 64) - 1, 0
    for frame in frames:
        n = frame.numel()
        n8 = n - n % 8
        words = frame[:n8].clone().view(torch.int64)
        m = words.numel() // chunk
        total = int(words.sum())
        sums = words[: m * chunk].view(m, chunk).sum(1)
        weighted = int((sums * torch.arange(1, m + 1)).sum()) + (m + 1) * int(words[m * chunk :].sum())
        tail = int.from_bytes(bytes(frame[n8:].tolist()), "little")
        total, weighted = (total + tail) & mask, (weighted + (m + 1) * tail) & mask
        value = ((value * 0x100000001B3) ^ total ^ (weighted * 0x9E3779B97F4A7C15) ^ n) & mask
    return value


@pytest.mark.parametrize("sizes", [[0], [7], [8], [4096 * 8], [4096 * 8 + 3, 5, 4096 * 24 + 17, 1 << 20],
                                   [3, 4096 * 8 * 2, 100_003, 8]])
def test_batched_digest_keeps_the_frame_by_frame_values(sizes):
    gen = torch.Generator().manual_seed(len(sizes) + sum(sizes))
    data = torch.randint(0, 256, (sum(sizes) + 1,), dtype=torch.uint8, generator=gen)
    frames, at = [], 1  # offset by one byte: unaligned frames are copied before their int64 view
    for size in sizes:
        frames.append(data[at : at + size])
        at += size
    d = FrameDigest()
    for f in frames:
        d.update(f)
    assert d.value == _digest_one_frame_at_a_time(frames)


@pytest.mark.parametrize("sizes", [[0], [7], [4096 * 8], [4096 * 8 + 3, 5, 4096 * 24 + 17, 1 << 18],
                                   [3, 4096 * 8 * 2, 100_003, 8, 0]])
def test_one_kernel_digest_keeps_the_frame_by_frame_values(sizes):
    """FrameDigest.update_many's one launch over every frame (digest_kernel.py, on the CPU through
    the Triton interpreter here) gives the values of the frame-by-frame computation."""
    from meshserve.kvtransfer import digest_kernel

    gen = torch.Generator().manual_seed(len(sizes) + sum(sizes))
    frames = []
    for size in sizes:  # each in its own allocation, as a cache's layers are
        frames.append(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen))
    assert digest_kernel.applies(frames, 4096)
    batched = FrameDigest()
    batched.update_many(frames, one_kernel=True)
    assert batched.value == _digest_one_frame_at_a_time(frames)
    flipped = [f.clone() for f in frames]
    big = max(range(len(sizes)), key=lambda i: sizes[i])
    if sizes[big] >= 8:
        flipped[big][sizes[big] // 2] ^= 0x04
        other = FrameDigest()
        other.update_many(flipped, one_kernel=True)
        assert other.value != batched.value


def test_unaligned_frames_take_the_frame_by_frame_digest():
    from meshserve.kvtransfer import digest_kernel

    data = torch.randint(0, 256, (4096 * 8 + 9,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    frames = [data[1:4097], data[4097:]]  # not 8-byte aligned: no int64 view in place
    assert not digest_kernel.applies(frames, 4096)
    d = FrameDigest()
    d.update_many(frames, one_kernel=True)  # falls back
    assert d.value == _digest_one_frame_at_a_time(frames)
