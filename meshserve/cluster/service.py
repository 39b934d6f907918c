"""The serving protocol: what the API layer (gRPC, HTTP, Python embedding) calls on the cluster.

`Coordinator` (replica pools, unified or disaggregated; the default `serve` and `LLM.stream` are
its one-replica in-process case) implements it for generative models; `EmbeddingService` for
embedding models. Front-ends call only these methods; the method names and their semantics are
stable (new methods may be added).

Conventions (Ray LLM style): bad input raises ConfigError before anything is queued (nothing
is left behind); capacity and admission refusals raise CapacityError / QueueFullError; no
healthy replica raises UnavailableError; a replica dying under a request ends its stream with
ReplicaFailedError. Every other outcome arrives as deltas: the last one has finished=True and
a finish_reason (stop, length, abort). Leaving a stream early aborts the request and frees its
KV blocks at once.

A service serves one task per model (ModelCard.task): `generate` on an embedding model and
`embed` on a generative one raise ConfigError naming the model's task (INVALID_ARGUMENT).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from meshserve.cluster.handover_stats import HandoverRow
from meshserve.core.beam_params import BeamSearchParams
from meshserve.core.outputs import CompletionDelta
from meshserve.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from meshserve.workers.embedder import EmbeddingOutput


@dataclass(frozen=True)
class ModelCard:
    name: str
    max_model_len: int
    vocab_size: int
    task: str = "generate"  # "generate" or "embed"


@dataclass(frozen=True)
class ServiceHealth:
    serving: bool  # at least one healthy replica in every pool a request needs
    healthy_replicas: int
    total_replicas: int
    detail: str = ""
    # Seconds since the service last served (0 while it does); None: it has not served yet (starting).
    unserving_s: float | None = 0.0
    # Seconds since every replica was last healthy (0 while all are); None: never yet.
    degraded_s: float | None = 0.0
    num_rebuilds: int = 0  # replicas rebuilt after a failure, since start
    num_rebuild_failures: int = 0  # rebuild attempts that failed, since start


@dataclass(frozen=True)
class GrammarCompileRow:
    """One replica's grammar compiles (its driver rank's, workers/grammar.py), or those of the
    replicas a pool replaced ('<pool>-retired': counters only). num_stuck: written off past
    grammar_compile_timeout_s and still running (xgrammar cannot stop them); num_written_off and
    num_refused (refused at once: MAX_STUCK_COMPILES running, or the same grammar still stuck)
    since the replica started."""

    pool: str
    replica: str
    num_stuck: int = 0
    num_written_off: int = 0
    num_refused: int = 0


@dataclass(frozen=True)
class ServiceStats:
    """A snapshot for metrics; counters are totals since start."""

    num_waiting: int
    num_running: int
    kv_usage: float  # fraction of KV blocks in use, over all replicas
    num_free_kv_blocks: int
    prefix_hit_tokens: int
    prompt_tokens: int
    num_preemptions: int
    generated_tokens: int
    # MoE models: rows routed to each expert since start, [MoE layer][expert] (load balance).
    expert_tokens: list[list[int]] = field(default_factory=list)
    # Disaggregated pools: each replica's KV hand-overs (live ones, and '<pool>-retired' for the
    # replicas a pool replaced), and the KV transport between the pools ("" when unified).
    handovers: list[HandoverRow] = field(default_factory=list)
    kv_transport: str = ""
    # Faults (cluster/migration.py): requests moved on from a failed replica, those refused at
    # --max-migrations, replicas declared hung, and the seconds their hung steps ran until then.
    num_migrations: int = 0
    num_migrations_refused: int = 0
    num_hung_replicas: int = 0
    hung_detection_s: float = 0.0
    # Every replica's grammar compiles (one row each, and one per pool for its replaced replicas).
    grammar_compiles: list[GrammarCompileRow] = field(default_factory=list)


class InferenceService(Protocol):
    def models(self) -> list[ModelCard]: ...

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, token_ids: Sequence[int]) -> str: ...

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None, *, request_id: str,
                 beam: BeamSearchParams | None = None, caller: str = "",
                 priority: int = 0) -> AsyncIterator[CompletionDelta]:
        """Deltas until the finished one; n > 1 and beam search carry each completion's index.
        beam: search instead of sampling (params None). caller: who sent it (the front-end's
        identity of the client: fair queueing and per-caller limits); priority: lower first."""
        ...

    async def abort(self, request_id: str) -> bool: ...

    async def embed(self, inputs: Sequence[str | Sequence[int]], *, truncate: bool = False) -> list[EmbeddingOutput]:
        """One pooled vector per input (text or token ids); all validated before any runs."""
        ...

    def health(self) -> ServiceHealth: ...

    def stats(self) -> ServiceStats: ...

    async def shutdown(self, *, drain: bool = True) -> None: ...
