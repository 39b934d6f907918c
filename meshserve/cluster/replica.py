"""One replica inside the cluster: an EngineCore driven by its own asyncio task.

The task owns the core. Model steps and channel calls run in a worker thread (one at a time);
new requests, aborts, hand-overs and releases arriving meanwhile wait in lists and are applied
between steps, so the scheduler and KV manager are only ever touched by one thread at a time.

Disaggregated serving (handover.py). A prefill replica runs a request until its first token,
then offers its KV and hands a `Handoff` to the coordinator; a decode replica `adopt`s it,
pulling the KV (or recomputing the prompt when that fails); then the prefill replica is told to
`release` its pin.

Failure: when the executor reports a dead rank (or any step fails) the replica fails. Requests
in flight (scheduled at least once, or adopted) end with ReplicaFailedError naming the cause:
one of them may be what killed it, so they are not retried. Requests that never ran lose
nothing: they go back to the pool (`on_failed`), which also rebuilds the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from meshserve.cluster.engine import EngineConfig, EngineCore
from meshserve.cluster.executor import Executor, sum_expert_load
from meshserve.cluster.handover import Handoff, import_kv, offer_kv, release_sources
from meshserve.cluster.handover_stats import HandoverStats
from meshserve.cluster.logs import request_event
from meshserve.cluster.request import Request, RequestStatus, Ticket
from meshserve.core.outputs import CompletionDelta, FinishReason
from meshserve.errors import MeshserveError, ReplicaFailedError
from meshserve.kvstore.pins import KVPins

log = logging.getLogger("meshserve.replica")


class ReplicaState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"  # finishing its requests, taking no new ones
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass
class ReplicaStats:
    name: str
    role: str
    state: str
    num_waiting: int
    num_running: int
    num_free_kv_blocks: int
    num_total_kv_blocks: int
    kv_usage: float
    prefix_hit_tokens: int
    prompt_tokens: int
    generated_tokens: int
    num_preemptions: int
    num_handoffs: int = 0  # prefill: requests handed over; decode: adopted (imported or recomputed)
    num_kv_imports: int = 0
    num_recomputes: int = 0
    handover: HandoverStats = field(default_factory=HandoverStats)  # the same, in detail (a copy)
    expert_tokens: list[list[int]] = field(default_factory=list)  # [MoE layer][expert] rows since start


@dataclass
class _Counters:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    expert_tokens: list[list[int]] = field(default_factory=list)
    steps: int = 0


# Steps between two reads of the ranks' expert load counters (and at every idle health check).
EXPERT_LOAD_PERIOD = 64


class Replica:
    """name: unique in the cluster; role: unified, prefill or decode; handoff_tp, handoff_dcp: the
    layout of the replicas that take this one's hand-overs (prefill role).

    make_core(): the replica's engine over freshly started ranks (blocking: called in a thread;
    it shuts its ranks down itself if it raises). The runtime (ranks in this process, on
    threads, in subprocesses or Ray actors) is its choice.
    on_handoff(handoff): a prefill finished (prefill role); on_failed(replica, error, orphans):
    the replica died; orphans are the tickets that streamed nothing yet, reset to run afresh.
    """

    def __init__(self, name: str, role: str, config: EngineConfig, make_core: Callable[[], EngineCore], *,
                 on_handoff: Callable[[Handoff], None] | None = None,
                 on_failed: Callable[[Replica, BaseException, list], None] | None = None,
                 handoff_tp: int | None = None, handoff_dcp: int | None = None, health_period_s: float = 2.0,
                 handover_timeout_s: float = 5.0) -> None:
        self.name = name
        self.role = role
        self.config = config
        self.make_core = make_core
        self.on_handoff = on_handoff
        self.on_failed = on_failed
        self.health_period_s = health_period_s
        self.handover_timeout_s = handover_timeout_s
        self.model_id = str(config.model.model)
        self.world = config.parallel.tp
        self.handoff_tp = handoff_tp or self.world  # the decode pool's tp (prefill role)
        self.handoff_dcp = handoff_dcp or config.parallel.dcp  # and its dcp
        self.state = ReplicaState.STARTING
        self.error: BaseException | None = None
        self.core: EngineCore | None = None
        self.pins: KVPins | None = None  # the driver side of hand-overs (handover.py), over core.kv
        self.executor: Executor | None = None
        self.faults: list[str] = []  # injected hand-over faults (tests): "checksum", "withdraw"
        self._held: dict[str, Ticket] = {}  # internal request id -> the ticket of every request held
        self._inbox: list[str] = []
        self._adoptions: list[Handoff] = []
        self._aborts: list[str] = []
        self._releases: list[tuple] = []
        self.counters = _Counters()
        self.handover = HandoverStats()  # hand-overs at either end (handover.py counts them)
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._task: asyncio.Task | None = None

    # -- life cycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the ranks and load the model (in a thread); READY when done, FAILED if it raised."""
        try:
            self.core = await asyncio.to_thread(self.make_core)
        except BaseException as exc:
            self.state, self.error = ReplicaState.FAILED, exc
            raise
        self.executor = self.core.executor
        self.pins = KVPins(self.core.kv)
        self.state = ReplicaState.READY
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"replica-{self.name}")
        log.info("replica %s (%s) ready: %d KV blocks", self.name, self.role, self.core.kv.num_total_blocks)

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Take no new requests; wait until the ones held finish. False on timeout."""
        if self.state is ReplicaState.READY:
            self.state = ReplicaState.DRAINING
        self._wake()
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while self._held:  # the event may be stale: check what it stands for
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), left)
        return True

    async def stop(self) -> None:
        """Stop the loop and the ranks; requests still held end with ReplicaFailedError."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for ticket in self._held.values():
            ticket.sink.put_nowait(ReplicaFailedError(f"replica {self.name} was shut down"))
        self._held.clear()
        if self.executor is not None:
            await asyncio.to_thread(self.executor.shutdown)
            self.executor = None
        if self.state is not ReplicaState.FAILED:
            self.state = ReplicaState.STOPPED

    # -- requests (event-loop thread) -------------------------------------------------------------
    @property
    def accepting(self) -> bool:
        """Takes new requests."""
        return self.state is ReplicaState.READY

    @property
    def alive(self) -> bool:
        """Still runs what it holds, and takes hand-overs (a draining decode replica must)."""
        return self.state in (ReplicaState.READY, ReplicaState.DRAINING)

    def submit(self, ticket: Ticket) -> None:
        rid = ticket.request_id
        self._held[rid] = ticket
        ticket.holder = self.name
        self._idle.clear()
        self._inbox.append(rid)
        request_event(rid, "queued", replica=self.name, prefill_only=ticket.prefill_only)
        self._wake()

    def adopt(self, handoff: Handoff) -> None:
        ticket = handoff.ticket
        rid = ticket.request_id
        ticket.prefill_only, ticket.holder = False, self.name
        self._held[rid] = ticket
        self._idle.clear()
        self._adoptions.append(handoff)
        request_event(rid, "adopting", replica=self.name, kv="offered" if handoff.offer else "recompute")
        self._wake()

    def abort(self, request_id: str) -> bool:
        if request_id not in self._held:
            return False
        self._aborts.append(request_id)
        self._wake()
        return True

    def release(self, pin_id: tuple) -> None:
        """The decode side is done with an offer: free the pinned blocks."""
        if self.alive:
            self._releases.append(pin_id)
            self._wake()

    def inject_fault(self, kind: str) -> None:
        """Make the next hand-over offer from this replica fail ("checksum" or "withdraw")."""
        self.faults.append(kind)

    @property
    def load(self) -> int:
        """Requests held (queued, running, being adopted)."""
        return len(self._held)

    @property
    def num_waiting(self) -> int:
        sched = 0 if self.core is None else len(self.core.scheduler.waiting)
        return len(self._inbox) + len(self._adoptions) + sched

    @property
    def num_free_blocks(self) -> int:
        return 0 if self.core is None else self.core.kv.num_free_blocks

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """Prompt tokens this replica's prefix cache holds (a routing hint; never blocks)."""
        try:
            return self.core.kv.lookup_prefix(token_ids).num_tokens
        except Exception:  # raced with a step: it is only a hint
            return 0

    def stats(self) -> ReplicaStats:
        core, c = self.core, self.counters
        kv = None if core is None else core.kv
        return ReplicaStats(
            name=self.name, role=self.role, state=self.state.value, num_waiting=self.num_waiting,
            num_running=0 if core is None else len(core.scheduler.running),
            num_free_kv_blocks=0 if kv is None else kv.num_free_blocks,
            num_total_kv_blocks=0 if kv is None else kv.num_total_blocks,
            kv_usage=0.0 if kv is None else kv.usage,
            prefix_hit_tokens=0 if core is None else core.scheduler.stats.num_prefix_hit_tokens,
            prompt_tokens=c.prompt_tokens, generated_tokens=c.generated_tokens,
            num_preemptions=0 if core is None else core.scheduler.stats.num_preemptions,
            num_handoffs=self.handover.handovers, num_kv_imports=self.handover.kv_imports,
            num_recomputes=self.handover.num_recomputes, handover=self.handover.copy(),
            expert_tokens=c.expert_tokens)

    def _read_expert_load(self) -> None:
        """Between steps (the ranks' channel is free): refresh the per-expert row counts."""
        world = self.config.parallel.tp
        self.counters.expert_tokens = sum_expert_load(self.executor.call("expert_load", [{}] * world))

    def _wake(self) -> None:
        self._wakeup.set()

    # -- the loop -------------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            while True:
                self._apply()
                if self._adoptions:
                    adoptions, self._adoptions = self._adoptions, []
                    try:
                        await asyncio.to_thread(self._import_all, adoptions)
                    finally:  # pulled, refused or failed: the source may free its pin
                        release_sources(adoptions)
                    continue
                if not self.core.has_unfinished():
                    if not self._held:
                        self._idle.set()
                    self._wakeup.clear()
                    if self._inbox or self._aborts or self._releases:
                        continue
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), self.health_period_s)
                    except TimeoutError:  # idle: make sure the ranks are still there
                        await asyncio.to_thread(self.executor.check_health)
                        await asyncio.to_thread(self._read_expert_load)
                    continue
                self._idle.clear()
                deltas, handoffs = await asyncio.to_thread(self._step)
                self._deliver(deltas)
                for h in handoffs:
                    self._held.pop(h.ticket.request_id)
                    h.ticket.holder = None
                    self.on_handoff(h)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(exc)

    def _apply(self) -> None:
        """Releases, aborts and new requests, while no step runs."""
        core = self.core
        releases, self._releases = self._releases, []
        for pin in releases:
            self.pins.release(pin)
        aborts, self._aborts = self._aborts, []
        for rid in aborts:
            ticket = self._held.pop(rid, None)
            if ticket is None:
                continue
            if rid in self._inbox:
                self._inbox.remove(rid)
            else:
                core.abort(rid)
            ticket.sink.put_nowait(CompletionDelta(rid, [], "", True, FinishReason.ABORT))
            request_event(rid, "aborted", replica=self.name)
        inbox, self._inbox = self._inbox, []
        for rid in inbox:
            ticket = self._held[rid]
            try:
                core.add(ticket.request, bounded=False)  # the pool bounds the queue (pools.py)
            except MeshserveError as exc:
                del self._held[rid]
                ticket.sink.put_nowait(exc)
                continue
            self.counters.prompt_tokens += ticket.request.num_input_tokens

    def _deliver(self, deltas: list[CompletionDelta]) -> None:
        for delta in deltas:
            ticket = self._held.get(delta.request_id)
            if ticket is None:
                continue
            self.counters.generated_tokens += len(delta.token_ids)
            ticket.sink.put_nowait(delta)
            if delta.finished:
                del self._held[delta.request_id]
                request_event(delta.request_id, "finished", replica=self.name, reason=delta.finish_reason)

    # -- step thread ----------------------------------------------------------------------------
    def _step(self) -> tuple[list[CompletionDelta], list[Handoff]]:
        deltas = self.core.step()
        self.counters.steps += 1
        if self.counters.steps % EXPERT_LOAD_PERIOD == 0:
            self._read_expert_load()
        handoffs = []
        for d in deltas:
            ticket = self._held.get(d.request_id)
            if ticket is not None and ticket.prefill_only and not d.finished:
                handoffs.append(offer_kv(self, ticket))
        return deltas, handoffs

    def _import_all(self, adoptions: list[Handoff]) -> None:
        for h in adoptions:
            if h.ticket.request_id not in self._held:
                continue  # aborted before it arrived
            computed = import_kv(self, h)
            self.core.adopt(h.ticket.request, num_computed_tokens=computed)

    # -- failure --------------------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        self.state, self.error = ReplicaState.FAILED, exc
        cause = f"{type(exc).__name__}: {exc}" if not isinstance(exc, MeshserveError) else str(exc)
        log.warning("replica %s failed: %s", self.name, cause)
        orphans = []
        for rid, ticket in self._held.items():
            req = ticket.request
            never_ran = rid in self._inbox or (req.status is RequestStatus.WAITING and not req.output_ids
                                               and req.num_preemptions == 0)
            if not never_ran:  # it was in flight: it may be what killed the replica, so no retry
                ticket.sink.put_nowait(ReplicaFailedError(f"replica {self.name} failed: {cause}"))
                request_event(rid, "failed", replica=self.name)
            else:
                ticket.request = Request(rid, req.prompt_ids, req.params, req.arrival, prompt=req.prompt,
                                         encoder_ids=req.encoder_ids)
                ticket.holder = None
                orphans.append(ticket)
        self._held.clear()
        self._inbox.clear()
        release_sources(self._adoptions)
        self._adoptions.clear()
        self._idle.set()
        if self.on_failed is not None:
            self.on_failed(self, exc, orphans)
