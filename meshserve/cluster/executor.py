"""How step plans reach a replica's workers: the Executor protocol and its channel implementation.

An executor owns the ranks of one replica. Protocol (the only verbs a replica uses):
    start() -> WorkerInfo              start every rank concurrently (one rendezvous), rank 0's info
    execute_step(plan) -> StepOutput   one step on every rank; rank 0's sampled tokens
    call(method, args) -> results      an allow-listed rank method, one argument map per rank
    check_health() -> list[dict]       per-rank health; raises WorkerDiedError for a dead rank
    shutdown()                         stop and release every rank (idempotent)

`ChannelExecutor` is the one used across processes: steps travel over a persistent zmq channel
(channel.py), never as one remote call per rank per step; a `RankGroup` launches and watches
the ranks (threads here, subprocesses in multiproc.py, Ray actors in ray_executor.py). Every
message is msgpack; a rank runs only the methods of `RANK_METHODS`.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgpack

from meshserve.config import AttentionConfig, CacheConfig, ModelConfig, ParallelConfig
from meshserve.errors import MeshserveError
from meshserve.workers.step import StepOutput, StepPlan
from meshserve.workers.worker import WorkerInfo

log = logging.getLogger("meshserve.executor")

# What a driver may ask a rank to do (besides steps). Anything else is refused by the rank.
RANK_METHODS = frozenset({"rendezvous", "start", "check_health", "kv_offer", "kv_pull"})
DEFAULT_WORKER = "meshserve.workers.worker:Worker"


class WorkerDiedError(MeshserveError):
    """A rank of the replica is gone (process or actor died, loop crashed); the message says why."""


class RankError(MeshserveError):
    """A rank raised while handling a message; the message carries the rank and the error."""


class Executor(Protocol):
    def start(self) -> WorkerInfo: ...

    def execute_step(self, plan: StepPlan) -> StepOutput: ...

    def call(self, method: str, args: Sequence[dict[str, Any]]) -> list[Any]: ...

    def check_health(self) -> list[dict[str, Any]]: ...

    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to build its worker; travels as msgpack.

    worker_class: "module:Class" of the worker (the plain Worker; tests and benchmarks swap in
    stand-ins with the same constructor and protocol).
    """

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: str | None = None
    worker_class: str = DEFAULT_WORKER

    def to_msgpack(self) -> bytes:
        return msgpack.packb({
            "model": dataclasses.asdict(self.model), "cache": dataclasses.asdict(self.cache),
            "attention": dataclasses.asdict(self.attention), "parallel": dataclasses.asdict(self.parallel),
            "device": self.device, "worker_class": self.worker_class,
        })

    @classmethod
    def from_msgpack(cls, data: bytes) -> WorkerSpec:
        d = msgpack.unpackb(data)
        return cls(ModelConfig(**d["model"]), CacheConfig(**d["cache"]), AttentionConfig(**d["attention"]),
                   ParallelConfig(**d["parallel"]), d["device"], d["worker_class"])


def info_from_dict(d: dict[str, Any]) -> WorkerInfo:
    groups = tuple((w, s) for w, s in d.get("kv_groups", ()))
    return WorkerInfo(**{**d, "eos_token_ids": tuple(d["eos_token_ids"]), "kv_groups": groups})


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (a rendezvous binds it a moment later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RankGroup(Protocol):
    """Launches the ranks of one replica and watches them.

    driver_host: the address ranks can reach the driver at (the channel binds there).
    launch(address): start every rank's loop, connecting to the channel at `address`.
    check(): raise WorkerDiedError naming the rank and the cause if a rank is gone.
    stop(): end every rank (after the channel said stop, or forcibly).
    """

    world: int
    driver_host: str

    def launch(self, address: str) -> None: ...

    def check(self) -> None: ...

    def stop(self) -> None: ...


class ChannelExecutor:
    """An Executor whose ranks serve a DriverChannel; `ranks` decides where they run."""

    def __init__(self, ranks: RankGroup, *, name: str = "replica", start_timeout_s: float = 600.0) -> None:
        self.ranks = ranks
        self.name = name
        self.start_timeout_s = start_timeout_s
        self.channel = None
        self.info: WorkerInfo | None = None

    def start(self) -> WorkerInfo:
        from meshserve.cluster.channel import DriverChannel

        self.channel = DriverChannel(self.ranks.world, host=self.ranks.driver_host)
        self.ranks.launch(self.channel.address)
        self.channel.wait_ready(self.ranks.check, timeout_s=self.start_timeout_s)
        # Rank 0's host picks the torch.distributed rendezvous; all ranks start at once with it.
        init_method = self.channel.call("rendezvous", [{}] * self.ranks.world, self.ranks.check)[0]
        infos = self.channel.call("start", [{"init_method": init_method}] * self.ranks.world, self.ranks.check)
        self.info = info_from_dict(infos[0])
        log.info("%s: %d rank(s) started, %d KV blocks", self.name, self.ranks.world, self.info.num_kv_blocks)
        return self.info

    def execute_step(self, plan: StepPlan) -> StepOutput:
        return StepOutput.from_msgpack(self.channel.step(plan.to_msgpack(), self.ranks.check))

    def call(self, method: str, args: Sequence[dict[str, Any]]) -> list[Any]:
        return self.channel.call(method, args, self.ranks.check)

    def check_health(self) -> list[dict[str, Any]]:
        self.ranks.check()
        return [{"rank": r, "alive": True} for r in range(self.ranks.world)]

    def shutdown(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        self.ranks.stop()


class ThreadRanks:
    """A tp=1 replica whose rank loop runs on a thread of this process (no Ray, no subprocess).

    The step still crosses the zmq channel, so tests exercise the path remote ranks use.
    """

    world = 1
    driver_host = "127.0.0.1"

    def __init__(self, spec: WorkerSpec) -> None:
        from meshserve.errors import check

        check(spec.parallel.tp == 1, "tp", spec.parallel.tp, "1 for ranks on threads (use processes or Ray)")
        self.spec = spec
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def launch(self, address: str) -> None:
        from meshserve.cluster.channel import serve_rank
        from meshserve.cluster.rank import RankHost

        host = RankHost(self.spec, rank=0)

        def run() -> None:
            try:
                serve_rank(host, address, rank=0)
            except BaseException as exc:  # the driver learns it from check()
                self._error = exc

        self._thread = threading.Thread(target=run, name="meshserve-rank-0", daemon=True)
        self._thread.start()

    def check(self) -> None:
        if self._thread is not None and not self._thread.is_alive():
            raise WorkerDiedError(f"rank 0 thread ended: {self._error!r}")

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
