"""The two descriptor index arrays of a NIXL READ: for every block a pull moves, where it lands in
our prepared list and where it is read from in the exporter's, in the same order.

    ours, theirs = read_indices(sent, described, flat_blocks, layer_offsets, block_nbytes, peer_regions)

sent: the header's frames, [F, 3] (cache tensor, first sent block, count); described: the
exporter's description of the same frames, [region, first block of the region, count] each
(untrusted: checked here against its regions and the header); flat_blocks: our blocks in the sent
order; layer_offsets: where each of our cache tensors' block 0 is in our list; peer_regions: the
exporter's regions as arrays (`RegionTable`).

Array passes only, no Python per block or per frame: a 32k-token pull of a 32-layer cache names
65536 blocks (CPU frames of 1 MiB: 4096 frames). Where the frames go layer after layer (as
`wire.plan_frames` makes them), our indices are one broadcast add, every layer's offset plus our
blocks; where every layer's frames read the same blocks of their regions (caches of one block
size), the exporter's are one too; other layouts (layers of different block sizes, as sparse
MLA's index keys, or frames in another order) take a repeat per frame.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshserve.kvtransfer.wire import KVTransferError


@dataclass(frozen=True)
class RegionTable:
    """An exporter's regions as arrays: each one's block 0 in its prepared list, its block size
    and its number of blocks ([R] int64 each)."""

    offsets: np.ndarray
    block_nbytes: np.ndarray
    num_blocks: np.ndarray

    @classmethod
    def of(cls, offsets, block_nbytes, num_blocks) -> RegionTable:
        return cls(*(np.asarray(a, dtype=np.int64).reshape(-1) for a in (offsets, block_nbytes, num_blocks)))


def read_indices(sent: np.ndarray, described: object, flat_blocks: np.ndarray, layer_offsets: np.ndarray,
                 block_nbytes: np.ndarray, peer: RegionTable) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(ours, theirs), int32 each (module docstring); KVTransferError "bad_header" when the
    description is not [region, first, count] per header frame, or a frame lies outside its
    region, or its region's blocks are not the size of ours, or its size is not the header's."""
    num_frames = len(sent)
    try:
        table = np.array(described, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise KVTransferError("bad_header", "NIXL frames: not [region, first block, count] each") from exc
    if table.size == 0 and num_frames == 0:
        empty = np.zeros(0, dtype=np.int32)
        return empty, empty
    if table.ndim != 2 or table.shape != (num_frames, 3):
        raise KVTransferError("bad_header", f"NIXL frames: not [region, first block, count] for each of the "
                              f"{num_frames} frames of the header")  # fmt: skip
    region, first, count = table.T
    layer, sent_first, sent_count = sent.T
    known = (region >= 0) & (region < len(peer.offsets))
    r = np.where(known, region, 0)
    size = peer.block_nbytes[r]
    # first <= num_blocks - count, not first + count <= num_blocks: a sum near 2**63 would wrap
    ok = (known & (first >= 0) & (count >= 1) & (first <= peer.num_blocks[r] - count)
          & (size == block_nbytes[layer]) & (count == sent_count))  # same block size: same count as the header's
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        raise KVTransferError("bad_header", f"NIXL frame {i} does not match the header's frame or its region")
    starts = peer.offsets[r] + first  # each frame's first descriptor in the exporter's list
    num_layers, num_sent = len(layer_offsets), len(flat_blocks)
    flat = flat_blocks.astype(np.int32, copy=False)
    layer_major = num_frames and bool((layer[1:] >= layer[:-1]).all())
    total = int(count.sum())
    if layer_major and total == num_layers * num_sent:
        # every layer's frames tile the sent blocks in order (KVRankIO.check), layer after layer
        ours = (layer_offsets.astype(np.int32)[:, None] + flat[None, :]).reshape(-1)
    else:
        ours = _per_frame(layer_offsets[layer], flat_blocks, sent_first, count)
    theirs = _same_runs_per_layer(starts, sent_first, count, num_layers) if layer_major else None
    if theirs is None:
        theirs = _runs(starts, count)
    return ours, theirs


def _runs(starts: np.ndarray, count: np.ndarray) -> np.ndarray:
    """starts[i], starts[i] + 1, ..., starts[i] + count[i] - 1 for every i, concatenated (int32)."""
    total = int(count.sum())
    base = (starts - (np.cumsum(count) - count)).astype(np.int32)
    return np.repeat(base, count) + np.arange(total, dtype=np.int32)


def _per_frame(offsets: np.ndarray, flat_blocks: np.ndarray, sent_first: np.ndarray, count: np.ndarray) -> np.ndarray:
    """offsets[i] + flat_blocks[sent_first[i] : sent_first[i] + count[i]] for every frame i, concatenated."""
    positions = _runs(sent_first, count)  # the sent blocks, frame after frame
    return (flat_blocks[positions] + np.repeat(offsets, count)).astype(np.int32)


def _same_runs_per_layer(starts: np.ndarray, sent_first: np.ndarray, count: np.ndarray,
                         num_layers: int) -> np.ndarray | None:  # fmt: skip
    """The exporter's indices as one broadcast add where the frames, cut into num_layers rows (a
    layer each, layer after layer), repeat one row's sent blocks, counts and runs of its region
    from each row's first start: that start plus one row's runs. None where they differ (the
    caller repeats per frame)."""
    num_frames = len(starts)
    if num_layers == 0 or num_frames % num_layers:
        return None
    per = num_frames // num_layers
    if per == 1:  # a frame per layer (frames of a GPU's size): one run each, from its start
        if not (count == count[0]).all():
            return None
        return (starts.astype(np.int32)[:, None] + np.arange(count[0], dtype=np.int32)[None, :]).reshape(-1)
    shape = (num_layers, per)
    st, sf, ct = (a.reshape(shape) for a in (starts, sent_first, count))
    base = st - st[:, :1]  # each frame's start relative to its layer's first frame's
    if not ((sf == sf[:1]).all() and (ct == ct[:1]).all() and (base == base[:1]).all()):
        return None
    one_layer = _runs(base[0], ct[0])
    return (st[:, 0].astype(np.int32)[:, None] + one_layer[None, :]).reshape(-1)
