"""KV hand-over between replicas: export a request's blocks, import them into fresh blocks.

    sender:   export = src.export(request_id)        # pins the blocks; the request may be freed
              ... ship export.header_bytes and export.frames (zmq, torch.distributed, in-process)
              src.release(export)                    # once the transport is done with the frames
    receiver: with dst.begin_import(header) as s:    # checks layout + allocates, or refuses
                  for i in range(s.num_frames):
                      view = s.destination(i)        # our own cache bytes when the run is contiguous
                      ... write frame i into `view`, then s.accept(i); or s.accept(i, frame_bytes)
                  blocks = s.finish()                # checksum; hashes registered; else refused
A refusal raises KVTransferError; leaving the `with` block without `finish` frees every block the
import allocated. Each DCP/TP rank moves its own shard with its own connector; the layout
fingerprint (model id, block size, dcp size, per-tensor dtype and block shape, KV layer groups)
must match. The manager holds one block table per request and KV layer group; a hybrid layout's
groups share cache tensors, so each tensor is sent once per block, whatever group holds it.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from itertools import count

import torch

from meshserve.errors import ConfigError, check
from meshserve.kvstore.block_pool import NULL_BLOCK
from meshserve.kvstore.cache_tensors import LayerCache, MLACache
from meshserve.kvstore.manager import KVCacheManager
from meshserve.kvstore.wire import FrameDigest, KVHeader, KVLayout, KVTransferError, as_bytes, plan_frames

DEFAULT_FRAME_BYTES = 1 << 20  # small enough to pipeline sender and receiver copies


@dataclass
class KVExport:
    """One request's blocks ready to ship. frames: flat uint8 views of the sender's caches (on the
    caches' device; no copy). Valid until `KVConnector.release`."""

    header: KVHeader
    frames: list[torch.Tensor]
    pin_id: Hashable
    header_bytes: bytes = field(default=b"")

    def __post_init__(self) -> None:
        if not self.header_bytes:
            self.header_bytes = self.header.pack()


def _scales(cache: LayerCache) -> tuple[float, ...]:
    if isinstance(cache, MLACache):
        return (float(cache.scale),)
    return (float(cache.k_scale), float(cache.v_scale))


class KVConnector:
    """Exports and imports requests' KV for one rank's (KV manager, per-layer caches).

    caches: as from allocate_caches (None entries, layers without a cache, are skipped; layers
    that share a tensor are sent once).
    model_id: names the weights; replicas of different models never exchange KV.
    """

    def __init__(
        self, manager: KVCacheManager, caches: Sequence[LayerCache | None], *, model_id: str
    ) -> None:
        self.manager = manager
        self.layer_caches = [c for c in caches if c is not None]  # scales are per layer
        self.caches = list({id(c.data): c for c in self.layer_caches}.values())  # one per tensor
        check(bool(self.caches), "caches", len(caches), "at least one layer cache")
        self.layout = KVLayout.from_caches(
            self.caches, model_id=model_id, block_size=manager.block_size, dcp_size=manager.dcp_size,
            groups=[(r.sliding_window, r.num_sink_tokens) for r in manager.retentions],
        )
        self._block_nbytes = self.layout.block_nbytes()
        self._pins = count()

    # ---- sender ---------------------------------------------------------------------------
    def export(self, request_id: str | int, *, max_frame_bytes: int = DEFAULT_FRAME_BYTES) -> KVExport:
        """Pin the request's blocks and describe them (the request itself may be freed now)."""
        check(isinstance(request_id, str | int), "request_id", request_id, "a str or int (it goes on the wire)")
        check(max_frame_bytes >= 1, "max_frame_bytes", max_frame_bytes, "an integer >= 1")
        kv = self.manager
        tables = kv.block_tables(request_id)
        positions = [[i for i, b in enumerate(table) if b != NULL_BLOCK] for table in tables]
        blocks = [table[i] for table, held in zip(tables, positions) for i in held]
        pin_id = ("kv-export", request_id, next(self._pins))
        kv.fork(request_id, pin_id)  # the export holds its own references
        plan = plan_frames(blocks, self._block_nbytes, max_frame_bytes)
        frames = [as_bytes(self.caches[layer].data[blocks[first] : blocks[first] + n]) for layer, first, n in plan]
        digest = FrameDigest()
        for frame in frames:
            digest.update(frame)
        header = KVHeader(
            request_id=request_id,
            layout=self.layout,
            num_tokens=kv.num_tokens(request_id),
            block_positions=tuple(tuple(p) for p in positions),
            block_hashes=tuple(tuple(h) for h in kv.block_hashes(request_id)),
            extra_keys=kv.extra_keys(request_id),
            scales=tuple(_scales(c) for c in self.layer_caches),
            frames=tuple(plan),
            nbytes=sum(f.numel() for f in frames),
            checksum=digest.value,
            fingerprint=self.layout.fingerprint,
        )
        return KVExport(header=header, frames=frames, pin_id=pin_id)

    def release(self, export: KVExport) -> None:
        """Drop the export's references (its frames must no longer be read)."""
        self.manager.free(export.pin_id)

    # ---- receiver -------------------------------------------------------------------------
    def begin_import(self, header: KVHeader | bytes | memoryview) -> ImportSession:
        """Check the header against this replica and allocate blocks; KVTransferError if refused."""
        if not isinstance(header, KVHeader):
            header = KVHeader.unpack(header)
        return ImportSession(self, header)

    def import_(self, header: KVHeader | bytes, frames: Sequence[object]) -> tuple[list[int], ...]:
        """Import from in-memory frames (bytes-like or uint8 tensors); returns the new blocks per group."""
        with self.begin_import(header) as session:
            if len(frames) != session.num_frames:
                raise KVTransferError("truncated", f"{len(frames)} frames, header lists {session.num_frames}")
            for i, frame in enumerate(frames):
                session.accept(i, frame)
            return session.finish()

    def transfer_from(self, sender: KVConnector, request_id: str | int) -> tuple[list[int], ...]:
        """In-process hand-over (both replicas in this process): export, copy, release."""
        export = sender.export(request_id)
        try:
            return self.import_(export.header, export.frames)
        finally:
            sender.release(export)


class ImportSession:
    """One import in progress; frames must be accepted in order. Use as a context manager."""

    def __init__(self, connector: KVConnector, header: KVHeader) -> None:
        self.connector = connector
        self.header = header
        self.request_id = header.request_id
        self._check(header)
        self.frame_nbytes = header.frame_nbytes()
        kv = connector.manager
        try:
            blocks = kv.allocate_for_import(self.request_id, header.num_tokens, header.block_positions,
                                            extra_keys=header.extra_keys)
        except ConfigError as exc:
            raise KVTransferError("bad_header", str(exc)) from exc
        if blocks is None:
            raise KVTransferError("capacity", f"{header.num_blocks} blocks needed, {kv.num_free_blocks} free")
        self.blocks = blocks
        self._flat = [b for group in blocks for b in group]  # the sent order
        self._next = 0
        self._digest = FrameDigest()
        self._open = True

    @property
    def num_frames(self) -> int:
        return len(self.header.frames)

    def _check(self, header: KVHeader) -> None:
        ours = self.connector.layout
        if header.fingerprint != header.layout.fingerprint:
            raise KVTransferError("bad_header", "the fingerprint does not match the layout it came with")
        if header.layout != ours:
            raise KVTransferError(
                "layout",
                f"fingerprint {header.fingerprint} != {ours.fingerprint}; {ours.difference(header.layout)}",
            )
        mine = tuple(_scales(c) for c in self.connector.layer_caches)
        if header.scales != mine:
            raise KVTransferError("layout", f"cache scales differ: receiver {mine}, sender {header.scales}")
        if len(header.block_positions) != len(ours.groups) or len(header.block_hashes) != len(ours.groups):
            raise KVTransferError("bad_header", f"block positions and hashes for {len(ours.groups)} KV layer groups")
        num_blocks = header.num_blocks
        for layer in range(len(ours.layers)):
            covered = [(first, n) for lay, first, n in header.frames if lay == layer]
            starts = [0]
            for first, n in covered:
                if first != starts[-1] or n < 1:
                    raise KVTransferError("bad_header", f"frames of layer {layer} do not tile its blocks")
                starts.append(first + n)
            if starts[-1] != num_blocks:
                raise KVTransferError(
                    "bad_header", f"frames of layer {layer} cover {starts[-1]} of {num_blocks} blocks"
                )
        if header.nbytes != sum(header.frame_nbytes()):
            raise KVTransferError("bad_header", f"nbytes {header.nbytes} != the sum of the frame sizes")
        full = header.num_tokens // self.connector.manager.tokens_per_block
        counts = {len(g) for g in header.block_hashes}
        if len(counts) > 1 or max(counts) > full or any(len(h) != 32 for g in header.block_hashes for h in g):
            raise KVTransferError("bad_header", f"block_hashes: as many in every group, at most {full} of 32 bytes")
        if self.request_id in self.connector.manager:
            raise KVTransferError("bad_header", f"request {self.request_id!r} already holds blocks here")

    def destination(self, index: int) -> torch.Tensor | None:
        """Our cache bytes for frame `index` (flat uint8, writable) when its blocks are one run."""
        layer, first, n = self.header.frames[index]
        dst = self._flat[first : first + n]
        if dst[-1] - dst[0] != n - 1:
            return None
        return as_bytes(self.connector.caches[layer].data[dst[0] : dst[0] + n])

    def accept(self, index: int, data: object | None = None) -> None:
        """Take frame `index`: `data` (bytes-like or uint8 tensor), or None when it was written
        into `destination(index)` already. Refuses (and frees) on a size mismatch."""
        if index != self._next:
            self._fail("truncated", f"frame {index} arrived, expected frame {self._next}")
        expected = self.frame_nbytes[index]
        layer, first, n = self.header.frames[index]
        cache = self.connector.caches[layer].data
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
        self._digest.update(frame)
        if data is not None:
            dst = torch.tensor(self._flat[first : first + n], dtype=torch.long, device=cache.device)
            rows = cache.view(torch.uint8).reshape(cache.shape[0], -1)
            rows.index_copy_(0, dst, frame.to(cache.device).view(n, -1))
        self._next += 1

    def finish(self) -> tuple[list[int], ...]:
        """Verify the checksum and make the blocks the request's; returns them per group."""
        if self._next != self.num_frames:
            self._fail("truncated", f"{self._next} of {self.num_frames} frames arrived")
        if self._digest.value != self.header.checksum:
            self._fail("checksum", f"computed {self._digest.value:#018x}, header says {self.header.checksum:#018x}")
        self.connector.manager.register_hashes(self.request_id, self.header.block_hashes)
        self._open = False
        return self.blocks

    def abort(self) -> None:
        """Free every block this import allocated (idempotent)."""
        if self._open:
            self._open = False
            self.connector.manager.free(self.request_id, keep_cache=False)

    def _fail(self, reason: str, message: str) -> None:
        self.abort()
        raise KVTransferError(reason, f"request {self.request_id!r}: {message}")

    def __enter__(self) -> ImportSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


def _frombuffer(data: object) -> torch.Tensor:
    view = memoryview(data).cast("B")  # type: ignore[arg-type]
    if len(view) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers are only read here
        return torch.frombuffer(view, dtype=torch.uint8)
