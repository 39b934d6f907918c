"""The rank side of a channel: one Worker plus its share of KV hand-overs.

`RankHost` answers the allow-listed methods (executor.RANK_METHODS) with msgpack-able values:
    rendezvous()                    "file://<private dir>/store" on this node (asked of rank 0)
    start(init_method)              WorkerInfo as a dict
    check_health()                  the worker's health dict
    expert_load()                   rows routed to each expert per MoE layer (Worker.expert_load)
    kv_offer(...)                   offer a request's blocks to pullers under the coordinator's
                                    capability; returns the export endpoint (kvtransfer/transport.py)
    kv_pull(...)                    pull a request's blocks (by capability) from the prefill ranks
                                    into given blocks
                                    (re-sharding when the pools' (tp, dcp) differ: kvtransfer/reshard.py)
    kv_pull_start(transfer_id, ...) the same pull on a background thread (kvtransfer/transfers.py):
                                    returns at once; the rank keeps running steps meanwhile
    kv_pull_done()                  {transfer_id: kv_pull's result} of the pulls finished since
    kv_pull_cancel(transfer_id)     stop a pull early (its result then comes as a failure)

The transport of each pull is chosen here, per hand-over, from the configured `kv_transport`
and what the two ends share (kvtransfer/transport.py: cuda_ipc within a host, else zmq).

The replica's driver owns the block bookkeeping (its KVCacheManager; pins and reservations:
kvtransfer/pins.py); a rank owns only the cache tensors and moves bytes between them and the wire
(kvtransfer/rank_io.py): it exports the blocks the driver pinned and imports into the blocks the
driver reserved.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import threading
from dataclasses import asdict
from typing import Any

from meshserve.attention.backend import KVCache
from meshserve.cluster.executors.executor import RANK_METHODS, WorkerSpec
from meshserve.errors import check
from meshserve.kvstore.cache_tensors import block_tensors
from meshserve.kvtransfer.cuda_ipc import local_gpus
from meshserve.kvtransfer.pins import HandoverBlocks
from meshserve.kvtransfer.rank_io import ImportTarget, KVExport, KVRankIO, frame_bytes_for
from meshserve.kvtransfer.reshard import Layout, copy_tokens, pullers_of, sources_of, staging_caches, token_moves
from meshserve.kvtransfer.transfers import BackgroundPulls
from meshserve.kvtransfer.transport import AUTO, CUDA_IPC, NIXL, ZMQ, Endpoint, KVPuller, choose_transport, puller_for
from meshserve.kvtransfer.wire import KVTransferError
from meshserve.parallel.groups import local_rendezvous, remove_rendezvous
from meshserve.parallel.transform import kv_head_offset, local_kv_heads
from meshserve.workers.checkpoint import read_arch

log = logging.getLogger("meshserve.rank")

OFFER_TTL_S = 30.0  # an offer nobody pulls is dropped after this


class RankHost:
    """Builds the worker on `start` and answers the driver's messages for one rank."""

    def __init__(self, spec: WorkerSpec, *, rank: int) -> None:
        self.spec = spec
        self.rank = rank
        self.secret = None  # the cluster's ClusterSecret, set by serve_rank from the start-up config
        self.worker = None
        self._io: KVRankIO | None = None
        self._server = None
        self._pulls = BackgroundPulls()
        self._pullers: dict[str, KVPuller] = {}
        # hosts where a CUDA IPC open failed (zmq from then on), and fallback reasons logged already
        self._no_ipc_hosts: set[str] = set()
        self._nixl = None  # this rank's NixlAgent (its KV caches registered), made at start
        self._rendezvous = ""  # the FileStore rendezvous this rank made (rank 0), removed at shutdown

    # -- dispatch -------------------------------------------------------------------------------
    def execute_step(self, plan: bytes) -> bytes:
        check(self.worker is not None, "rank", self.rank, "started before its first step")
        return self.worker.execute_step(plan)

    def call(self, method: str, args: dict[str, Any]) -> Any:
        check(method in RANK_METHODS, "method", method, f"one of {sorted(RANK_METHODS)}")
        return getattr(self, method)(**args)

    # -- lifecycle ------------------------------------------------------------------------------
    def rendezvous(self) -> str:
        """The replica's torch.distributed rendezvous: a FileStore on this node (a replica's ranks
        share a node), so nothing listens for it (parallel/groups.local_rendezvous)."""
        self._rendezvous = local_rendezvous()
        return self._rendezvous

    def start(self, init_method: str | None = None) -> dict[str, Any]:
        module, _, name = self.spec.worker_class.partition(":")
        worker_cls = getattr(importlib.import_module(module), name)
        s = self.spec
        tp = s.parallel.tp
        if tp > 1 and _is_loopback(_reachable_host()):
            # gloo's and NCCL's own connections between the ranks: on loopback, like everything else
            for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                os.environ.setdefault(name, "lo")
        self.worker = worker_cls(s.model, s.cache, s.attention, s.parallel, rank=self.rank, device=s.device,
                                 progress=False, init_method=init_method if tp > 1 else None)
        info = asdict(self.worker.start())
        self._start_nixl()
        return info

    def _start_nixl(self) -> None:
        """Register this rank's KV caches with a NIXL agent once, when the setting may use NIXL
        and a NIXL build imports (kvtransfer/nixl_transport.py); else hand-overs use zmq."""
        from meshserve.kvtransfer.nixl_transport import NixlAgent, nixl_available

        runner = getattr(self.worker, "runner", None)
        if self.spec.cache.kv_transport not in (AUTO, NIXL) or not nixl_available() or runner is None:
            return
        caches = [c for c in runner.kv_caches if c is not None]
        if not caches:
            return
        try:
            agent = NixlAgent(host=_reachable_host())
            agent.register(list({id(t): t for c in caches for t in block_tensors(c)}.values()))
        except Exception as exc:  # an agent that cannot start (no UCX transport): zmq it is
            log.warning("rank %d: NIXL unavailable, KV hand-overs use zmq: %s", self.rank, exc)
            return
        self._nixl = agent

    def check_health(self) -> dict[str, Any]:
        return {} if self.worker is None else self.worker.check_health()

    def expert_load(self) -> list[list[int]]:
        return [] if self.worker is None else self.worker.expert_load()

    def shutdown(self) -> None:
        if not self._pulls.close():
            log.warning("rank %d: a KV pull did not stop within its bound at shutdown", self.rank)
        if self._server is not None:
            self._server.close()
            self._server = None
        for puller in self._pullers.values():  # their kept sockets (a puller of one's own may keep none)
            sockets = getattr(puller, "sockets", None)
            if sockets is not None:
                sockets.close()
        self._pullers.clear()
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
        if self._rendezvous:
            remove_rendezvous(self._rendezvous)
            self._rendezvous = ""

    # -- KV hand-over ---------------------------------------------------------------------------
    @property
    def has_pending_exports(self) -> bool:
        return self._server is not None and self._server.num_pending > 0

    def poll_exports(self, timeout_ms: int = 0) -> None:
        """Serve pulls from peers; the channel loop calls this between messages."""
        if self._server is not None:
            self._server.poll(timeout_ms)

    def _kv(self, block_size: int, dcp_size: int, model_id: str) -> KVRankIO:
        if self._io is None:
            check(self.worker is not None and self.worker.runner is not None, "rank", self.rank,
                  "started before a KV hand-over")
            self._io = KVRankIO(self.worker.runner.kv_caches, model_id=model_id, block_size=block_size,
                                dcp_size=dcp_size, retentions=self.worker.kv_layout.retentions)
        return self._io

    def kv_offer(self, blocks: dict[str, Any], capability: str, block_size: int, dcp_size: int, model_id: str,
                 dst_tp: int, dst_dcp: int = 1, fault: str | None = None) -> dict[str, str]:  # fmt: skip
        """Offer this rank's shard of a request's blocks (`HandoverBlocks.to_wire()`: tables and
        hashes per KV layer group, pinned by the driver until the decode side is done) to the
        decode ranks of (`dst_tp`, `dst_dcp`) that need it, under `capability` (the coordinator's
        unguessable token; one per puller when re-sharding: `pull_key`). Returns the endpoint
        (Endpoint.to_wire: address, host, device, process), from which the puller chooses the
        transport. The export server binds this node's IP (where the peers are), never 0.0.0.0.

        fault (tests): "checksum" offers corrupted bytes, "withdraw" offers nothing.
        """
        from meshserve.kvtransfer.zmq_transport import KVExportServer

        check(self.secret is not None, "rank", self.rank, "given the cluster secret before a KV hand-over")
        io = self._kv(block_size, dcp_size, model_id)
        if self._server is None:
            self._server = KVExportServer(self.secret, address=f"tcp://{_reachable_host()}", nixl=self._nixl)
        export = io.export(HandoverBlocks.from_wire(blocks), max_frame_bytes=frame_bytes_for(io.device))
        if (dst_tp, dst_dcp) == (self.tp, self.dcp):
            keys = [capability]  # decode rank r pulls from prefill rank r
        else:
            src, dst = self._layout(self.tp, self.dcp), self._layout(dst_tp, dst_dcp)
            keys = [pull_key(capability, j) for j in pullers_of(self.rank, src, dst)]
        frames = export.frames
        if fault == "checksum":
            frames = [f.clone() for f in frames]
            frames[0][0] ^= 0x5A  # a copy: the cache itself stays intact
        for key in keys if fault != "withdraw" else []:  # the driver's pin keeps the blocks
            self._server.offer(KVExport(export.header, frames), capability=key, ttl_s=OFFER_TTL_S)
        return Endpoint.local(self._server.address, io.device, nixl=self._nixl is not None).to_wire()

    def kv_pull(self, capability: str, addresses: list[str], src_tp: int, blocks: list[list[int]], block_size: int,
                dcp_size: int, model_id: str, timeout_s: float = 5.0, src_dcp: int = 1,
                src_block_size: int | None = None, num_tokens: int = 0, src_positions: list[list[int]] | None = None,
                dst_positions: list[list[int]] | None = None,
                cancel: threading.Event | None = None) -> dict[str, Any]:  # fmt: skip
        """Pull this rank's share of the request's KV offered under `capability` from the prefill
        ranks (`addresses`: their endpoints, by rank) into `blocks` (reserved by the driver, per KV
        layer group, at table positions `dst_positions`); from another (tp, dcp) layout, re-sharded
        (kvtransfer/reshard.py): the sender's tables held `src_positions` (logical blocks of
        `src_block_size` tokens) of `num_tokens` tokens.

        Returns {"ok": True, "bytes": cache bytes pulled, "transport": the one used} or {"ok":
        False, "reason": ..., "error": ...}; on failure the blocks hold garbage and the driver frees
        them without caching. cancel: stops the pull early (kv_pull_cancel, shutdown).
        """
        io = self._kv(block_size, dcp_size, model_id)
        used: set[str] = set()
        try:
            if (src_tp, src_dcp) == (self.tp, self.dcp):
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

    def kv_pull_start(self, transfer_id: str, **pull: Any) -> bool:
        """Start `kv_pull(**pull)` on a background thread; its result comes from kv_pull_done."""
        self._kv(pull["block_size"], pull["dcp_size"], pull["model_id"])  # refuse a bad call here, not later
        self._pulls.start(transfer_id, lambda cancel: self.kv_pull(**pull, cancel=cancel))
        return True

    def kv_pull_done(self) -> dict[str, dict[str, Any]]:
        return self._pulls.take_done()

    def kv_pull_cancel(self, transfer_id: str) -> bool:
        self._pulls.cancel(transfer_id)
        return True

    def _pull_one(self, target: ImportTarget, endpoint: dict[str, Any] | str, capability: str, timeout_s: float,
                  cancel: threading.Event | None) -> str:  # fmt: skip
        """Pull one offer by the transport chosen for this pair of ends; returns its name."""
        theirs = Endpoint.from_wire(endpoint)
        requested = self.spec.cache.kv_transport
        mine = Endpoint.local("", self._io.device, nixl=self._nixl is not None)
        name, why = choose_transport(requested, mine, theirs,
                                     visible_gpus=local_gpus() if self._io.device.type == "cuda" else ())
        if name == CUDA_IPC and theirs.host in self._no_ipc_hosts:
            name, why = ZMQ, "a CUDA IPC open from that host failed before"
        if why and requested != "auto" and why not in self._no_ipc_hosts:  # logged once per reason
            self._no_ipc_hosts.add(why)
            log.info("rank %d: kv_transport %s falls back to zmq: %s", self.rank, requested, why)
        if name not in self._pullers:
            self._pullers[name] = puller_for(name, nixl_agent=self._nixl)
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
        caches = self.worker.runner.kv_caches
        src, dst = self._layout(sender.tp, sender.dcp), self._layout(self.tp, self.dcp)
        check(len(dst_positions) == len(blocks) == len(sender.positions), "dst_positions", len(dst_positions),
              f"one list per KV layer group ({len(blocks)})")
        num_bytes = 0
        staged, first = [], 1  # staging blocks 1..n, in the sent order (group after group)
        for positions in sender.positions:
            staged.append(dict(zip(positions, range(first, first + len(positions)))))
            first += len(positions)
        ours = [dict(zip(p, b)) for p, b in zip(dst_positions, blocks)]
        layout, page = io.layout, _page_size(caches)
        for piece in sources_of(self.rank, src, dst):
            heads = None if piece.src_heads is None else local_kv_heads(self._num_kv_heads(), src.tp, src.dcp)
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

    def _layout(self, tp: int, dcp: int) -> Layout:
        """A pool's layout as kvtransfer/reshard.py takes it: each rank's KV heads (parallel/transform.py)."""
        heads = self._num_kv_heads()
        if heads is None:
            return Layout(tp, dcp, None)
        n = local_kv_heads(heads, tp, dcp)
        return Layout(tp, dcp, tuple((o, o + n) for o in (kv_head_offset(heads, tp, dcp, r) for r in range(tp))))

    @property
    def dcp(self) -> int:
        return self.worker.parallel.dcp

    @property
    def tp(self) -> int:
        return self.worker.parallel.tp

    def _num_kv_heads(self) -> int | None:
        """The model's KV heads (None for caches without a head axis)."""
        if not any(isinstance(c, KVCache) for c in self.worker.runner.kv_caches if c is not None):
            return None  # latent (MLA) caches
        return read_arch(self.worker.model_config.model).num_kv_heads


@dataclasses.dataclass(frozen=True)
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


def _is_loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("localhost", "::1")


def _reachable_host() -> str:
    """This host's address as peers see it: Ray's node IP when inside Ray, else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"
