"""The rank side of a channel: one Worker plus its share of KV hand-overs.

`RankHost` answers the allow-listed methods (executor.RANK_METHODS) with msgpack-able values:
    rendezvous()                    "tcp://<this host>:<free port>" (asked of rank 0)
    start(init_method)              WorkerInfo as a dict
    check_health()                  the worker's health dict
    kv_offer(...)                   offer a request's blocks to pullers; returns the export address
    kv_pull(...)                    pull a request's blocks from a peer rank into given blocks

The replica's driver owns the block bookkeeping (its KVCacheManager); a rank owns only the cache
tensors. The kvstore's KVConnector wants both, so each hand-over gives the rank a `BlockBook`:
the driver's decisions for that request (its block table when sending; the blocks it allocated
when receiving) in the shape of the manager calls the connector makes.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from meshserve.cluster.executor import RANK_METHODS, WorkerSpec, free_port
from meshserve.errors import check
from meshserve.kvstore.connector import KVConnector, KVExport
from meshserve.kvstore.wire import KVTransferError

log = logging.getLogger("meshserve.rank")

OFFER_TTL_S = 30.0  # an offer nobody pulls is dropped after this


class BlockBook:
    """The driver's block decisions for hand-overs, as the KVConnector asks for them.

    Sender: `describe(request_id, table, num_tokens, hashes, extra_keys)` first; the connector
    then reads the table and pins (fork) it; the driver keeps the blocks pinned on its side.
    Receiver: `assign(request_id, blocks)` first; `allocate_for_import` hands exactly those out.
    """

    def __init__(self, block_size: int, dcp_size: int = 1) -> None:
        self.block_size = block_size
        self.dcp_size = dcp_size
        self.tokens_per_block = block_size * dcp_size
        self.num_free_blocks = 0  # only quoted in refusal messages: the driver decides capacity
        self._tables: dict[Any, tuple[list[int], int, list[bytes], tuple]] = {}
        self._assigned: dict[Any, list[int]] = {}
        self.imported_hashes: dict[Any, list[bytes]] = {}

    # sender side
    def describe(self, request_id: Any, table: Sequence[int], num_tokens: int, hashes: Sequence[bytes],
                 extra_keys: Sequence[object] = ()) -> None:
        self._tables[request_id] = (list(table), num_tokens, [bytes(h) for h in hashes], tuple(extra_keys))

    def block_table(self, request_id: Any) -> list[int]:
        return self._tables[request_id][0]

    def num_tokens(self, request_id: Any) -> int:
        return self._tables[request_id][1]

    def block_hashes(self, request_id: Any) -> list[bytes]:
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

    def allocate_for_import(self, request_id: Any, num_tokens: int, block_positions: Sequence[int], *,
                            extra_keys: Sequence[object] = ()) -> list[int] | None:
        blocks = self._assigned.get(request_id)
        if blocks is None or len(blocks) != len(block_positions):
            return None  # the driver sized the import differently: refused as "capacity"
        return blocks

    def register_hashes(self, request_id: Any, block_hashes: Sequence[bytes]) -> None:
        self.imported_hashes[request_id] = [bytes(h) for h in block_hashes]


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
            self._book = BlockBook(block_size, dcp_size)
            self._connector = KVConnector(self._book, self.worker.runner.kv_caches, model_id=model_id)
        return self._connector

    def kv_offer(self, request_id: str, table: list[int], num_tokens: int, hashes: list[bytes],
                 extra_keys: list, block_size: int, dcp_size: int, model_id: str, fault: str | None = None) -> str:
        """Offer the request's blocks (the driver keeps them pinned until the puller confirms).

        fault (tests): "checksum" offers corrupted bytes, "withdraw" offers nothing.
        """
        from meshserve.kvstore.zmq_transport import KVExportServer

        connector = self._kv(block_size, dcp_size, model_id)
        if self._server is None:
            self._server = KVExportServer(connector, address=f"tcp://{_reachable_host()}")
        self._book.describe(request_id, table, num_tokens, hashes, extra_keys)
        export = connector.export(request_id)
        self._book.free(request_id)  # the export's pin holds the description now
        if fault == "withdraw":
            connector.release(export)
        elif fault == "checksum":
            frames = [f.clone() for f in export.frames]
            frames[0][0] ^= 0x5A  # a copy: the cache itself stays intact
            self._server.offer_export(KVExport(export.header, frames, export.pin_id, export.header_bytes),
                                      ttl_s=OFFER_TTL_S)
        else:
            self._server.offer_export(export, ttl_s=OFFER_TTL_S)
        return self._server.address

    def kv_pull(self, request_id: str, address: str, blocks: list[int], block_size: int, dcp_size: int,
                model_id: str, timeout_s: float = 5.0) -> dict[str, Any]:
        """Pull the request's blocks from `address` into `blocks` (allocated by the driver).

        Returns {"ok": True, "hashes": [...]} or {"ok": False, "reason": ..., "error": ...}; on
        failure the blocks hold garbage and the driver frees them without caching.
        """
        from meshserve.kvstore.zmq_transport import pull_kv

        connector = self._kv(block_size, dcp_size, model_id)
        self._book.assign(request_id, blocks)
        try:
            pull_kv(connector, address, request_id, timeout_s=timeout_s)
            return {"ok": True, "hashes": self._book.imported_hashes.pop(request_id, [])}
        except KVTransferError as exc:
            return {"ok": False, "reason": exc.reason, "error": str(exc)}
        finally:
            self._book.free(request_id)
            self._book.imported_hashes.pop(request_id, None)


def _reachable_host() -> str:
    """This host's address as peers see it: Ray's node IP when inside Ray, else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"
