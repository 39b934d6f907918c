"""The coordinator: pools of replicas behind the InferenceService protocol (cluster/service.py).

    coord = Coordinator(ClusterConfig(engine=EngineConfig(model=ModelConfig(model=DIR)),
                                      pools=PoolConfig(mode="disaggregated")))
    await coord.start()                      # Ray (embedded or ray_address), replicas loaded
    async for delta in coord.generate("Hello", SamplingParams(max_tokens=32), request_id="r1"):
        ...
    await coord.shutdown(drain=True)

One serving stack: `meshserve serve` with no flags, and `LLM.stream`, run one unified replica with
its ranks in this process (runtime "in-process"); Ray, subprocesses and threads only move the ranks.

Unified mode: one pool; any replica runs a request from prompt to end. Disaggregated: a new
request goes to the prefill pool (longest cached prefix, then least load) and runs until its
first token (n / best_of > 1 and beam search: to its end); the decode pool (most free KV, then
least load) takes it over with its KV (or recomputes). The client sees one stream either way.

Errors: ConfigError for bad input (nothing queued; admission.py), CapacityError when prompt +
max_tokens can never fit a replica's KV cache, QueueFullError when the entry pool's queue is full,
UnavailableError when no replica can take it, ReplicaFailedError (raised by the stream) when the
replica serving it fails and the request cannot move on (migration.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Protocol

from meshserve.cluster.executors.executor import StepDeadline, sum_expert_load
from meshserve.cluster.fair_queue import CallerLedger, queue_key
from meshserve.cluster.handover import Handoff, release_sources
from meshserve.cluster.handover_stats import HandoverRow
from meshserve.cluster.logs import configure_logging, request_event
from meshserve.cluster.pools import ReplicaPool
from meshserve.cluster.replica import Replica
from meshserve.cluster.service import GrammarCompileRow, ModelCard, ServiceHealth, ServiceStats
from meshserve.config import ParallelConfig, PoolConfig, PoolMode
from meshserve.core import hop_trace
from meshserve.core.beam_params import BeamSearchParams
from meshserve.core.checkpoint_files import encode_ids, load_tokenizer
from meshserve.core.delta_coalescing import coalesce
from meshserve.core.outputs import CompletionDelta, FinishReason
from meshserve.core.sampling_params import SamplingParams
from meshserve.core.secret import ClusterSecret
from meshserve.engine.admission import RequestValidator
from meshserve.engine.engine_config import EngineConfig
from meshserve.engine.engine_core import EngineCore
from meshserve.engine.request import Request, Ticket
from meshserve.errors import CapacityError, ConfigError, UnavailableError, as_enum, check
from meshserve.kvtransfer.transport import default_device, describe_setting

log = logging.getLogger("meshserve.coordinator")


class Runtime(StrEnum):
    RAY = "ray"  # WorkerActors in placement groups (embedded Ray or pools.ray_address)
    PROCESSES = "processes"  # local subprocess ranks (no Ray)
    THREADS = "threads"  # tp=1 ranks on threads of this process, over the zmq step channel (tests)
    IN_PROCESS = "in-process"  # the tp=1 rank called directly in this process (the embedded default)


@dataclass(frozen=True)
class ClusterConfig:
    """engine: the replicas' settings; pools: mode, replica counts, ray_address.

    prefill_parallel / decode_parallel: a pool's own tp/dcp (default engine.parallel). KV moves
    between pools of any two layouts (heads re-split, tokens re-distributed: kvtransfer/reshard.py);
    the per-rank block size (cache block_size) is the one thing both pools must share.
    """

    engine: EngineConfig
    pools: PoolConfig = field(default_factory=PoolConfig)
    runtime: Runtime = Runtime.RAY
    prefill_parallel: ParallelConfig | None = None
    decode_parallel: ParallelConfig | None = None
    device: str | None = None
    progress: bool = False  # in-process runtime: show the model load's progress bar
    worker_class: str | None = None  # "module:Class" of the rank's worker (default: the real Worker)
    model_name: str | None = None  # what clients call the model (default: the checkpoint folder's name)
    ray_num_cpus: int | None = None  # embedded Ray only
    ray_temp_dir: str | None = None  # embedded Ray only
    health_period_s: float = 2.0
    handover_timeout_s: float = 5.0
    drain_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "runtime", as_enum(Runtime, "runtime", self.runtime))
        check(self.engine.model.model is not None, "model", None, "a checkpoint directory")
        for name in ("health_period_s", "handover_timeout_s", "drain_timeout_s"):
            value = getattr(self, name)
            check(isinstance(value, int | float) and value > 0, name, value, "a number of seconds > 0")
        if self.runtime in (Runtime.THREADS, Runtime.IN_PROCESS):
            for role, par in self.parallel_by_role().items():
                check(par.tp == 1, f"{role} tp", par.tp,
                      f"1 with runtime={self.runtime.value} (use processes or ray)")
        if self.runtime is Runtime.IN_PROCESS:
            check(self.worker_class is None, "worker_class", self.worker_class,
                  "None with runtime=in-process (the real Worker; use threads for a stand-in)")
            # A hand-over detaches a request mid-overlap and exports KV from a rank server that
            # in-process ranks do not run: disaggregated pools need ranks behind the channel.
            check(self.pools.mode is PoolMode.UNIFIED, "pools", self.pools.mode.value,
                  "'unified' with runtime=in-process (use threads, processes or ray)")

    def parallel_by_role(self) -> dict[str, ParallelConfig]:
        if self.pools.mode is PoolMode.UNIFIED:
            return {"unified": self.engine.parallel}
        return {"prefill": self.prefill_parallel or self.engine.parallel,
                "decode": self.decode_parallel or self.engine.parallel}


class DeltaSink(Protocol):
    """Where a request's deltas go: an asyncio.Queue, or anything with its put_nowait."""

    def put_nowait(self, item: CompletionDelta | BaseException) -> None: ...


@dataclass(eq=False)
class OpenStream:
    """A request admitted by `Coordinator.open_stream`, and what it holds of its caller's limit."""

    ticket: Ticket
    caller: str
    sequences: int
    closed: bool = False


class Coordinator:
    """Implements meshserve.cluster.service.InferenceService over pools of replicas.

    core: an engine already built in this process, run by the first replica of a one-replica
    in-process pool (`LLM` loads its model once for `generate` and `stream`); a rebuild of that
    replica builds a fresh engine.
    """

    def __init__(self, config: ClusterConfig, *, core: EngineCore | None = None) -> None:
        if core is not None:
            check(config.runtime is Runtime.IN_PROCESS and config.pools.mode is PoolMode.UNIFIED
                  and config.pools.replicas == 1, "core", "an engine",
                  "None unless the pool is one unified in-process replica")
        self.config = config
        self.disaggregated = config.pools.mode is PoolMode.DISAGGREGATED
        ray = config.runtime is Runtime.RAY
        self.kv_transport = describe_setting(
            config.engine.cache.kv_transport, config.device or default_device(), one_host=not ray,
            shared_gpus=ray and any(p.gpus_per_rank < 1 for p in config.parallel_by_role().values()))
        self.pools: dict[str, ReplicaPool] = {}
        self.tokenizer = None
        self.validator: RequestValidator | None = None
        self._core = core
        # One secret for every replica's internal sockets (their ranks exchange KV): the
        # operator's (MESHSERVE_CLUSTER_SECRET[_FILE]) or a fresh one; never logged.
        self.secret = ClusterSecret.resolve()
        self.deadline = StepDeadline(config.pools.step_timeout_base_s, config.pools.step_timeout_per_token_s)
        # client request id -> its ticket. Replicas know a request by a fresh internal id: a client may
        # reuse an id as soon as its stream ends, before the old request's abort reached its replica.
        self._live: dict[str, Ticket] = {}
        self._arrivals = itertools.count()
        self._serial = itertools.count()
        self.callers = CallerLedger(config.engine.scheduler.max_sequences_per_caller)
        self._owns_ray = False
        self._closing = False
        self._started = False
        # monotonic times health() last saw the service serving / every replica healthy (None: never)
        self._serving_at: float | None = None
        self._all_healthy_at: float | None = None
        # Set on stop: ends waits in replica-building threads that stop() cannot reach yet
        # (a Ray placement pending while its replica starts has no executor to shut down).
        self._stopping = threading.Event()

    # -- life cycle -----------------------------------------------------------------------------
    async def start(self) -> Coordinator:
        cfg = self.config
        if cfg.runtime is not Runtime.IN_PROCESS:  # embedded, the host program's logging rules
            configure_logging()
        if cfg.runtime is Runtime.RAY:
            from meshserve.cluster.executors.ray_executor import ray_init

            # On the calling thread: Ray installs its signal handlers only from the main thread.
            self._owns_ray = ray_init(cfg.pools.ray_address, num_cpus=cfg.ray_num_cpus, temp_dir=cfg.ray_temp_dir)
        self.tokenizer = load_tokenizer(cfg.engine.model.model)
        sizes = ({"unified": cfg.pools.replicas} if not self.disaggregated
                 else {"prefill": cfg.pools.prefill_replicas, "decode": cfg.pools.decode_replicas})
        parallel = cfg.parallel_by_role()
        for role, size in sizes.items():
            self.pools[role] = ReplicaPool(role, size, self._builder(role, parallel[role]),
                                           max_queue=cfg.engine.scheduler.max_queue)
        try:
            if cfg.runtime is Runtime.RAY:
                self._check_gpus(sizes, parallel)
            await asyncio.gather(*(p.start() for p in self.pools.values()))
        except BaseException:
            await self._stop_all()
            raise
        info = self.pools[self._entry].replicas[0].core.info
        self._max_model_len, self._vocab_size = info.max_model_len, info.vocab_size
        self.validator = RequestValidator.of_model(self.tokenizer, info, cfg.engine.scheduler)
        self._started = True
        log.info("coordinator ready: %s", ", ".join(f"{r} x{p.size}" for r, p in self.pools.items()))
        if self.disaggregated:
            log.info("KV hand-over transport: %s (kv_transport=%s)", self.kv_transport, cfg.engine.cache.kv_transport)
        return self

    def _check_gpus(self, sizes: dict[str, int], parallel: dict[str, ParallelConfig]) -> None:
        """Refuse pools whose GPU ranks cannot fit the embedded Ray cluster (ray_executor.check_gpus_suffice)."""
        from meshserve.cluster.executors.gpu_placement import PoolDemand
        from meshserve.cluster.executors.ray_executor import check_gpus_suffice

        cfg = self.config
        demands = [PoolDemand(role, size, parallel[role].tp, parallel[role].gpus_per_rank)
                   for role, size in sizes.items()]
        embedded = self._owns_ray and cfg.pools.ray_address is None and not os.environ.get("RAY_ADDRESS")
        check_gpus_suffice(demands, device=cfg.device, embedded=embedded)

    async def __aenter__(self) -> Coordinator:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown(drain=False)

    def _builder(self, role: str, parallel: ParallelConfig):
        cfg = self.config
        engine = replace(cfg.engine, parallel=parallel)
        decode = cfg.parallel_by_role()["decode"] if role == "prefill" else None

        def build(slot: int) -> Replica:
            name = f"{role}-{slot}"
            return Replica(name, role, engine, lambda: self._make_core(engine, role, name),
                           on_handoff=self._on_handoff, on_failed=self.pools[role].on_failed,
                           handoff_tp=decode and decode.tp, handoff_dcp=decode and decode.dcp,
                           health_period_s=cfg.health_period_s, handover_timeout_s=cfg.handover_timeout_s,
                           deadline=self.deadline, max_migrations=cfg.pools.max_migrations)
        return build

    def _make_core(self, engine: EngineConfig, role: str, name: str) -> EngineCore:
        """(In a thread) a replica's engine over freshly started ranks; the ranks are shut down
        if it cannot be built."""
        if self._core is not None:
            core, self._core = self._core, None
            return core
        executor = self._executor(engine, role, name)
        try:
            return EngineCore(engine, executor=executor)
        except BaseException:
            executor.shutdown()
            raise

    def _executor(self, engine: EngineConfig, role: str, name: str):
        cfg = self.config
        if cfg.runtime is Runtime.IN_PROCESS:
            from meshserve.cluster.executors.in_process import InProcessExecutor

            return InProcessExecutor(engine, device=cfg.device, progress=cfg.progress)
        if cfg.runtime is Runtime.RAY:
            from meshserve.cluster.executors.ray_executor import RayExecutor

            return RayExecutor(engine, role=role, name=name, device=cfg.device, worker_class=cfg.worker_class,
                               secret=self.secret, placement_timeout_s=cfg.pools.placement_timeout_s,
                               cancel=self._stopping, deadline=self.deadline)
        if cfg.runtime is Runtime.PROCESSES:
            from meshserve.cluster.executors.multiproc import MultiprocExecutor

            return MultiprocExecutor(engine, device=cfg.device, worker_class=cfg.worker_class, name=name,
                                     secret=self.secret, deadline=self.deadline)
        from meshserve.cluster.executors.channel_executor import ChannelExecutor, ThreadRanks
        from meshserve.cluster.executors.executor import WorkerSpec

        spec = WorkerSpec(engine.model, engine.cache, engine.attention, engine.parallel, cfg.device,
                          **({"worker_class": cfg.worker_class} if cfg.worker_class else {}))
        return ChannelExecutor(ThreadRanks(spec), name=name, secret=self.secret, deadline=self.deadline)

    async def shutdown(self, *, drain: bool = True) -> None:
        """Refuse new requests; with drain, let running ones finish (up to drain_timeout_s)."""
        self._closing = True
        if drain:  # prefill first: its requests end up on decode replicas, which drain after
            for pool in self.pools.values():
                await pool.drain(self.config.drain_timeout_s)
        await self._stop_all()

    async def _stop_all(self) -> None:
        self._stopping.set()
        await asyncio.gather(*(p.stop() for p in self.pools.values()), return_exceptions=True)
        if self._owns_ray:
            from meshserve.cluster.executors.ray_executor import ray_shutdown

            ray_shutdown()
            self._owns_ray = False

    # -- InferenceService -----------------------------------------------------------------------
    @property
    def _entry(self) -> str:
        return "prefill" if self.disaggregated else "unified"

    @property
    def max_queue(self) -> int:
        """Requests each pool lets wait before QueueFullError."""
        return self.config.engine.scheduler.max_queue

    @property
    def model_name(self) -> str:
        """What clients call the model: ClusterConfig.model_name, else the checkpoint folder's name."""
        from meshserve.demo_model import DEMO_MODEL_DIR

        if self.config.model_name:
            return self.config.model_name
        path = Path(self.config.engine.model.model).resolve()
        return "meshserve-demo" if path == DEMO_MODEL_DIR else path.name

    def models(self) -> list[ModelCard]:
        if not self._started:
            raise UnavailableError("the service is starting: the model is not loaded yet")
        return [ModelCard(self.model_name, self._max_model_len, self._vocab_size)]

    def tokenize(self, text: str) -> list[int]:
        check(self.tokenizer is not None, "text", text[:20], "token ids: the model has no tokenizer.json")
        return self.validator.encode(text)[1] if self.validator else encode_ids(self.tokenizer, text)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        check(self.tokenizer is not None, "token_ids", list(token_ids[:5]), "text: the model has no tokenizer")
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                       request_id: str, beam: BeamSearchParams | None = None, caller: str = "",
                       priority: int = 0) -> AsyncIterator[CompletionDelta]:
        """Deltas of one request until its finished one. Refusals raise before anything is queued.
        caller: who sent it (fair_queue.py: its place in the queue and its in-flight limit);
        priority: lower is served first (vLLM's), default 0."""
        sink: asyncio.Queue = asyncio.Queue()
        stream = self.open_stream(prompt, params, request_id=request_id, sink=sink, beam=beam, caller=caller,
                                  priority=priority)
        finished = False
        try:
            while True:
                for item in await _queued(sink):
                    if isinstance(item, BaseException):
                        finished = True  # nothing holds it any more
                        raise item
                    item.request_id = request_id
                    yield item
                    if item.finished:
                        finished = True
                        return
        finally:
            self.close_stream(stream, finished=finished)

    def open_stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *, request_id: str,
                    sink: DeltaSink, beam: BeamSearchParams | None = None, caller: str = "",
                    priority: int = 0) -> OpenStream:
        """Admit one request whose deltas (and a failure, as an exception) go to `sink.put_nowait`
        on the event loop, deltas carrying the internal request id; refusals raise here, with
        nothing queued. `generate` reads a queue; the engine process's endpoint for front-ends in
        other processes (cluster/service_endpoint.py) batches them into one message per step.
        Every open stream is closed once (`close_stream`), which aborts it unless it finished."""
        request = self._make_request(prompt, params, request_id, beam)
        sequences = request.beam.beam_width if request.beam is not None else request.params.num_samples
        load = self.callers.admit(caller, sequences)
        try:
            (pool := self.pools[self._entry]).admit()
        except BaseException:
            self.callers.release(caller, sequences)
            raise
        request.arrival = queue_key(priority=priority, load=load, serial=request.arrival)
        ticket = Ticket(request_id, request, sink=sink, prefill_only=self.disaggregated and not request.runs_whole)
        self._live[request_id] = ticket
        request_event(request.request_id, "admitted", pool=pool.role, prompt_tokens=request.num_input_tokens)
        pool.submit(ticket)
        hop_trace.mark("coordinator.submitted", request_id, request.request_id)  # the stream's id and the engine's
        return OpenStream(ticket, caller, sequences)

    def close_stream(self, stream: OpenStream, *, finished: bool) -> None:
        """The stream's reader is done with it: free its id and its caller's share; unless its last
        delta (or its failure) came, abort the request and free its blocks now."""
        if stream.closed:
            return
        stream.closed = True
        ticket = stream.ticket
        if self._live.get(ticket.client_id) is ticket:
            del self._live[ticket.client_id]
        self.callers.release(stream.caller, stream.sequences)
        if not finished:  # the caller left early
            self._cancel(ticket)

    async def abort(self, request_id: str) -> bool:
        """Cancel a request; its stream ends with finish_reason abort. False if unknown."""
        ticket = self._live.get(request_id)
        if ticket is None:
            return False
        self._cancel(ticket)
        return True

    async def embed(self, inputs, *, truncate: bool = False):
        """A generative model has no Embed (the protocol's task rule)."""
        raise ConfigError("model", self.model_name, "an embed model for Embed; this model's task is 'generate' "
                          "(use Generate)")

    def _cancel(self, ticket: Ticket) -> None:
        """Abort wherever the request is; one in hand-over is dropped when it arrives (_on_handoff)."""
        ticket.cancelled = True
        any(pool.abort(ticket) for pool in self.pools.values())

    def health(self) -> ServiceHealth:
        """detail: empty while every replica serves; otherwise what is not, and why.

        The times since the service last served / was fully healthy are as of the last call
        that saw it so: the server's health reporter calls this every 0.2 s."""
        now = time.monotonic()
        replicas = [r for p in self.pools.values() for r in p.replicas]
        healthy = [r for r in replicas if r.accepting]
        serving = self._started and not self._closing and all(p.ready for p in self.pools.values())
        if serving:
            self._serving_at = now
            if len(healthy) == len(replicas):
                self._all_healthy_at = now
        detail = "; ".join(d for p in self.pools.values() if (d := p.describe(problems_only=True)))
        since = lambda t: None if t is None else now - t  # noqa: E731
        return ServiceHealth(serving, len(healthy), len(replicas), detail, unserving_s=since(self._serving_at),
                             degraded_s=since(self._all_healthy_at),
                             num_rebuilds=sum(p.num_rebuilds for p in self.pools.values()),
                             num_rebuild_failures=sum(p.num_rebuild_failures for p in self.pools.values()))

    def stats(self) -> ServiceStats:
        rows = [s for p in self.pools.values() for s in p.stats()]
        total, free = (sum(getattr(s, f) for s in rows) for f in ("num_total_kv_blocks", "num_free_kv_blocks"))
        summed = {f: sum(getattr(s, f) for s in rows) for f in (
            "num_waiting", "num_running", "prefix_hit_tokens", "num_preemptions", "generated_tokens")}
        moved, kept, hung = (sum(getattr(s, f) for s in rows) for f in ("num_migrated", "num_migrations_refused",
                                                                         "num_hung"))
        return ServiceStats(
            **summed, kv_usage=(total - free) / total if total else 0.0, num_free_kv_blocks=free,
            prompt_tokens=sum(s.prompt_tokens for s in rows if s.role != "decode"),
            expert_tokens=sum_expert_load([s.expert_tokens for s in rows]),
            handovers=[HandoverRow(s.role, s.name, s.handover) for s in rows] if self.disaggregated else [],
            kv_transport=self.kv_transport if self.disaggregated else "", num_migrations=moved,
            num_migrations_refused=kept, num_hung_replicas=hung, hung_detection_s=sum(s.hung_detect_s for s in rows),
            grammar_compiles=[GrammarCompileRow(s.role, s.name, s.num_grammar_stuck, s.num_grammar_written_off,
                                                s.num_grammar_refused) for s in rows])

    # -- internals ------------------------------------------------------------------------------
    def _make_request(self, prompt, params: SamplingParams | None, request_id: str, beam=None) -> Request:
        if self._closing or not self._started:
            raise UnavailableError("the service is shutting down" if self._closing else "the service is starting")
        check(isinstance(request_id, str) and request_id != "", "request_id", request_id, "a non-empty string")
        check(request_id not in self._live, "request_id", request_id, "an id not in use")
        request = self.validator.make(prompt, params, request_id=f"{next(self._serial)}:{request_id}",
                                      arrival=next(self._arrivals), fit_max_tokens=True, beam=beam)
        # The samples (n, best_of) or beams of a request run side by side: they share the prompt's
        # blocks, each needs its own output. A request that cannot fit whole would only preempt
        # itself (and every other stream) over and over: refused (encoder blocks share the pool).
        width = request.beam.beam_width if request.beam is not None else request.params.num_samples
        need = request.num_input_tokens + width * request.params.max_tokens
        capacity = min((r.core.kv.capacity_tokens for p in self.pools.values() for r in p.replicas
                        if r.core is not None), default=need)
        if need > capacity:
            times = f"{width} x " if width > 1 else ""
            raise CapacityError(f"prompt ({request.num_input_tokens} tokens) + {times}max_tokens "
                                f"({request.params.max_tokens}) needs {need} KV slots; a replica holds {capacity}")
        return request

    def _on_handoff(self, handoff: Handoff) -> None:
        ticket = handoff.ticket
        if ticket.cancelled:  # aborted, or the client left, while it was being prefilled
            release_sources([handoff])
            ticket.sink.put_nowait(CompletionDelta(ticket.request_id, [], "", True, FinishReason.ABORT))
            return
        request_event(ticket.request_id, "handoff", source=handoff.source.name, kv=handoff.offer is not None)
        self.pools["decode"].hand_over(handoff)

    def replicas(self, role: str | None = None) -> list[Replica]:
        """Live replicas (of one role, or all): for tests and the operations tools."""
        return [r for name, p in self.pools.items() if role in (None, name) for r in p.replicas]


async def _queued(sink: asyncio.Queue) -> list:
    """What waits in a stream's queue (at least one item), the deltas of a stream that fell
    behind joined into one (core/delta_coalescing.py): one message per step, not per token."""
    items = [await sink.get()]
    while not sink.empty():
        items.append(sink.get_nowait())
    return coalesce(items) if len(items) > 1 else items
