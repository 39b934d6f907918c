"""The NIXL READ's index arrays built in array passes (kvtransfer/read_indices.py) against the
straightforward per-block loop, on real exports: every replica kind (hybrid groups, released
window blocks, sparse MLA's tensors of other block sizes), fresh and scattered receiving blocks,
frame caps that cut runs, frames interleaved across layers, and the staging caches a re-sharding
rank pulls into (reshard.py). A description that does not match the header is refused."""

import dataclasses
import random

import numpy as np
import pytest
import torch

from meshserve.attention.spec import AttentionSpec
from meshserve.kvstore.cache_tensors import allocate_caches
from meshserve.kvstore.manager import KVCacheManager
from meshserve.kvtransfer.nixl_agent import Region, _offsets
from meshserve.kvtransfer.rank_io import KVRankIO
from meshserve.kvtransfer.read_indices import RegionTable, read_indices
from meshserve.kvtransfer.reshard import Layout, sources_of, staging_caches
from meshserve.kvtransfer.wire import KVHeader, KVTransferError
from tests.kv_connector import KVConnector
from tests.unit.kvtransfer.replicas import Replica


def per_block(sent, described, flat, layer_offsets, peer_offsets):
    """The oracle: one descriptor per block, frame by frame (what a NIXL READ names)."""
    ours, theirs = [], []
    for (layer, first, count), (region, their_first, _) in zip(sent, described, strict=True):
        for k in range(count):
            ours.append(layer_offsets[layer] + flat[first + k])
            theirs.append(peer_offsets[region] + their_first + k)
    return ours, theirs


def describe(io: KVRankIO, frames: list[torch.Tensor]) -> tuple[list[list[int]], RegionTable, list[int]]:
    """What an exporter's agent lists: each frame as [region, first block, count] of its regions."""
    regions = [Region.of(c.data) for c in io.caches]
    described = []
    for frame in frames:
        i = next(i for i, r in enumerate(regions) if 0 <= frame.data_ptr() - r.address < r.nbytes)
        first, count = regions[i].blocks_at(frame.data_ptr() - regions[i].address, frame.numel())
        described.append([i, first, count])
    offsets = _offsets(regions)
    table = RegionTable.of(offsets, [r.block_nbytes for r in regions], [r.num_blocks for r in regions])
    return described, table, offsets


def interleaved(header: KVHeader, frames: list[torch.Tensor]) -> tuple[KVHeader, list[torch.Tensor]]:
    """The same frames, layers interleaved (each layer's own order kept: the header still checks)."""
    order = sorted(range(len(frames)), key=lambda i: (header.frames[i][1], header.frames[i][0]))
    return dataclasses.replace(header, frames=tuple(header.frames[i] for i in order)), [frames[i] for i in order]


def check_against_oracle(session, header, described, table, peer_offsets, our_offsets):
    ours, theirs = read_indices(session.frame_table, described, session.flat_blocks, np.array(our_offsets),
                                session.io.block_nbytes_array, table)  # fmt: skip
    want = per_block(header.frames, described, list(session.flat_blocks), our_offsets, peer_offsets)
    assert ours.dtype == theirs.dtype == np.int32
    assert ours.tolist() == want[0] and theirs.tolist() == want[1]


@pytest.mark.parametrize("kind", ["gqa", "hybrid", "window", "sparse_mla"])
@pytest.mark.parametrize("frame_bytes", [1 << 30, 3 * 256])  # a frame per layer; runs cut every few blocks
@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("order", ["layer_major", "interleaved"])
def test_indices_match_the_per_block_loop(kind, frame_bytes, scattered, order):
    src, dst = Replica(kind, seed=1), Replica(kind, seed=2)
    src.fragment(2)  # the exporter's blocks do not start at its region's block 1
    src.add_request("r", list(range(100, 141)), step=30)
    if scattered:
        dst.fragment(3)
    export = src.connector.export("r", max_frame_bytes=frame_bytes)
    header, frames = export.header, export.frames
    if order == "interleaved":
        header, frames = interleaved(header, frames)
    described, table, peer_offsets = describe(src.connector.io, frames)
    our_offsets = [random.Random(kind).randrange(0, 1000) * 7 for _ in dst.connector.io.caches]
    with dst.connector.begin_import(header.pack()) as session:
        check_against_oracle(session, header, described, table, peer_offsets, our_offsets)


@pytest.mark.parametrize(("src_tp", "src_dcp", "dst_tp", "dst_dcp"), [(2, 1, 1, 1), (1, 1, 2, 1), (2, 2, 1, 1),
                                                                     (4, 2, 2, 1)])  # fmt: skip
def test_indices_of_a_resharding_pull_into_staging_caches(src_tp, src_dcp, dst_tp, dst_dcp):
    """A re-sharding decode rank READs each source's shard into staging caches shaped like it
    (blocks 1..n in the sent order): the indices of that READ, for each source it pulls from."""
    kv_heads, layers, block = 4, 3, 4
    src, dst = Layout(src_tp, src_dcp, None), Layout(dst_tp, dst_dcp, None)
    heads = kv_heads * src_dcp // src_tp  # a source rank's KV heads (replicated across its dcp group)
    specs = [AttentionSpec(num_heads=8, num_kv_heads=heads, head_size=8)] * layers
    for piece in sources_of(0, src, dst):
        caches = allocate_caches(specs, num_blocks=40, block_size=block, dtype="bfloat16", device="cpu")
        manager = KVCacheManager(40, block)
        sender = KVConnector(manager, caches, model_id="m")
        manager.allocate_slots("filler", 9, [0] * 9)
        manager.allocate_slots("r", 37 + piece.src_rank, list(range(37 + piece.src_rank)))
        export = sender.export("r", max_frame_bytes=5 * 256)
        n = export.header.num_blocks
        ours = [AttentionSpec(num_heads=8, num_kv_heads=kv_heads // dst_tp * dst_dcp, head_size=8)] * layers
        staging = staging_caches(allocate_caches(ours, num_blocks=8, block_size=block, dtype="bfloat16",
                                                 device="cpu"), heads, n)  # fmt: skip
        stage = KVRankIO(staging, model_id="m", block_size=block)
        described, table, peer_offsets = describe(sender.io, export.frames)
        our_offsets = _offsets([Region.of(c.data) for c in stage.caches])
        with stage.begin_import(export.header, [list(range(1, n + 1))]) as session:
            check_against_oracle(session, export.header, described, table, peer_offsets, our_offsets)


@pytest.mark.parametrize(("change", "message"), [
    (lambda d, t: d[:-1], "each of the"),  # a frame fewer than the header lists
    (lambda d, t: [[r, f] for r, f, c in d], "each of the"),
    (lambda d, t: "frames", "not \\[region"),
    (lambda d, t: [[r, f, c] for r, f, c in d[:-1]] + [[len(t.offsets), 0, d[-1][2]]], "frame 3"),  # no such region
    (lambda d, t: [[r, -1, c] for r, f, c in d], "frame 0"),
    (lambda d, t: [[r, int(t.num_blocks[r]) - c + 1, c] for r, f, c in d], "frame 0"),  # past the region's end
    (lambda d, t: [[r, 2**62, c] for r, f, c in d], "frame 0"),  # first + count would wrap around
    (lambda d, t: [[r, f, c - 1] for r, f, c in d], "frame 0"),  # another size than the header's frame
    # the next tensor's region: the latent's frame in the index keys' region, another block size
    (lambda d, t: [[(r + 1) % 4, f, c] for r, f, c in d], "frame 0"),
])  # fmt: skip
def test_a_description_that_does_not_match_the_header_is_refused(change, message):
    src, dst = Replica("sparse_mla", seed=1), Replica("sparse_mla", seed=2)
    src.add_request("r", list(range(100, 141)))
    export = src.connector.export("r")
    described, table, _ = describe(src.connector.io, export.frames)
    assert [r for r, _, _ in described] == [0, 1, 2, 3]  # per layer its latent and its index keys
    with dst.connector.begin_import(export.header_bytes) as session:
        with pytest.raises(KVTransferError, match=message) as info:
            read_indices(session.frame_table, change(described, table), session.flat_blocks,
                         np.zeros(len(session.io.caches), np.int64), session.io.block_nbytes_array, table)
        assert info.value.reason == "bad_header"
