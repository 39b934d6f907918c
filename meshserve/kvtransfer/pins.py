"""The driver side of a KV hand-over: what happens in the KVCacheManager while blocks move
(plain Python, no torch). The bytes move between ranks (rank_io.py, the transports); the driver
decides which blocks and keeps them alive meanwhile.

    sender:   pin = pins.pin(request_id)          # a hidden fork: the blocks stay while in flight
              ... every rank exports pin.blocks (HandoverBlocks, msgpack-able) ...
              pins.release(pin.pin_id)            # the receiver is done (pulled, refused or failed)
    receiver: blocks = pins.reserve(request_id, num_tokens, block_positions, extra_keys=...)
              ... every rank imports into `blocks` (per group) ...
              pins.commit(request_id, block_hashes)   # or pins.abort(request_id): freed, not cached
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from itertools import chain, compress, count
from typing import Any

from meshserve.errors import check
from meshserve.kvstore.block_hash import BlockHash
from meshserve.kvstore.manager import KVCacheManager, RequestId
from meshserve.kvtransfer.packed import pack_hashes, pack_u32, unpack_hashes, unpack_u32


@dataclass(frozen=True)
class HandoverBlocks:
    """One request's blocks as the sending driver holds them: what every rank exports.

    block_tables: per KV layer group, the physical block ids by logical index (NULL_BLOCK where
    a window released them); block_hashes: per group, prefix hashes of the first full blocks.
    """

    request_id: str | int
    num_tokens: int
    block_tables: tuple[tuple[int, ...], ...]
    block_hashes: tuple[tuple[BlockHash, ...], ...]
    extra_keys: tuple = ()
    # True when from_wire split the hashes from a packed bin (each HASH_BYTES by construction, checked
    # by the sender's to_wire): the rank's export packs them into its header without checking again
    hashes_sized: bool = field(default=False, compare=False, repr=False)

    # NULL_BLOCK is 0 (block_pool.py), the only false block id: compress/filter pick the held entries in C,
    # without Python per block (a 32k-token request holds 2048 per group).
    @functools.cached_property
    def block_positions(self) -> tuple[tuple[int, ...], ...]:
        """Per group, the table indices that hold a block (the others were released)."""
        return tuple(tuple(compress(range(len(t)), t)) for t in self.block_tables)

    @functools.cached_property
    def blocks(self) -> list[int]:
        """Every group's held blocks, group after group, each in table order: the sent order.
        Computed once: read it, never modify it."""
        return list(filter(None, chain.from_iterable(self.block_tables)))

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-able map (driver to ranks: `kv_offer`): per group, the table as one bin of
        packed uint32 block ids and the hashes as one bin (packed.py), not 2048 items each a group
        at 32k tokens. The keys name the packed form, so a rank that expects another form fails
        with a KeyError (the offer fails, the prompt is recomputed) rather than misreading it."""
        return {"request_id": self.request_id, "num_tokens": self.num_tokens,
                "block_tables_u32": [pack_u32(t) for t in self.block_tables],
                "block_hashes_packed": [pack_hashes(h) for h in self.block_hashes],
                "extra_keys": list(self.extra_keys)}

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> HandoverBlocks:
        return cls(obj["request_id"], int(obj["num_tokens"]), tuple(map(unpack_u32, obj["block_tables_u32"])),
                   tuple(map(unpack_hashes, obj["block_hashes_packed"])), tuple(obj["extra_keys"]), hashes_sized=True)


@dataclass(frozen=True)
class Pin:
    """A pinned request: `pin_id` holds references to `blocks` until released."""

    pin_id: tuple
    blocks: HandoverBlocks


class KVPins:
    """Pins, reservations and their end for hand-overs of one KVCacheManager. Call from the
    thread that owns the manager."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self._pins: set[Hashable] = set()
        self._ids = count()

    @property
    def num_pinned(self) -> int:
        """Pins not released yet."""
        return len(self._pins)

    # ---- sender ---------------------------------------------------------------------------
    def pin(self, request_id: str | int) -> Pin:
        """Fork the request's blocks into a new pin and describe them (the request may be freed
        or go on: the pin keeps its own references)."""
        check(isinstance(request_id, str | int), "request_id", request_id, "a str or int (it goes on the wire)")
        kv = self.manager
        pin_id = ("kv-pin", request_id, next(self._ids))
        kv.fork(request_id, pin_id)
        self._pins.add(pin_id)
        blocks = HandoverBlocks(
            request_id=request_id,
            num_tokens=kv.num_tokens(pin_id),
            block_tables=tuple(tuple(t) for t in kv.block_tables(pin_id)),
            block_hashes=tuple(tuple(h) for h in kv.block_hashes(pin_id)),
            extra_keys=kv.extra_keys(pin_id),
        )
        return Pin(pin_id, blocks)

    def release(self, pin_id: Hashable) -> bool:
        """Drop a pin's references (no rank may read its blocks for this hand-over any more);
        False if it was released already."""
        if pin_id not in self._pins:
            return False
        self._pins.discard(pin_id)
        return self.manager.free(pin_id)

    # ---- receiver -------------------------------------------------------------------------
    def reserve(self, request_id: RequestId, num_tokens: int, block_positions: Sequence[Sequence[int]], *,
                extra_keys: Sequence[object] = ()) -> tuple[list[int], ...] | None:  # fmt: skip
        """Fresh blocks, per group at the sender's `block_positions`, for a request whose KV is on
        its way; None when the pool cannot hold them all (nothing changes)."""
        return self.manager.allocate_for_import(request_id, num_tokens, block_positions, extra_keys=extra_keys)

    def commit(self, request_id: RequestId, block_hashes: Sequence[Sequence[BlockHash]]) -> None:
        """Every rank has the KV: adopt the sender's prefix hashes (per group)."""
        self.manager.register_hashes(request_id, block_hashes)

    def abort(self, request_id: RequestId) -> None:
        """The transfer failed: free the reserved blocks, forgetting any hash (their bytes are not
        trustworthy)."""
        self.manager.free(request_id, keep_cache=False)
