"""Packed per-block lists (kvtransfer/packed.py) and the driver's HandoverBlocks in that form
(pins.py): the oracle is the per-element form they replaced (each id a msgpack int, each hash a
msgpack bin, as HandoverBlocks.to_wire / from_wire sent them before) and struct, element by element."""

import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshserve.kvtransfer.packed import HASH_BYTES, pack_hashes, pack_u32, unpack_hashes, unpack_u32
from meshserve.kvtransfer.pins import HandoverBlocks


def per_element_to_wire(b: HandoverBlocks) -> dict:
    """HandoverBlocks.to_wire as it was: every block id and every hash its own msgpack item."""
    return {"request_id": b.request_id, "num_tokens": b.num_tokens,
            "block_tables": [list(t) for t in b.block_tables],
            "block_hashes": [list(h) for h in b.block_hashes], "extra_keys": list(b.extra_keys)}


def per_element_from_wire(obj: dict) -> HandoverBlocks:
    return HandoverBlocks(obj["request_id"], int(obj["num_tokens"]),
                          tuple(tuple(map(int, t)) for t in obj["block_tables"]),
                          tuple(tuple(map(bytes, h)) for h in obj["block_hashes"]), tuple(obj["extra_keys"]))


def over_msgpack(obj: dict) -> dict:
    return msgpack.unpackb(msgpack.packb(obj, use_bin_type=True), raw=False)


# hashes with zero bytes at either end (a void dtype's split must keep them), block id 0 (NULL_BLOCK:
# a window released it) and ids near 2**32
hashes = st.binary(min_size=HASH_BYTES, max_size=HASH_BYTES) | st.sampled_from(
    [b"\0" * HASH_BYTES, b"\0" * 31 + b"\1", b"\1" + b"\0" * 31])
block_ids = st.integers(0, 2**32 - 1) | st.just(0)


@st.composite
def handover_blocks(draw) -> HandoverBlocks:
    groups = draw(st.integers(1, 3))
    tables = tuple(tuple(draw(st.lists(block_ids, max_size=40))) for _ in range(groups))
    full = draw(st.integers(0, 20))
    digests = tuple(tuple(draw(st.lists(hashes, min_size=full, max_size=full))) for _ in range(groups))
    rid = draw(st.text(max_size=8) | st.integers(0, 2**40))
    extra = tuple(draw(st.lists(st.text(max_size=4) | st.integers(0, 99), max_size=2)))
    return HandoverBlocks(rid, draw(st.integers(0, 10**6)), tables, digests, extra)


@settings(max_examples=150, deadline=None)
@given(blocks=handover_blocks())
def test_the_packed_form_carries_what_the_per_element_form_carried(blocks):
    packed = HandoverBlocks.from_wire(over_msgpack(blocks.to_wire()))
    oracle = per_element_from_wire(over_msgpack(per_element_to_wire(blocks)))
    assert packed == oracle == blocks
    assert packed.block_positions == oracle.block_positions and packed.blocks == oracle.blocks
    assert all(type(h) is bytes for g in packed.block_hashes for h in g)
    assert all(type(i) is int for t in packed.block_tables for i in t)


@settings(max_examples=150, deadline=None)
@given(values=st.lists(block_ids, max_size=64), digests=st.lists(hashes, max_size=16))
def test_packed_bins_are_the_elements_little_endian_and_concatenated(values, digests):
    assert pack_u32(values) == b"".join(struct.pack("<I", v) for v in values)
    assert unpack_u32(pack_u32(values)) == tuple(values)
    assert pack_hashes(digests) == b"".join(digests)
    assert unpack_hashes(pack_hashes(digests)) == tuple(digests)


@pytest.mark.parametrize("values", [[2**32], [-1], [1.5], ["7"]])
def test_a_block_id_outside_uint32_is_refused(values):
    with pytest.raises((OverflowError, TypeError)):
        pack_u32(values)


@pytest.mark.parametrize("digests", [[b"a" * 31], [b"a" * 33], [b"a" * 31, b"b" * 33], [b"a" * 32, b"b" * 16] * 2])
def test_hashes_of_another_size_are_refused_even_when_their_total_is_whole(digests):
    with pytest.raises(ValueError, match="32 bytes each"):
        pack_hashes(digests)
    with pytest.raises(ValueError, match="32 bytes each"):
        HandoverBlocks("r", 8, ((1, 2),), (tuple(digests),)).to_wire()


@pytest.mark.parametrize("packed", [b"abc", [1, 2], "abcd"])
def test_a_bin_that_is_not_packed_uint32s_is_refused(packed):
    with pytest.raises(TypeError):
        unpack_u32(packed)
    with pytest.raises(TypeError):
        unpack_hashes(packed)


def test_a_per_element_map_is_refused_by_its_missing_keys_not_misread():
    blocks = HandoverBlocks("r", 8, ((0, 3, 4),), ((b"h" * 32,),))
    with pytest.raises(KeyError):
        HandoverBlocks.from_wire(over_msgpack(per_element_to_wire(blocks)))


def test_an_export_of_received_blocks_packs_the_header_the_sender_would():
    """A rank's export of a HandoverBlocks from the wire joins its hashes unchecked (hashes_sized):
    the header's bytes are those of an export of the driver's own, checked one by one."""
    from meshserve.kvtransfer.pins import KVPins
    from meshserve.kvtransfer.rank_io import KVRankIO
    from tests.unit.kvtransfer.replicas import Replica

    src = Replica("hybrid", seed=1)
    src.add_request("h", list(range(100, 141)), step=5)
    sent = KVPins(src.kv).pin("h").blocks
    received = HandoverBlocks.from_wire(over_msgpack(sent.to_wire()))
    assert received.hashes_sized and not sent.hashes_sized and any(received.block_hashes)
    io = KVRankIO(src.caches, model_id="tiny", block_size=4, retentions=src.layout.retentions)
    assert io.export(received, max_frame_bytes=512).header_bytes == io.export(sent, max_frame_bytes=512).header_bytes
