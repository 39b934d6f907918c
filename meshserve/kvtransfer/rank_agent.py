"""One rank's side of KV hand-overs: its export server, its pullers, its pulls in the background
and its NIXL agent. The rank host (cluster/executors/rank_host.py) answers the driver's kv_*
calls by calling this; nothing here knows of channels, actors or workers.

    agent = KVRankAgent(RankCaches(...), rank=r, kv_transport="auto", secret=secret, host=node_ip,
                        verify_checksum=False)   # CacheConfig.kv_verify_checksum
    agent.offer(blocks, capability, ...)       # export this rank's shard; returns its endpoint
    agent.pull(capability, addresses, ...)     # import this rank's share (re-sharded if need be)
    agent.pull_start(transfer_id, ...) / pull_done() / pull_cancel(transfer_id)
    agent.pulls_done                           # a Doorbell, rung while pull_done has results
    agent.poll(timeout_ms)                     # serve pullers, from the rank's own loop
    agent.close()

The transport of each pull is chosen here, per hand-over, from the configured `kv_transport` and
what the two ends share (transport.py: nixl where both ends have an agent, cuda_ipc within a
host, else zmq).

The frames' checksum is computed where it is checked: at the offer when the deployment has direct
pullers (NIXL, CUDA IPC) verify it (`verify_checksum`; then its pullers verify too), else at the
first zmq pull of the offer (export_server.py; a zmq pull always verifies), never for an offer
that only direct pullers take unverified. On a CPU rank it is numpy sums over every byte (about
7 ms for a 32k-token export of the demo model on the 2-core CI machine: docs/performance.md), on a
GPU a kernel and a host sync, on the rank's loop between steps.

The replica's driver owns the block bookkeeping (its KVCacheManager; pins and reservations:
pins.py); a rank owns only the cache tensors and moves bytes between them and the wire
(rank_io.py): it exports the blocks the driver pinned and imports into the blocks the driver
reserved.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from meshserve.core.doorbell import Doorbell
from meshserve.core.secret import ClusterSecret
from meshserve.errors import check
from meshserve.kvstore.cache_tensors import LayerCache, block_tensors
from meshserve.kvstore.retention import RetentionPolicy
from meshserve.kvtransfer.cuda_ipc import local_gpus
from meshserve.kvtransfer.pins import HandoverBlocks
from meshserve.kvtransfer.rank_io import ImportTarget, KVRankIO, frame_bytes_for
from meshserve.kvtransfer.reshard import Layout, copy_tokens, pullers_of, sources_of, staging_caches, token_moves
from meshserve.kvtransfer.transfers import BackgroundPulls
from meshserve.kvtransfer.transport import AUTO, CUDA_IPC, NIXL, ZMQ, Endpoint, KVPuller, choose_transport, puller_for
from meshserve.kvtransfer.wire import KVTransferError
from meshserve.parallel.transform import kv_head_offset, local_kv_heads

log = logging.getLogger("meshserve.rank")

OFFER_TTL_S = 30.0  # an offer nobody pulls is dropped after this


@dataclass(frozen=True)
class RankCaches:
    """What a rank's KV agent needs of its worker: the cache tensors (one entry per layer, None
    for layers without a cache), the retention of each KV layer group, the replica's layout and
    the model's KV heads (None for caches without a head axis: MLA)."""

    caches: Sequence[LayerCache | None]
    retentions: tuple[RetentionPolicy, ...]
    tp: int
    dcp: int
    num_kv_heads: int | None


class KVRankAgent:
    """One rank's KV hand-overs (module docstring). host: this rank's address as its peers see
    it (the export server binds there; NIXL keeps to loopback when it is loopback). verify_checksum:
    direct offers carry the frames' checksum and this rank's direct pullers verify it
    (CacheConfig.kv_verify_checksum; zmq pulls verify it either way)."""

    def __init__(self, caches: RankCaches, *, rank: int, kv_transport: str, secret: ClusterSecret | None,
                 host: str = "127.0.0.1", verify_checksum: bool = False) -> None:  # fmt: skip
        self.caches, self.rank, self.kv_transport, self.secret, self.host = caches, rank, kv_transport, secret, host
        self.verify_checksum = verify_checksum
        self.server = None  # export_server.KVExportServer, made at the first offer
        self._io: KVRankIO | None = None
        self._pulls = BackgroundPulls()
        self._pullers: dict[str, KVPuller] = {}
        # hosts where a CUDA IPC open failed (zmq from then on), and fallback reasons logged already
        self._no_ipc_hosts: set[str] = set()
        self.nixl = None  # this rank's NixlAgent (its KV caches registered), made by start_nixl

    def start_nixl(self) -> None:
        """Register this rank's KV caches with a NIXL agent once, when the setting may use NIXL
        and a NIXL build imports (nixl_transport.py); else hand-overs use zmq."""
        from meshserve.kvtransfer.nixl_agent import NixlAgent, nixl_available

        caches = [c for c in self.caches.caches if c is not None]
        if self.kv_transport not in (AUTO, NIXL) or not nixl_available() or not caches:
            return
        try:
            agent = NixlAgent(host=self.host)
            agent.register(list({id(t): t for c in caches for t in block_tensors(c)}.values()))
        except Exception as exc:  # an agent that cannot start (no UCX transport): zmq it is
            log.warning("rank %d: NIXL unavailable, KV hand-overs use zmq: %s", self.rank, exc)
            return
        self.nixl = agent

    # -- serving pullers ------------------------------------------------------------------------
    @property
    def has_pending_exports(self) -> bool:
        return self.server is not None and self.server.num_pending > 0

    def poll(self, timeout_ms: int = 0) -> None:
        """Serve pulls from peers; the rank's loop calls this between messages."""
        if self.server is not None:
            self.server.poll(timeout_ms)

    def close(self) -> None:
        stopped = self._pulls.close()
        if not stopped:
            log.warning("rank %d: a KV pull did not stop within its bound at shutdown", self.rank)
        if self.server is not None:
            self.server.close()
            self.server = None
        for puller in self._pullers.values():  # their kept sockets (a puller of one's own may keep none)
            sockets = getattr(puller, "sockets", None)
            if sockets is not None:
                sockets.close()
        self._pullers.clear()
        if self.nixl is not None and stopped:  # nothing reads or is read now (else it is left to the process)
            self.nixl.close()
            self.nixl = None

    def _kv(self, block_size: int, dcp_size: int, model_id: str) -> KVRankIO:
        if self._io is None:
            self._io = KVRankIO(self.caches.caches, model_id=model_id, block_size=block_size, dcp_size=dcp_size,
                                retentions=self.caches.retentions)
        return self._io

    # -- exporting ------------------------------------------------------------------------------
    def offer(self, blocks: dict[str, Any], capability: str, block_size: int, dcp_size: int, model_id: str,
              dst_tp: int, dst_dcp: int = 1, fault: str | None = None) -> dict[str, str]:  # fmt: skip
        """Offer this rank's shard of a request's blocks (`HandoverBlocks.to_wire()`: tables and
        hashes per KV layer group, pinned by the driver until the decode side is done) to the
        decode ranks of (`dst_tp`, `dst_dcp`) that need it, under `capability` (the coordinator's
        unguessable token; one per puller when re-sharding: `pull_key`). Returns the endpoint
        (Endpoint.to_wire), from which the puller chooses the transport.

        fault (tests): "checksum" offers corrupted bytes (under the checksum of the cache's own
        bytes: a verifying pull refuses them), "withdraw" offers nothing.
        """
        from meshserve.kvtransfer.export_server import KVExportServer

        check(self.secret is not None, "rank", self.rank, "given the cluster secret before a KV hand-over")
        io = self._kv(block_size, dcp_size, model_id)
        if self.server is None:
            self.server = KVExportServer(self.secret, address=f"tcp://{self.host}", nixl=self.nixl)
        # the checksum now only where direct pullers verify it; a zmq pull has it computed when served
        export = io.export(HandoverBlocks.from_wire(blocks), max_frame_bytes=frame_bytes_for(io.device),
                           checksum=self.verify_checksum)
        tp, dcp = self.caches.tp, self.caches.dcp
        if (dst_tp, dst_dcp) == (tp, dcp):
            keys = [capability]  # decode rank r pulls from prefill rank r
        else:
            keys = [pull_key(capability, j) for j in pullers_of(self.rank, self.layout(tp, dcp),
                                                                self.layout(dst_tp, dst_dcp))]
        offered = export
        if fault == "checksum":
            frames = [f.clone() for f in export.frames]
            frames[0][0] ^= 0x5A  # a copy: the cache itself stays intact (and is not NIXL-registered)
            offered = export.with_frames(frames)  # its checksum (now or at a zmq pull) from the cache's bytes
        keys = keys if fault != "withdraw" else []
        for key in keys:  # the driver's pin keeps the blocks
            self.server.offer(offered, capability=key, ttl_s=OFFER_TTL_S)
        # what a NIXL READ or a CUDA IPC copy needs (direct_offer.py): no round trip before the bytes
        direct = self.server.describe_direct(offered, keys) if keys else b""
        return Endpoint.local(self.server.address, io.device, nixl=self.nixl is not None,
                              direct_offer=direct).to_wire()

    # -- importing ------------------------------------------------------------------------------
    def pull(self, capability: str, addresses: list, src_tp: int, blocks: list[list[int]], block_size: int,
             dcp_size: int, model_id: str, timeout_s: float = 5.0, src_dcp: int = 1,
             src_block_size: int | None = None, num_tokens: int = 0, src_positions: list[list[int]] | None = None,
             dst_positions: list[list[int]] | None = None,
             cancel: threading.Event | None = None) -> dict[str, Any]:  # fmt: skip
        """Pull this rank's share of the request's KV offered under `capability` from the prefill
        ranks (`addresses`: their endpoints, by rank) into `blocks` (reserved by the driver, per KV
        layer group, at table positions `dst_positions`); from another (tp, dcp) layout, re-sharded
        (reshard.py): the sender's tables held `src_positions` (logical blocks of `src_block_size`
        tokens) of `num_tokens` tokens.

        Returns {"ok": True, "bytes": cache bytes pulled, "transport": the one used} or {"ok":
        False, "reason": ..., "error": ...}; on failure the blocks hold garbage and the driver frees
        them without caching. cancel: stops the pull early (pull_cancel, shutdown).
        """
        io = self._kv(block_size, dcp_size, model_id)
        used: set[str] = set()
        try:
            if (src_tp, src_dcp) == (self.caches.tp, self.caches.dcp):
                target = io.into(blocks)
                used.add(self._pull_one(target, addresses[self.rank], capability, timeout_s, cancel))
                num_bytes = target.num_bytes
            else:
                sender = _Sender(src_tp, src_dcp, src_block_size or block_size, src_positions or [], num_tokens)
                num_bytes = self._pull_resharded(io, capability, addresses, sender, blocks, dst_positions or [],
                                                 timeout_s, cancel, used)
            return {"ok": True, "bytes": num_bytes, "transport": "+".join(sorted(used))}
        except KVTransferError as exc:
            return {"ok": False, "reason": exc.reason, "error": str(exc)}

    def pull_start(self, transfer_id: str, **pull: Any) -> bool:
        """Start `pull(**pull)` on a background thread; its result comes from pull_done."""
        self._kv(pull["block_size"], pull["dcp_size"], pull["model_id"])  # refuse a bad call here, not later
        self._pulls.start(transfer_id, lambda cancel: self.pull(**pull, cancel=cancel))
        return True

    def pull_done(self) -> dict[str, dict[str, Any]]:
        return self._pulls.take_done()

    @property
    def pulls_done(self) -> Doorbell:
        """Readable while pull_done has results: the rank's loop waits on it (transfers.py)."""
        return self._pulls.done_bell

    def pull_cancel(self, transfer_id: str) -> bool:
        self._pulls.cancel(transfer_id)
        return True

    def _pull_one(self, target: ImportTarget, endpoint: dict[str, Any] | str, capability: str, timeout_s: float,
                  cancel: threading.Event | None) -> str:  # fmt: skip
        """Pull one offer by the transport chosen for this pair of ends; returns its name."""
        theirs = Endpoint.from_wire(endpoint)
        requested = self.kv_transport
        mine = Endpoint.local("", self._io.device, nixl=self.nixl is not None)
        name, why = choose_transport(requested, mine, theirs,
                                     visible_gpus=local_gpus() if self._io.device.type == "cuda" else ())
        if name == CUDA_IPC and theirs.host in self._no_ipc_hosts:
            name, why = ZMQ, "a CUDA IPC open from that host failed before"
        if why and requested != "auto" and why not in self._no_ipc_hosts:  # logged once per reason
            self._no_ipc_hosts.add(why)
            log.info("rank %d: kv_transport %s falls back to zmq: %s", self.rank, requested, why)
        if name not in self._pullers:
            self._pullers[name] = puller_for(name, nixl_agent=self.nixl, verify=self.verify_checksum)
        try:
            used = self._pullers[name].pull(target, theirs, capability, secret=self.secret, timeout_s=timeout_s,
                                            cancel=cancel)
        except KVTransferError as exc:
            if exc.reason == "ipc":
                log.warning("rank %d: CUDA IPC from %s failed, zmq from now on: %s", self.rank, theirs.host, exc)
                self._no_ipc_hosts.add(theirs.host)
            raise
        return used or name

    def _pull_resharded(self, io: KVRankIO, capability: str, addresses: list, sender: _Sender,
                        blocks: list[list[int]], dst_positions: list[list[int]], timeout_s: float,
                        cancel: threading.Event | None, used: set[str]) -> int:  # fmt: skip
        """Pull every source `sources_of` names into a staging cache shaped like its shard (the
        sender's layout and blocks, in the sent order), then copy the tokens and heads we keep
        into our blocks, group by group. Returns the bytes pulled."""
        caches = self.caches.caches
        src, dst = self.layout(sender.tp, sender.dcp), self.layout(self.caches.tp, self.caches.dcp)
        check(len(dst_positions) == len(blocks) == len(sender.positions), "dst_positions", len(dst_positions),
              f"one list per KV layer group ({len(blocks)})")
        num_bytes = 0
        staged, first = [], 1  # staging blocks 1..n, in the sent order (group after group)
        for positions in sender.positions:
            staged.append(dict(zip(positions, range(first, first + len(positions)))))
            first += len(positions)
        ours = [dict(zip(p, b)) for p, b in zip(dst_positions, blocks)]
        layout, page = io.layout, _page_size(caches)
        heads_of = self.caches.num_kv_heads
        for piece in sources_of(self.rank, src, dst):
            heads = None if piece.src_heads is None else local_kv_heads(heads_of, src.tp, src.dcp)
            staging = staging_caches(caches, heads, first - 1)
            stage = KVRankIO(staging, model_id=layout.model_id, block_size=sender.block_size,
                             dcp_size=layout.dcp_size, retentions=io.retentions)
            target = stage.into([list(g.values()) for g in staged])
            used.add(self._pull_one(target, addresses[piece.src_rank], pull_key(capability, self.rank), timeout_s,
                                    cancel))
            num_bytes += target.num_bytes
            for src_blocks, dst_blocks in zip(staged, ours):
                moves = token_moves(sender.num_tokens, page, src_dcp=src.dcp, src_res=src.residue(piece.src_rank),
                                    src_blocks=src_blocks, dst_dcp=dst.dcp, dst_res=dst.residue(self.rank),
                                    dst_blocks=dst_blocks)
                copy_tokens(caches, staging, moves, piece)
        return num_bytes

    def layout(self, tp: int, dcp: int) -> Layout:
        """A pool's layout as reshard.py takes it: each rank's KV heads (parallel/transform.py)."""
        heads = self.caches.num_kv_heads
        if heads is None:
            return Layout(tp, dcp, None)
        n = local_kv_heads(heads, tp, dcp)
        return Layout(tp, dcp, tuple((o, o + n) for o in (kv_head_offset(heads, tp, dcp, r) for r in range(tp))))


@dataclass(frozen=True)
class _Sender:
    """The prefill side of a re-sharding pull: its layout, its (logical) block size, the table
    positions it held per KV layer group, and the request's token count."""

    tp: int
    dcp: int
    block_size: int
    positions: list[list[int]]
    num_tokens: int


def pull_key(capability: str, dst_rank: int) -> str:
    """The offer a re-sharding decode rank pulls (each prefill rank offers its shard once per puller)."""
    return f"{capability}>{dst_rank}"


def _page_size(caches) -> int:
    """Tokens per physical block of this rank's caches."""
    data = next(c.data for c in caches if c is not None)
    return data.shape[2] if data.dim() == 5 else data.shape[1]
