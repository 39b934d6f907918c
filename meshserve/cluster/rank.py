"""The rank side of a channel: one Worker plus its share of KV hand-overs.

`RankHost` answers the allow-listed methods (executor.RANK_METHODS) with msgpack-able values:
    rendezvous()                    "tcp://<this host>:<free port>" (asked of rank 0)
    start(init_method)              WorkerInfo as a dict
    check_health()                  the worker's health dict
    kv_offer(...)                   offer a request's blocks to pullers; returns the export address
    kv_pull(...)                    pull a request's blocks from the prefill ranks into given blocks
                                    (re-sharding KV heads when the pools' tp differ: kv_reshard.py)

The replica's driver owns the block bookkeeping (its KVCacheManager); a rank owns only the cache
tensors. The kvstore's KVConnector wants both, so each hand-over gives the rank a `BlockBook`:
the driver's decisions for that request (its block tables, one per KV layer group, when sending;
the blocks it allocated when receiving) in the shape of the manager calls the connector makes.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from meshserve.cluster.executor import RANK_METHODS, WorkerSpec, free_port
from meshserve.cluster.kv_reshard import copy_heads, is_headless, pull_key, pullers_of, sources_of, staging_caches
from meshserve.errors import check
from meshserve.kvstore.connector import KVConnector, KVExport
from meshserve.kvstore.retention import RetentionPolicy
from meshserve.kvstore.wire import KVTransferError
from meshserve.parallel.transform import local_kv_heads
from meshserve.workers.checkpoint import read_arch

log = logging.getLogger("meshserve.rank")

OFFER_TTL_S = 30.0  # an offer nobody pulls is dropped after this


class BlockBook:
    """The driver's block decisions for hand-overs, as the KVConnector asks for them.

    Sender: `describe(request_id, tables, num_tokens, hashes, extra_keys)` first (tables and
    hashes: one list per KV layer group); the connector then reads the tables and pins (fork)
    them; the driver keeps the blocks pinned on its side.
    Receiver: `assign(request_id, blocks)` first (every group's, group after group);
    `allocate_for_import` hands exactly those out.
    retentions: per KV layer group (the worker's KVGroupLayout), for the layout check.
    """

    def __init__(self, block_size: int, dcp_size: int = 1, retentions: Sequence[RetentionPolicy] = (RetentionPolicy(),)
                 ) -> None:  # fmt: skip
        self.block_size = block_size
        self.dcp_size = dcp_size
        self.tokens_per_block = block_size * dcp_size
        self.retentions = tuple(retentions)
        self.num_groups = len(self.retentions)
        self.num_free_blocks = 0  # only quoted in refusal messages: the driver decides capacity
        self._tables: dict[Any, tuple[list[list[int]], int, list[list[bytes]], tuple]] = {}
        self._assigned: dict[Any, list[int]] = {}
        self.imported_hashes: dict[Any, list[list[bytes]]] = {}

    # sender side
    def describe(self, request_id: Any, tables: Sequence[Sequence[int]], num_tokens: int,
                 hashes: Sequence[Sequence[bytes]], extra_keys: Sequence[object] = ()) -> None:
        check(len(tables) == len(hashes) == self.num_groups, "tables", len(tables),
              f"one table and one hash list per KV layer group ({self.num_groups})")
        self._tables[request_id] = ([list(t) for t in tables], num_tokens, [[bytes(h) for h in g] for g in hashes],
                                    tuple(extra_keys))  # fmt: skip

    def block_tables(self, request_id: Any) -> list[list[int]]:
        return self._tables[request_id][0]

    def num_tokens(self, request_id: Any) -> int:
        return self._tables[request_id][1]

    def block_hashes(self, request_id: Any) -> list[list[bytes]]:
        return self._tables[request_id][2]

    def extra_keys(self, request_id: Any) -> tuple:
        return self._tables[request_id][3]

    def fork(self, parent_id: Any, child_id: Any) -> None:
        self._tables[child_id] = self._tables[parent_id]

    def free(self, request_id: Any, *, keep_cache: bool = True) -> bool:
        found = self._tables.pop(request_id, None) is not None
        return self._assigned.pop(request_id, None) is not None or found

    def __contains__(self, request_id: Any) -> bool:
        return request_id in self._tables  # an import's id is never described here

    # receiver side
    def assign(self, request_id: Any, blocks: Sequence[int]) -> None:
        self._assigned[request_id] = list(blocks)

    def allocate_for_import(self, request_id: Any, num_tokens: int, block_positions: Sequence[Sequence[int]], *,
                            extra_keys: Sequence[object] = ()) -> tuple[list[int], ...] | None:
        """block_positions: one list per group, as the manager takes them."""
        blocks = self._assigned.get(request_id)
        if blocks is None or len(blocks) != sum(len(p) for p in block_positions):
            return None  # the driver sized the import differently: refused as "capacity"
        out, start = [], 0
        for positions in block_positions:
            out.append(blocks[start : start + len(positions)])
            start += len(positions)
        return tuple(out)

    def register_hashes(self, request_id: Any, block_hashes: Sequence[Sequence[bytes]]) -> None:
        self.imported_hashes[request_id] = [[bytes(h) for h in g] for g in block_hashes]


class RankHost:
    """Builds the worker on `start` and answers the driver's messages for one rank."""

    def __init__(self, spec: WorkerSpec, *, rank: int) -> None:
        self.spec = spec
        self.rank = rank
        self.worker = None
        self._book: BlockBook | None = None
        self._connector: KVConnector | None = None
        self._server = None

    # -- dispatch -------------------------------------------------------------------------------
    def execute_step(self, plan: bytes) -> bytes:
        check(self.worker is not None, "rank", self.rank, "started before its first step")
        return self.worker.execute_step(plan)

    def call(self, method: str, args: dict[str, Any]) -> Any:
        check(method in RANK_METHODS, "method", method, f"one of {sorted(RANK_METHODS)}")
        return getattr(self, method)(**args)

    # -- lifecycle ------------------------------------------------------------------------------
    def rendezvous(self) -> str:
        host = _reachable_host()
        return f"tcp://{host}:{free_port(host)}"

    def start(self, init_method: str | None = None) -> dict[str, Any]:
        module, _, name = self.spec.worker_class.partition(":")
        worker_cls = getattr(importlib.import_module(module), name)
        s = self.spec
        tp = s.parallel.tp
        self.worker = worker_cls(s.model, s.cache, s.attention, s.parallel, rank=self.rank, device=s.device,
                                 progress=False, init_method=init_method if tp > 1 else None)
        return asdict(self.worker.start())

    def check_health(self) -> dict[str, Any]:
        return {} if self.worker is None else self.worker.check_health()

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None

    # -- KV hand-over ---------------------------------------------------------------------------
    @property
    def has_pending_exports(self) -> bool:
        return self._server is not None and self._server.num_pending > 0

    def poll_exports(self, timeout_ms: int = 0) -> None:
        """Serve pulls from peers; the channel loop calls this between messages."""
        if self._server is not None:
            self._server.poll(timeout_ms)

    def _kv(self, block_size: int, dcp_size: int, model_id: str) -> KVConnector:
        if self._connector is None:
            check(self.worker is not None and self.worker.runner is not None, "rank", self.rank,
                  "started before a KV hand-over")
            self._book = BlockBook(block_size, dcp_size, self.worker.kv_layout.retentions)
            self._connector = KVConnector(self._book, self.worker.runner.kv_caches, model_id=model_id)
        return self._connector

    def kv_offer(self, request_id: str, tables: list[list[int]], num_tokens: int, hashes: list[list[bytes]],
                 extra_keys: list, block_size: int, dcp_size: int, model_id: str, dst_tp: int,
                 fault: str | None = None) -> str:
        """Offer this rank's shard of the request's blocks (tables and hashes per KV layer group) to
        the decode ranks of `dst_tp` that need it (the driver keeps the blocks pinned until the
        decode side is done). Returns the address.

        fault (tests): "checksum" offers corrupted bytes, "withdraw" offers nothing.
        """
        from meshserve.kvstore.zmq_transport import KVExportServer

        connector = self._kv(block_size, dcp_size, model_id)
        if self._server is None:
            self._server = KVExportServer(connector, address=f"tcp://{_reachable_host()}")
        self._book.describe(request_id, tables, num_tokens, hashes, extra_keys)
        export = connector.export(request_id)
        if dst_tp == self.tp:
            keys = [request_id]  # decode rank r pulls from prefill rank r
        else:
            keys = [pull_key(request_id, j) for j in pullers_of(self.rank, self._num_kv_heads(), self.tp, dst_tp)]
        frames = export.frames
        if fault == "checksum":
            frames = [f.clone() for f in frames]
            frames[0][0] ^= 0x5A  # a copy: the cache itself stays intact
        for key in keys if fault != "withdraw" else []:
            header = export.header if key == request_id else dataclasses.replace(export.header, request_id=key)
            self._server.offer_export(KVExport(header, frames, (export.pin_id, key)), ttl_s=OFFER_TTL_S)
        connector.release(export)  # the driver's pin keeps the blocks; each offer holds the frames
        return self._server.address

    def kv_pull(self, request_id: str, addresses: list[str], src_tp: int, blocks: list[int], block_size: int,
                dcp_size: int, model_id: str, timeout_s: float = 5.0) -> dict[str, Any]:
        """Pull this rank's share of the request's KV from the prefill ranks (`addresses`, by rank)
        into `blocks` (allocated by the driver, every KV layer group's in group order); with a
        different tp, through kv_reshard.

        Returns {"ok": True, "hashes": [[...] per group]} or {"ok": False, "reason": ..., "error": ...}; on
        failure the blocks hold garbage and the driver frees them without caching.
        """
        connector = self._kv(block_size, dcp_size, model_id)
        try:
            if src_tp == self.tp:
                hashes = _pull(connector, self._book, addresses[self.rank], request_id, blocks, timeout_s)
            else:
                hashes = self._pull_resharded(request_id, addresses, src_tp, blocks, model_id, timeout_s)
            return {"ok": True, "hashes": hashes}
        except KVTransferError as exc:
            return {"ok": False, "reason": exc.reason, "error": str(exc)}

    def _pull_resharded(self, request_id: str, addresses: list[str], src_tp: int, blocks: list[int],
                        model_id: str, timeout_s: float) -> list[list[bytes]]:
        caches = self.worker.runner.kv_caches
        heads = self._num_kv_heads()
        key = pull_key(request_id, self.rank)
        hashes: list[list[bytes]] = []
        for piece in sources_of(self.rank, heads, src_tp, self.tp):
            if piece.src_heads is None:  # latent caches: the source's shard is the whole cache
                return _pull(self._connector, self._book, addresses[piece.src_rank], key, blocks, timeout_s)
            staging = staging_caches(caches, local_kv_heads(heads, src_tp, 1), len(blocks))
            book = BlockBook(self._book.block_size, self._book.dcp_size, self._book.retentions)
            stage = KVConnector(book, staging, model_id=model_id)
            hashes = _pull(stage, book, addresses[piece.src_rank], key, list(range(1, len(blocks) + 1)), timeout_s)
            copy_heads(caches, staging, blocks, piece)
        return hashes

    @property
    def tp(self) -> int:
        return self.worker.parallel.tp

    def _num_kv_heads(self) -> int | None:
        """The model's KV heads (None for caches without a head axis)."""
        if is_headless(self.worker.runner.kv_caches):
            return None
        return read_arch(self.worker.model_config.model).num_kv_heads


def _pull(connector: KVConnector, book: BlockBook, address: str, key: str, blocks: list[int],
          timeout_s: float) -> list[list[bytes]]:
    """Pull offer `key` from `address` into `blocks` of `connector`'s caches; the prefix hashes
    per KV layer group."""
    from meshserve.kvstore.zmq_transport import pull_kv

    book.assign(key, blocks)
    try:
        pull_kv(connector, address, key, timeout_s=timeout_s)
        return book.imported_hashes.get(key, [[] for _ in range(book.num_groups)])
    finally:
        book.free(key)
        book.imported_hashes.pop(key, None)


def _reachable_host() -> str:
    """This host's address as peers see it: Ray's node IP when inside Ray, else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"
