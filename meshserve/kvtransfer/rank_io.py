"""The rank side of a KV hand-over: a request's blocks out of this rank's cache tensors, and into
blocks the driver reserved. No block bookkeeping here: the driver decides (pins.py).

    sender:   export = io.export(pin.blocks)          # frames are views of the caches (no copy)
              ... ship export.header_bytes, export.frames (zmq, torch.distributed, in-process) ...
    receiver: with io.begin_import(header, blocks) as s:   # layout check, or KVTransferError
                  for i in range(s.num_frames):
                      view = s.destination(i)          # our own cache bytes when the run is contiguous
                      ... write frame i into `view`, then s.accept(i); or s.accept(i, frame_bytes)
                  s.finish()                           # checksum (where verified); else refused
The transports take an import target (`ImportTarget`: `begin_import(header)` and `device`):
`io.into(blocks)` on a rank, KVConnector (connector.py) where driver and rank share a process.
Each DCP/TP rank moves its own shard; the layout fingerprint (model id, block size, dcp size,
per-tensor dtype and block shape, KV layer groups) must match. Layers that share a tensor (a
hybrid layout: every group's block b is one row of each tensor) are sent once per block.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Protocol

import numpy as np
import torch

from meshserve.errors import ConfigError, check
from meshserve.kvstore.cache_tensors import LayerCache, MLACache, block_tensors
from meshserve.kvstore.retention import RetentionPolicy
from meshserve.kvtransfer.nixl_agent import Region
from meshserve.kvtransfer.packed import HASH_BYTES
from meshserve.kvtransfer.pins import HandoverBlocks
from meshserve.kvtransfer.wire import (
    FrameDigest,
    KVHeader,
    KVLayout,
    KVTransferError,
    as_bytes,
    plan_frames,
)

DEFAULT_FRAME_BYTES = 1 << 20  # small enough to pipeline sender and receiver copies
# Caches on a GPU: a frame per run of blocks up to this size. Per frame the device transports
# launch a copy and the checksum's few kernels, which cost more than moving a MiB at device speed.
DEVICE_FRAME_BYTES = 256 << 20


def frame_bytes_for(device: torch.device) -> int:
    """The export frame size for caches on `device`."""
    return DEVICE_FRAME_BYTES if device.type == "cuda" else DEFAULT_FRAME_BYTES


@dataclass
class KVExport:
    """One request's blocks ready to ship. frames: flat uint8 views of the sender's caches (on the
    caches' device; no copy), valid while the driver's pin holds the blocks. pin_id: that pin,
    when the exporting process also drives (KVConnector.release drops it). cache_frames: the
    bytes the checksum covers when they are not `frames` (`with_frames`); None: `frames`."""

    header: KVHeader
    frames: list[torch.Tensor]
    pin_id: Hashable | None = None
    header_bytes: bytes = field(default=b"")
    cache_frames: list[torch.Tensor] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.header_bytes:
            self.header_bytes = self.header.pack()

    def ensure_checksum(self) -> KVExport:
        """Put the frames' checksum in the header where it has none (`KVRankIO.export(checksum=False)`):
        called where a puller will check it (a zmq answer, a direct offer of a deployment that
        verifies), while the pin still holds the blocks. Once per export object; returns it."""
        if self.header.checksum is None:
            digest = FrameDigest()
            digest.update_many(self.frames if self.cache_frames is None else self.cache_frames)
            self.header = dataclasses.replace(self.header, checksum=digest.value)
            self.header_bytes = self.header.pack()
        return self

    def with_frames(self, frames: list[torch.Tensor]) -> KVExport:
        """This export's header with other bytes in its frames (fault injection: a corrupted copy),
        its checksum, computed now or later, still over the cache's own bytes: a verifying puller
        refuses them."""
        return KVExport(self.header, frames, header_bytes=self.header_bytes,
                        cache_frames=self.frames if self.cache_frames is None else self.cache_frames)


class ImportTarget(Protocol):
    """Where a transport writes an incoming hand-over."""

    device: torch.device

    def begin_import(self, header: KVHeader | bytes | memoryview) -> ImportSession: ...


def _scale_tensors(caches: Sequence[LayerCache]) -> list[tuple[object, ...]]:
    """Each layer's dequantisation scales ((scale,) for MLA, (k, v) otherwise): 0-d tensors or floats."""
    return [(c.scale,) if isinstance(c, MLACache) else (c.k_scale, c.v_scale) for c in caches]


def _scales(caches: Sequence[LayerCache]) -> tuple[tuple[float, ...], ...]:
    """Each layer's scales as floats, read in one device-to-host copy (a float() per 0-d device
    tensor would wait for the device each time: 64 waits for a 32-layer cache)."""
    parts = _scale_tensors(caches)
    tensors = [t for p in parts for t in p if isinstance(t, torch.Tensor)]
    if tensors:
        values = iter(torch.stack([t.reshape(()).float().to(tensors[0].device) for t in tensors]).tolist())
    return tuple(tuple(next(values) if isinstance(t, torch.Tensor) else float(t) for t in p) for p in parts)


class _ScaleMemo:
    """A rank's scales as floats, read from the device again only when a scale tensor changed:
    every export and every import compares them, and reading them is a host-device sync (an
    import's only one besides its copy's). A change shows in the tensors' identity or version
    counter, which every torch write bumps (KV scales are set by torch ops, at allocation and
    weight loading; no kernel writes them)."""

    def __init__(self, caches: Sequence[LayerCache]) -> None:
        self._caches = caches
        self._key: tuple | None = None
        self._value: tuple[tuple[float, ...], ...] = ()

    def get(self) -> tuple[tuple[float, ...], ...]:
        parts = _scale_tensors(self._caches)
        key = tuple((id(t), t._version) if isinstance(t, torch.Tensor) else t for p in parts for t in p)
        if key != self._key:
            self._value, self._key = _scales(self._caches), key
        return self._value


@dataclass(frozen=True)
class BlockTensor:
    """One tensor indexed by block id (dim 0) that a hand-over moves: [num_blocks, ...]."""

    data: torch.Tensor


class KVRankIO:
    """One rank's caches as hand-over frames.

    caches: as from allocate_caches (None entries, layers without a cache, are skipped; layers
    that share a tensor are sent once). model_id names the weights: replicas of different models
    never exchange KV. retentions: per KV layer group (KVGroupLayout.retentions).
    """

    def __init__(self, caches: Sequence[LayerCache | None], *, model_id: str, block_size: int, dcp_size: int = 1,
                 retentions: Sequence[RetentionPolicy] = (RetentionPolicy(),)) -> None:  # fmt: skip
        self.layer_caches = [c for c in caches if c is not None]  # scales are per layer
        # One entry per block-indexed tensor: a layer's data, and sparse MLA's index keys and their
        # FP8 scales (kvstore/cache_tensors.block_tensors); each is a "layer" of the frames and layout.
        tensors = {id(t): t for c in self.layer_caches for t in block_tensors(c)}
        self.caches = [BlockTensor(t) for t in tensors.values()]
        check(bool(self.caches), "caches", len(caches), "at least one layer cache")
        self.retentions = tuple(retentions)
        self.tokens_per_block = block_size * dcp_size
        self.layout = KVLayout.from_caches(self.caches, model_id=model_id, block_size=block_size, dcp_size=dcp_size,
                                           groups=[(r.sliding_window, r.num_sink_tokens) for r in self.retentions])
        self.device = self.caches[0].data.device
        self.block_nbytes = self.layout.block_nbytes()  # per cache tensor
        self._scales = _ScaleMemo(self.layer_caches)

    @functools.cached_property
    def byte_views(self) -> list[torch.Tensor]:
        """Each cache tensor as flat bytes, made once: a frame's destination is then one slice
        of it (a view of the blocks made through the tensor's shape costs three ops per frame)."""
        return [as_bytes(c.data) for c in self.caches]

    @functools.cached_property
    def word_views(self) -> list[torch.Tensor | None]:
        """Each cache tensor as flat int64 words where it is 8-byte aligned and sized (else None),
        made once: a device copy of a frame moves words, not bytes (a thread per element)."""
        return [_as_words(v) for v in self.byte_views]

    @functools.cached_property
    def block_nbytes_array(self) -> np.ndarray:
        """`block_nbytes` as an int64 array (made once; a NIXL pull checks its frames against it)."""
        return np.array(self.block_nbytes, dtype=np.int64)

    @functools.cached_property
    def regions(self) -> tuple[Region, ...]:
        """Each cache tensor as a registered-memory region (a NIXL READ's side of it), made once:
        the tensors are this object's for its lifetime."""
        return tuple(Region.of(c.data) for c in self.caches)

    # ---- sender ---------------------------------------------------------------------------
    def export(self, blocks: HandoverBlocks, *, max_frame_bytes: int = DEFAULT_FRAME_BYTES,
               checksum: bool = True) -> KVExport:  # fmt: skip
        """Describe the request's blocks and view their bytes (the driver keeps them pinned).
        checksum: compute the frames' checksum now (a read of every byte: numpy sums on a CPU, a
        kernel and a device-to-host read on a GPU); False leaves it out of the header, for
        `KVExport.ensure_checksum` to compute where a puller checks it (KVRankAgent.offer)."""
        check(max_frame_bytes >= 1, "max_frame_bytes", max_frame_bytes, "an integer >= 1")
        check(len(blocks.block_tables) == len(self.retentions), "block_tables", len(blocks.block_tables),
              f"one table per KV layer group ({len(self.retentions)})")
        sent = blocks.blocks
        plan = plan_frames(sent, self.block_nbytes, max_frame_bytes)
        frames = [as_bytes(self.caches[layer].data[sent[first] : sent[first] + n]) for layer, first, n in plan]
        digest = None
        if checksum:
            digest = FrameDigest()
            digest.update_many(frames)  # one kernel over every frame on a GPU
        header = KVHeader(
            request_id=blocks.request_id,
            layout=self.layout,
            num_tokens=blocks.num_tokens,
            block_positions=blocks.block_positions,
            block_hashes=blocks.block_hashes,
            extra_keys=blocks.extra_keys,
            scales=self._scales.get(),
            frames=tuple(plan),
            nbytes=sum(f.numel() for f in frames),
            checksum=None if digest is None else digest.value,
            fingerprint=self.layout.fingerprint,
            hashes_sized=blocks.hashes_sized,  # split from a packed bin: its pack joins them unchecked
        )
        return KVExport(header=header, frames=frames)

    # ---- receiver -------------------------------------------------------------------------
    def check(self, header: KVHeader) -> None:
        """Refuse (KVTransferError) a header whose blocks cannot go into these caches as they are."""
        ours = self.layout
        if header.fingerprint != header.layout.fingerprint:
            raise KVTransferError("bad_header", "the fingerprint does not match the layout it came with")
        if header.layout != ours:
            raise KVTransferError(
                "layout", f"fingerprint {header.fingerprint} != {ours.fingerprint}; {ours.difference(header.layout)}"
            )
        mine = self._scales.get()
        if header.scales != mine:
            raise KVTransferError("layout", f"cache scales differ: receiver {mine}, sender {header.scales}")
        if len(header.block_positions) != len(ours.groups) or len(header.block_hashes) != len(ours.groups):
            raise KVTransferError("bad_header", f"block positions and hashes for {len(ours.groups)} KV layer groups")
        num_blocks = header.num_blocks
        covered = [0] * len(ours.layers)  # per layer, the blocks its frames tiled so far (one pass)
        for lay, first, n in header.frames:
            if not 0 <= lay < len(covered) or first != covered[lay] or n < 1:
                raise KVTransferError("bad_header", f"frames of layer {lay} do not tile its blocks")
            covered[lay] = first + n
        for layer, end in enumerate(covered):
            if end != num_blocks:
                raise KVTransferError("bad_header", f"frames of layer {layer} cover {end} of {num_blocks} blocks")
        if header.nbytes != sum(header.frame_nbytes()):
            raise KVTransferError("bad_header", f"nbytes {header.nbytes} != the sum of the frame sizes")
        full = header.num_tokens // self.tokens_per_block
        counts = {len(g) for g in header.block_hashes}
        sized = header.hashes_sized or not any(set(map(len, g)) - {HASH_BYTES} for g in header.block_hashes)
        if len(counts) > 1 or max(counts) > full or not sized:
            raise KVTransferError("bad_header", f"block_hashes: as many in every group, at most {full} of "
                                  f"{HASH_BYTES} bytes")  # fmt: skip

    def begin_import(self, header: KVHeader | bytes | memoryview, blocks: Sequence[Sequence[int]], *,
                     on_finish: Callable[[], None] | None = None, on_abort: Callable[[], None] | None = None,
                     ) -> ImportSession:  # fmt: skip
        """Check the header and start writing its frames into `blocks` (per group, one per sent
        block position, reserved by the driver). on_finish / on_abort: what the driver does when
        the import succeeds / is refused (KVConnector: commit / abort its reservation)."""
        if not isinstance(header, KVHeader):
            header = KVHeader.unpack(header)
        self.check(header)
        return ImportSession(self, header, blocks, on_finish=on_finish, on_abort=on_abort)

    def into(self, blocks: Sequence[Sequence[int]]) -> ReservedBlocks:
        """An import target for a transport: the next hand-over goes into `blocks` (per group)."""
        return ReservedBlocks(self, blocks)


@dataclass
class ReservedBlocks:
    """`ImportTarget` of a rank whose driver reserved the blocks already. num_bytes: the cache
    bytes of the imports begun into them (their headers' nbytes; what a pull moves)."""

    io: KVRankIO
    blocks: Sequence[Sequence[int]]
    num_bytes: int = 0

    @property
    def device(self) -> torch.device:
        return self.io.device

    def begin_import(self, header: KVHeader | bytes | memoryview) -> ImportSession:
        session = self.io.begin_import(header, self.blocks)
        self.num_bytes += session.header.nbytes
        return session


class ImportSession:
    """One import in progress; frames must be accepted in order. Use as a context manager:
    leaving it without `finish` aborts."""

    def __init__(self, io: KVRankIO, header: KVHeader, blocks: Sequence[Sequence[int]], *,
                 on_finish: Callable[[], None] | None = None, on_abort: Callable[[], None] | None = None) -> None:
        self.io = io
        self.header = header
        self.request_id = header.request_id
        self.blocks = tuple(list(b) for b in blocks)
        self._on_finish, self._on_abort = on_finish, on_abort
        self._open = True
        reserved = [len(b) for b in self.blocks]
        if reserved != [len(p) for p in header.block_positions]:
            self._fail("bad_header", f"blocks per group: header {[len(p) for p in header.block_positions]}, "
                       f"reserved {reserved}")  # fmt: skip
        self._flat = list(chain.from_iterable(self.blocks))  # the sent order
        self.frame_nbytes = header.frame_nbytes()
        self._next = 0
        self._digest = FrameDigest()
        self._verify = True
        self._destinations: list[torch.Tensor | None] | None = None
        self._written: list[torch.Tensor] = []  # frames written into our blocks, not digested yet
        self._rows: dict[tuple[int, int], torch.Tensor] = {}  # (first, n) -> our block ids, on the device

    def trust_frames(self) -> None:
        """Skip the checksum (sizes, order and layout are still checked): for a device-to-device
        copy whose bytes never leave GPU memory (cuda_ipc.IpcImporter's default; docs/cluster.md, "KV transports"
        says why)."""
        self._verify = False

    def check_checksum_present(self) -> None:
        """Refuse ("checksum") a header without a checksum where this import verifies one: a
        transport calls this before it moves the bytes (`finish` checks again)."""
        if self._verify and self.header.checksum is None:
            self._fail("checksum", "the header carries no checksum and this pull verifies it (exporters compute one "
                       "for direct offers only where the deployment verifies: kv_verify_checksum)")

    @property
    def verifies(self) -> bool:
        """Whether `finish` compares the frames' checksum with the header's."""
        return self._verify

    @property
    def num_frames(self) -> int:
        return len(self.header.frames)

    @functools.cached_property
    def flat_blocks(self) -> np.ndarray:
        """Our blocks in the sent order (frame i covers flat_blocks[first:first + count])."""
        return np.fromiter(self._flat, dtype=np.int64, count=len(self._flat))

    @functools.cached_property
    def frame_table(self) -> np.ndarray:
        """The header's frames as an [F, 3] int64 array: (cache tensor, first sent block, count)."""
        frames = self.header.frames
        return np.array(frames, dtype=np.int64).reshape(len(frames), 3)

    def destinations(self) -> list[torch.Tensor | None]:
        """`destination(i)` of every frame, made once per import (a device transport asks for all
        of them, and `accept` again)."""
        if self._destinations is None:
            out: list[torch.Tensor | None] = []
            views, block_nbytes = self.io.byte_views, self.io.block_nbytes
            for layer, first, n in self.header.frames:
                start, end = self._flat[first], self._flat[first + n - 1]
                size = block_nbytes[layer]
                out.append(views[layer][start * size : (start + n) * size] if end - start == n - 1 else None)
            self._destinations = out
        return self._destinations

    @functools.cached_property
    def destination_runs(self) -> tuple[np.ndarray, np.ndarray]:
        """(in_place, start): per frame, whether our blocks for it form one run (`destination` is
        not None), and where that run starts in its cache tensor's flat bytes. Array passes, no
        tensor made (a device transport slices the words it copies into itself)."""
        table, flat = self.frame_table, self.flat_blocks
        layer, first, count = table.T
        if not len(table):
            return np.zeros(0, dtype=bool), np.zeros(0, dtype=np.int64)
        start = flat[first]
        in_place = flat[first + count - 1] - start == count - 1
        return in_place, start * self.io.block_nbytes_array[layer]

    def destination(self, index: int) -> torch.Tensor | None:
        """Our cache bytes for frame `index` (flat uint8, writable) when its blocks are one run."""
        return self.destinations()[index]

    def accept(self, index: int, data: object | None = None) -> None:
        """Take frame `index`: `data` (bytes-like or uint8 tensor), or None when it was written
        into `destination(index)` already. Refuses (and aborts) on a size mismatch."""
        if index != self._next:
            self._fail("truncated", f"frame {index} arrived, expected frame {self._next}")
        expected = self.frame_nbytes[index]
        layer, first, n = self.header.frames[index]
        cache = self.io.caches[layer].data
        if data is None:
            frame = self.destination(index)
            if frame is None:
                self._fail("truncated", f"frame {index} has no contiguous destination; pass its bytes")
        else:
            frame = data if isinstance(data, torch.Tensor) else _frombuffer(data)
            if frame.dtype != torch.uint8 or frame.dim() != 1:
                frame = as_bytes(frame.contiguous())
        if frame.numel() != expected:
            self._fail("truncated", f"frame {index} has {frame.numel()} bytes, expected {expected}")
        if self._verify:
            if data is None:  # our own blocks: they stay as they are, digested together at finish
                self._written.append(frame)
            else:  # a buffer of the transport's: digested now (the digest keeps the frames in order)
                self._digest_written()
                self._digest.update(frame)
        if data is not None:
            rows = cache.view(torch.uint8).reshape(cache.shape[0], -1)
            rows.index_copy_(0, self._block_rows(first, n, cache.device), frame.to(cache.device).view(n, -1))
        self._next += 1

    def frame_blocks(self, index: int) -> list[int]:
        """Our blocks that frame `index` goes into, in the sent order (a transport that writes our
        blocks itself, a NIXL READ, names them one by one)."""
        _, first, n = self.header.frames[index]
        return self._flat[first : first + n]

    def cache_of(self, index: int) -> torch.Tensor:
        """The cache tensor frame `index` goes into ([num_blocks, ...])."""
        return self.io.caches[self.header.frames[index][0]].data

    def accept_written(self) -> None:
        """Take every frame at once: the transport wrote them all into our blocks (frame_blocks)."""
        if self._next != 0:
            self._fail("truncated", f"{self._next} frames were accepted one by one already")
        if self._verify:
            for i, (layer, first, n) in enumerate(self.header.frames):
                frame = self.destination(i)
                if frame is None:  # our blocks are not one run: gather them in the sent order
                    cache = self.io.caches[layer].data
                    frame = as_bytes(cache.index_select(0, self._block_rows(first, n, cache.device)))
                self._written.append(frame)
        self._next = self.num_frames

    def _digest_written(self) -> None:
        """Digest the frames written into our blocks so far (one kernel for them all on a GPU)."""
        if self._written:
            self._digest.update_many(self._written)
            self._written = []

    def _block_rows(self, first: int, n: int, device: torch.device) -> torch.Tensor:
        """Our blocks for sent blocks first..first+n-1, as an index tensor on `device`: made once
        per run of sent blocks (every layer's frame of that run writes the same rows: one
        host-to-device copy per run, not one per frame)."""
        rows = self._rows.get((first, n))
        if rows is None or rows.device != device:
            rows = torch.tensor(self._flat[first : first + n], dtype=torch.long)
            # from pinned memory on a GPU: a copy from pageable memory waits for the stream's work
            rows = rows.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else rows.to(device)
            self._rows[(first, n)] = rows
        return rows

    def finish(self) -> tuple[list[int], ...]:
        """Verify the checksum; the blocks now hold the request's KV. Returns them, per group."""
        if self._next != self.num_frames:
            self._fail("truncated", f"{self._next} of {self.num_frames} frames arrived")
        self.check_checksum_present()
        self._digest_written()
        if self._verify and self._digest.value != self.header.checksum:
            self._fail("checksum", f"computed {self._digest.value:#018x}, header says {self.header.checksum:#018x}")
        if self._on_finish is not None:
            try:
                self._on_finish()
            except ConfigError as exc:
                self._fail("bad_header", str(exc))
        self._open = False
        return self.blocks

    def abort(self) -> None:
        """Give up the import (idempotent): the driver frees the blocks."""
        if self._open:
            self._open = False
            if self._on_abort is not None:
                self._on_abort()

    def _fail(self, reason: str, message: str) -> None:
        self.abort()
        raise KVTransferError(reason, f"request {self.request_id!r}: {message}")

    def __enter__(self) -> ImportSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


def _as_words(flat: torch.Tensor) -> torch.Tensor | None:
    """A flat uint8 tensor as int64 words (no copy), or None where it is not 8-byte aligned and sized."""
    if flat.numel() % 8 or flat.data_ptr() % 8:
        return None
    return flat.view(torch.int64)


def _frombuffer(data: object) -> torch.Tensor:
    view = memoryview(data).cast("B")  # type: ignore[arg-type]
    if len(view) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers are only read here
        return torch.frombuffer(view, dtype=torch.uint8)
