"""The rank side of a channel: one Worker plus its share of KV hand-overs.

`RankHost` answers the allow-listed methods (executor.RANK_METHODS) with msgpack-able values:
    rendezvous()                    "file://<private dir>/store" on this node (asked of rank 0)
    start(init_method)              WorkerInfo as a dict
    check_health()                  the worker's health dict
    counters(reset=False)           Worker.counters: rows routed to each expert per MoE layer
                                    (expert_load) and the driver's grammar compile counts (grammar;
                                    zeros on other ranks), in one round trip; reset: then zero the
                                    expert counts
    kv_offer(...)                   offer a request's blocks to pullers under the coordinator's
                                    capability; returns the export endpoint (kvtransfer/transport.py)
    kv_pull(...)                    pull a request's blocks (by capability) from the prefill ranks
                                    into given blocks (re-sharding when the pools' (tp, dcp) differ)
    kv_pull_start(transfer_id, ...) the same pull on a background thread: returns at once; the
                                    rank keeps running steps meanwhile
    kv_pull_done()                  {transfer_id: kv_pull's result} of the pulls finished since
                                    (the channel loop pushes them to the driver unasked as soon as
                                    they finish: `pulls_done`, channel.py)
    kv_pull_cancel(transfer_id)     stop a pull early (its result then comes as a failure)

The kv_* methods are the rank's KV agent's (kvtransfer/rank_agent.py KVRankAgent: export server,
pullers, background pulls, NIXL agent), made when the worker has started.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import asdict
from typing import Any

from meshserve.attention.backend import KVCache
from meshserve.cluster.executors.executor import RANK_METHODS, WorkerSpec
from meshserve.core import hop_trace
from meshserve.core.doorbell import Doorbell
from meshserve.errors import check
from meshserve.kvtransfer.rank_agent import KVRankAgent, RankCaches
from meshserve.parallel.groups import local_rendezvous, remove_rendezvous
from meshserve.workers.checkpoint import read_arch
from meshserve.workers.step import StepPlan

log = logging.getLogger("meshserve.rank")


class RankHost:
    """Builds the worker on `start` and answers the driver's messages for one rank."""

    def __init__(self, spec: WorkerSpec, *, rank: int) -> None:
        self.spec = spec
        self.rank = rank
        self.secret = None  # the cluster's ClusterSecret, set by serve_rank from the start-up config
        self.worker = None
        self._kv_agent: KVRankAgent | None = None
        self._rendezvous = ""  # the FileStore rendezvous this rank made (rank 0), removed at shutdown

    # -- dispatch -------------------------------------------------------------------------------
    def execute_step(self, plan: bytes) -> bytes:
        check(self.worker is not None, "rank", self.rank, "started before its first step")
        hop_trace.mark("rank.step_begin")
        out = self.worker.execute_step(plan)
        hop_trace.mark("rank.step_end")
        return out

    def submit_step(self, plan: bytes) -> None:
        """Start a step (overlap scheduling, channel.py SUBMIT); `collect_step` returns its output."""
        check(self.worker is not None, "rank", self.rank, "started before its first step")
        hop_trace.mark("rank.step_begin")
        self.worker.submit(StepPlan.from_msgpack(plan))
        hop_trace.mark("rank.step_end")

    def step_ready(self) -> bool:
        """Whether the oldest submitted step can be collected without waiting for the device."""
        return self.worker.step_ready()

    def collect_step(self) -> bytes:
        """The oldest submitted step's msgpack StepOutput (waits for its draw to reach the host)."""
        return self.worker.collect().to_msgpack()

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
        if getattr(self.worker, "runner", None) is not None:  # each rank registers its caches once, now
            self.kv.start_nixl()
        return info

    def check_health(self) -> dict[str, Any]:
        return {} if self.worker is None else self.worker.check_health()

    def counters(self, reset: bool = False) -> dict[str, Any]:
        return {"expert_load": [], "grammar": {}} if self.worker is None else self.worker.counters(reset=reset)

    def shutdown(self) -> None:
        if self._rendezvous:  # first: a rank process may be killed while its worker shuts down
            remove_rendezvous(self._rendezvous)
            self._rendezvous = ""
        if self._kv_agent is not None:
            self._kv_agent.close()
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None

    # -- KV hand-over ---------------------------------------------------------------------------
    @property
    def kv(self) -> KVRankAgent:
        """This rank's KV agent (made at the first use, once the worker has started)."""
        if self._kv_agent is None:
            w = self.worker
            check(w is not None and w.runner is not None, "rank", self.rank, "started before a KV hand-over")
            caches = RankCaches(w.runner.kv_caches, tuple(w.kv_layout.retentions), w.parallel.tp, w.parallel.dcp,
                                self._num_kv_heads())
            transport = self.spec.cache.kv_transport if self.spec is not None else "zmq"
            verify = self.spec.cache.kv_verify_checksum if self.spec is not None else False
            self._kv_agent = KVRankAgent(caches, rank=self.rank, kv_transport=transport, secret=self.secret,
                                         host=_reachable_host(), verify_checksum=verify)
        self._kv_agent.secret = self.secret  # given by serve_rank (a test may set it late)
        return self._kv_agent

    @property
    def has_pending_exports(self) -> bool:
        return self._kv_agent is not None and self._kv_agent.has_pending_exports

    @property
    def pulls_done(self) -> Doorbell | None:
        """Rung when a background pull finished (None before this rank's KV agent exists)."""
        return None if self._kv_agent is None else self._kv_agent.pulls_done

    def poll_exports(self, timeout_ms: int = 0) -> None:
        """Serve pulls from peers; the channel loop calls this between messages."""
        if self._kv_agent is not None:
            self._kv_agent.poll(timeout_ms)

    def kv_offer(self, **offer: Any) -> dict[str, str]:
        hop_trace.mark("rank.offer_begin")
        endpoint = self.kv.offer(**offer)
        hop_trace.mark("rank.offer_end")
        return endpoint

    def kv_pull(self, **pull: Any) -> dict[str, Any]:
        return self.kv.pull(**pull)

    def kv_pull_start(self, transfer_id: str, **pull: Any) -> bool:
        hop_trace.mark("rank.pull_start")
        return self.kv.pull_start(transfer_id, **pull)

    def kv_pull_done(self) -> dict[str, dict[str, Any]]:
        return self.kv.pull_done()

    def kv_pull_cancel(self, transfer_id: str) -> bool:
        return self.kv.pull_cancel(transfer_id)

    def _num_kv_heads(self) -> int | None:
        """The model's KV heads (None for caches without a head axis)."""
        if not any(isinstance(c, KVCache) for c in self.worker.runner.kv_caches if c is not None):
            return None  # latent (MLA) caches
        return read_arch(self.worker.model_config.model).num_kv_heads


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
