"""How step plans reach a replica's workers: the Executor protocol, what a rank is built from, errors.

An executor owns the ranks of one replica. Protocol (the only verbs a replica uses):
    start() -> WorkerInfo              start every rank concurrently (one rendezvous), rank 0's info
    execute_step(plan) -> StepOutput   one step on every rank; rank 0's sampled tokens
    call(method, args) -> results      an allow-listed rank method, one argument map per rank
    start_call(method, args) -> id     the same call, sent without waiting: what comes later (a
    finish_call(id) -> results         step, another call) runs after it on every rank; finish_call
                                       waits for its answers (or raises what call would have)
    check_health() -> list[dict]       per-rank health; raises WorkerDiedError for a dead rank
    shutdown()                         stop and release every rank (idempotent)
and, for replicas that import KV (decode replicas: ChannelExecutor, InProcessExecutor):
    take_kv_pulls() -> list[dict]      per rank, {transfer_id: result} of the background KV pulls
                                       (kv_pull_start) finished since the last call; never blocks
                                       and asks the ranks nothing (they push: channel.py PULLED)
    wait_kv_pulls(timeout_s, interrupt) -> bool
                                       block until a rank's pull finished (True), the Doorbell
                                       `interrupt` rings or timeout_s passes (False)

`ChannelExecutor` (channel_executor.py) is the one used across processes. Every message is
msgpack; a rank (rank.py) runs only the methods of `RANK_METHODS`. This module is below the
channel, the rank host and the executors, which all import it.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgpack

from meshserve.config import AttentionConfig, CacheConfig, ModelConfig, ParallelConfig
from meshserve.core.doorbell import Doorbell
from meshserve.errors import MeshserveError
from meshserve.workers.step import StepOutput, StepPlan
from meshserve.workers.worker import WorkerInfo

# What a driver may ask a rank to do (besides steps). Anything else is refused by the rank.
RANK_METHODS = frozenset({"rendezvous", "start", "check_health", "kv_offer", "kv_pull", "kv_pull_start",
                          "kv_pull_done", "kv_pull_cancel", "counters"})


def sum_expert_load(per_rank: Sequence[list[list[int]]]) -> list[list[int]]:
    """The replica's rows per expert and MoE layer: the sum of its ranks' Worker.expert_load()."""
    first = next((r for r in per_rank if r), [])
    return [[sum(r[layer][e] for r in per_rank if r) for e in range(len(row))] for layer, row in enumerate(first)]
DEFAULT_WORKER = "meshserve.workers.worker:Worker"


class WorkerDiedError(MeshserveError):
    """A rank of the replica is gone (process or actor died, loop crashed); the message says why."""


class WorkerHungError(WorkerDiedError):
    """A rank did not answer within its step's deadline (a hung GPU, a stopped process): the
    replica counts it dead. waited_s: how long the step had run when it was declared hung."""

    def __init__(self, message: str, *, waited_s: float) -> None:
        super().__init__(message)
        self.waited_s = waited_s


@dataclass(frozen=True)
class StepDeadline:
    """How long one step (or rank call) may take before its replica counts as hung:
    base_s + per_token_s x the step's tokens, generous so that a long prefill is never cut."""

    base_s: float = 60.0
    per_token_s: float = 0.005

    def seconds(self, num_tokens: int = 0) -> float:
        return self.base_s + self.per_token_s * num_tokens


class RankError(MeshserveError):
    """A rank raised while handling a message; the message carries the rank and the error."""


class Executor(Protocol):
    def start(self) -> WorkerInfo: ...

    def execute_step(self, plan: StepPlan) -> StepOutput: ...

    def call(self, method: str, args: Sequence[dict[str, Any]]) -> list[Any]: ...

    def start_call(self, method: str, args: Sequence[dict[str, Any]]) -> int: ...

    def finish_call(self, call_id: int) -> list[Any]: ...

    def check_health(self) -> list[dict[str, Any]]: ...

    def shutdown(self) -> None: ...


class KVImportingExecutor(Executor, Protocol):
    """The executor of a replica whose ranks pull KV (the module docstring's last two verbs)."""

    def take_kv_pulls(self) -> list[dict[str, Any]]: ...

    def wait_kv_pulls(self, timeout_s: float, interrupt: Doorbell | None = None) -> bool: ...


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
    return WorkerInfo(**{**d, "eos_token_ids": tuple(d["eos_token_ids"]), "kv_groups": groups,
                         "decoder_prompt": tuple(d.get("decoder_prompt", ()))})


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (a rendezvous binds it a moment later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
