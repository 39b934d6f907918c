"""Both ends of KV hand-overs in one process: a KVCacheManager's driver side (pins.py) and one
rank's caches (rank_io.py), for replicas whose driver and only rank share a process, tests and
benches. A distributed replica uses the two halves apart (cluster/handover.py drives, every
rank's cluster/executors/rank_host.py moves its shard).

    sender:   export = src.export(request_id)        # pins the blocks; the request may be freed
              ... ship export.header_bytes and export.frames (zmq, torch.distributed, in-process)
              src.release(export)                    # once the transport is done with the frames
    receiver: with dst.begin_import(header) as s:    # checks layout + reserves, or refuses
                  ... frames as with KVRankIO (rank_io.py) ...
                  blocks = s.finish()                # checksum; hashes registered; else refused
A refusal raises KVTransferError; leaving the `with` block without `finish` frees every block the
import reserved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from meshserve.errors import ConfigError
from meshserve.kvstore.cache_tensors import LayerCache
from meshserve.kvstore.manager import KVCacheManager
from meshserve.kvtransfer.pins import KVPins
from meshserve.kvtransfer.rank_io import DEFAULT_FRAME_BYTES, ImportSession, KVExport, KVRankIO
from meshserve.kvtransfer.wire import KVHeader, KVTransferError

__all__ = ["DEFAULT_FRAME_BYTES", "ImportSession", "KVConnector", "KVExport"]


class KVConnector:
    """KVPins over `manager` plus KVRankIO over `caches` (an `ImportTarget` for the transports)."""

    def __init__(self, manager: KVCacheManager, caches: Sequence[LayerCache | None], *, model_id: str) -> None:
        self.manager = manager
        self.pins = KVPins(manager)
        self.io = KVRankIO(caches, model_id=model_id, block_size=manager.block_size, dcp_size=manager.dcp_size,
                           retentions=manager.retentions)  # fmt: skip
        self.layout = self.io.layout
        self.caches = self.io.caches
        self.device = self.io.device

    # ---- sender ---------------------------------------------------------------------------
    def export(self, request_id: str | int, *, max_frame_bytes: int = DEFAULT_FRAME_BYTES,
               checksum: bool = True) -> KVExport:  # fmt: skip
        """Pin the request's blocks and describe them (the request itself may be freed now);
        checksum: as KVRankIO.export."""
        pin = self.pins.pin(request_id)
        try:
            export = self.io.export(pin.blocks, max_frame_bytes=max_frame_bytes, checksum=checksum)
        except BaseException:
            self.pins.release(pin.pin_id)
            raise
        return dataclasses.replace(export, pin_id=pin.pin_id)

    def release(self, export: KVExport) -> None:
        """Drop the export's pin (its frames must no longer be read)."""
        if export.pin_id is not None:
            self.pins.release(export.pin_id)

    # ---- receiver -------------------------------------------------------------------------
    def begin_import(self, header: KVHeader | bytes | memoryview) -> ImportSession:
        """Check the header against this replica and reserve blocks; KVTransferError if refused."""
        if not isinstance(header, KVHeader):
            header = KVHeader.unpack(header)
        self.io.check(header)
        rid = header.request_id
        if rid in self.manager:
            raise KVTransferError("bad_header", f"request {rid!r} already holds blocks here")
        try:
            blocks = self.pins.reserve(rid, header.num_tokens, header.block_positions, extra_keys=header.extra_keys)
        except ConfigError as exc:
            raise KVTransferError("bad_header", str(exc)) from exc
        if blocks is None:
            raise KVTransferError("capacity", f"{header.num_blocks} blocks needed, {self.manager.num_free_blocks} free")
        return ImportSession(self.io, header, blocks, on_finish=lambda: self.pins.commit(rid, header.block_hashes),
                             on_abort=lambda: self.pins.abort(rid))  # fmt: skip

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
