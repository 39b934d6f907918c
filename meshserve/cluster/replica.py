"""One replica inside the cluster: an EngineCore driven by its own asyncio task.

The task owns the core. Model steps and channel calls run in a worker thread (one at a time;
`stop` waits for the one in flight); new requests, aborts, hand-overs and releases arriving
meanwhile wait in lists and are applied between steps, so the scheduler and KV manager are only
ever touched by one thread at a time.

Disaggregated serving (handover.py). A prefill replica runs a request until its first token,
detaches it and asks its ranks to offer its KV; the token is delivered while the step thread
waits for the ranks' answers, then a `Handoff` goes to the coordinator; a decode replica
`adopt`s it: its
ranks pull the KV in the background while it keeps stepping (`Imports`); the request joins the
running batch once the KV is in (or recomputes its prompt); the prefill replica then `release`s.

Failure: when the executor reports a dead or hung rank (or any step fails) the replica fails;
migration.py decides, per request, between running it again elsewhere (from scratch, or from the
tokens already streamed) and ending its stream with ReplicaFailedError. Those to run again go
back to the pool (`on_failed`), which also rebuilds the replica. A hung rank is caught by the
executor's step deadline; the replica's own progress watchdog (`_in_thread`) backs it up, for
executors without one (the in-process rank), with the longest step's deadline plus a margin.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable

from meshserve.cluster.executors.executor import Executor, StepDeadline, WorkerHungError, sum_expert_load
from meshserve.cluster.handover import Handoff, ReplicaHandover, release_sources
from meshserve.cluster.logs import request_event
from meshserve.cluster.migration import plan_failover
from meshserve.cluster.replica_stats import ReplicaCounters, ReplicaStats
from meshserve.core import hop_trace
from meshserve.core.doorbell import Doorbell
from meshserve.core.outputs import CompletionDelta, FinishReason
from meshserve.core.tasks import cancel_and_wait
from meshserve.engine.engine_config import EngineConfig
from meshserve.engine.engine_core import EngineCore
from meshserve.engine.request import Ticket
from meshserve.errors import MeshserveError, ReplicaFailedError

log = logging.getLogger("meshserve.replica")


class ReplicaState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"  # finishing its requests, taking no new ones
    FAILED = "failed"
    STOPPED = "stopped"


# Steps between two reads of the ranks' counters, expert load and grammar compiles (and at every idle health check).
RANK_COUNTERS_PERIOD = 64
WATCHDOG_MARGIN_S = 1.0  # the replica's watchdog fires this long after an executor's deadline would
STOP_TIMEOUT_S = 30.0  # stopping the ranks of a hung replica is not waited for longer
# Paced overlap (SchedulerConfig.paced_overlap): of the host's slack in a steady decode (the time a
# step waited for the device), the part spent waiting for arrivals before the next step is planned;
# the rest (and the margin) absorbs a step a little shorter than the one before and the loop's
# timer granularity, so the device never waits for the plan.
PACE_FRACTION = 0.75
PACE_MARGIN_S = 0.5e-3


class Replica:
    """name: unique in the cluster; role: unified, prefill or decode; handoff_tp, handoff_dcp: the
    layout of the replicas that take this one's hand-overs (prefill role).

    make_core(): the replica's engine over freshly started ranks (blocking: called in a thread; it
    shuts its ranks down itself if it raises); it chooses the runtime (threads, processes, Ray).
    on_handoff(handoff): a prefill finished (prefill role); on_failed(replica, error, orphans):
    the replica died; orphans are the tickets to run again elsewhere (migration.py).
    deadline: the step deadline its executor enforces (the watchdog's is derived from it);
    max_migrations: how often one request may move on after a failure.
    """

    def __init__(self, name: str, role: str, config: EngineConfig, make_core: Callable[[], EngineCore], *,
                 on_handoff: Callable[[Handoff], None] | None = None,
                 on_failed: Callable[[Replica, BaseException, list], None] | None = None,
                 handoff_tp: int | None = None, handoff_dcp: int | None = None, health_period_s: float = 2.0,
                 handover_timeout_s: float = 5.0, deadline: StepDeadline | None = None,
                 max_migrations: int = 2) -> None:
        self.name, self.role, self.config = name, role, config
        self.make_core = make_core
        self.on_handoff = on_handoff
        self.on_failed = on_failed
        self.health_period_s = health_period_s
        self.deadline = deadline or StepDeadline()
        self.max_migrations = max_migrations
        self.model_id = str(config.model.model)
        self.world = config.parallel.tp
        self.state = ReplicaState.STARTING
        self.error: BaseException | None = None
        self.core: EngineCore | None = None
        self.executor: Executor | None = None
        self._held: dict[str, Ticket] = {}  # internal request id -> the ticket of every request held
        self._inbox: list[str] = []
        self._adoptions: list[Handoff] = []  # handed over, import not started yet
        self._aborts: list[str] = []
        self._releases: list[tuple] = []
        self.counters = ReplicaCounters()
        # hand-overs at either end: pins, imports in flight, totals (handover.py); handoff_tp and
        # handoff_dcp: the decode pool's layout (prefill role)
        self.handover = ReplicaHandover(self, handoff_tp=handoff_tp or self.world,
                                        handoff_dcp=handoff_dcp or config.parallel.dcp, timeout_s=handover_timeout_s)
        self._wakeup = asyncio.Event()
        # Rung by _wake while the step thread waits for the ranks' KV pulls (wait_kv_pulls), which
        # a plain asyncio event could not interrupt; made in start(), closed in stop().
        self._pull_wait_bell: Doorbell | None = None
        self._waiting_for_pulls = False
        self._thread_busy = threading.Lock()
        self._idle = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop that runs _run (start)
        self._paced_s = 0.0  # how long _pace waited before the step now running (paced overlap)
        self._slack_s: float | None = None  # the host's slack in the last steady decode (paced overlap)

    # -- life cycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the ranks and load the model (in a thread); READY when done, FAILED if it raised."""
        try:
            self.core = await asyncio.to_thread(self.make_core)
        except BaseException as exc:
            self.state, self.error = ReplicaState.FAILED, exc
            raise
        self.executor = self.core.executor
        self.handover.attach(self.core.kv)
        self._pull_wait_bell = Doorbell()
        self.state = ReplicaState.READY
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run(), name=f"replica-{self.name}")
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
                async with asyncio.timeout(left):
                    await self._idle.wait()
        return True

    async def stop(self) -> None:
        """Stop the loop and the ranks; requests still held end with ReplicaFailedError."""
        if self._task is not None:
            self._wake()  # a step thread waiting for KV pulls returns now (the cancel cannot reach it)
            await cancel_and_wait(self._task)
            self._task = None
            hung = isinstance(self.error, WorkerHungError)  # its thread never returns: not waited for
            if not hung and await asyncio.to_thread(self._thread_busy.acquire, timeout=STOP_TIMEOUT_S):
                self._thread_busy.release()  # (a cancelled task leaves its thread running)
        for ticket in self._held.values():
            ticket.sink.put_nowait(ReplicaFailedError(f"replica {self.name} was shut down"))
        self._held.clear()
        if self.executor is not None:  # ranks stop their KV pulls first; bounded (a hung in-process rank can't stop)
            try:
                async with asyncio.timeout(STOP_TIMEOUT_S):
                    await asyncio.to_thread(self.executor.shutdown)
            except TimeoutError:
                log.error("replica %s: its ranks did not stop within %g s; left behind", self.name, STOP_TIMEOUT_S)
            self.executor = None
        release_sources(self._adoptions + self.handover.imports.close())
        self._adoptions.clear()
        self.handover.close_offers()
        if self._pull_wait_bell is not None:
            self._pull_wait_bell.close()
            self._pull_wait_bell = None
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
        # A prefill-only request is handed over at its next token: the scheduler plans no step past it.
        ticket.request.hand_over_at = len(ticket.request.output_ids) + 1 if ticket.prefill_only else 0
        self._idle.clear()
        self._inbox.append(rid)
        request_event(rid, "queued", replica=self.name, prefill_only=ticket.prefill_only)
        self._wake()

    def adopt(self, handoff: Handoff) -> None:
        ticket = handoff.ticket
        rid = ticket.request_id
        ticket.prefill_only, ticket.holder = False, self.name
        ticket.request.hand_over_at = 0
        self._held[rid] = ticket
        self._idle.clear()
        self._adoptions.append(handoff)
        request_event(rid, "adopting", replica=self.name, kv="offered" if handoff.offer else "recompute")
        self._wake()

    def abort(self, request_id: str) -> bool:
        if request_id not in self._held:
            return False
        offer = self.handover.offers.get(request_id)
        if offer is not None:  # its first token is out, its offer unanswered: nothing of it is in the engine
            offer.aborted = True  # (read by the step thread; if too late, _after_step lets go of the hand-off)
            self._end_aborted(request_id)
            return True
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
        self.handover.faults.append(kind)

    @property
    def load(self) -> int:
        """Requests held (queued, running, being adopted)."""
        return len(self._held)

    @property
    def num_waiting(self) -> int:
        sched = 0 if self.core is None else len(self.core.scheduler.waiting)
        return len(self._inbox) + len(self._adoptions) + len(self.handover.imports) + sched

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
            prompt_tokens=c.prompt_tokens, generated_tokens=c.generated_tokens, expert_tokens=c.expert_tokens,
            num_preemptions=0 if core is None else core.scheduler.stats.num_preemptions,
            num_handoffs=self.handover.stats.handovers, num_kv_imports=self.handover.stats.kv_imports,
            num_recomputes=self.handover.stats.num_recomputes, num_migrated=c.migrated,
            num_migrations_refused=c.migrations_refused, num_hung=int(c.hung_detect_s is not None),
            hung_detect_s=c.hung_detect_s or 0.0, handover=self.handover.stats.copy(),
            num_grammar_stuck=c.grammar.get("num_stuck", 0),
            num_grammar_written_off=c.grammar.get("num_written_off", 0),
            num_grammar_refused=c.grammar.get("num_refused", 0))

    def _read_rank_counters(self) -> None:
        """Between steps (the ranks' channel is free): refresh the per-expert row counts, and the
        driver rank's grammar compile counts (the other ranks answer zeros at once)."""
        per_rank = self.executor.call("counters", [{}] * self.config.parallel.tp)  # one round trip
        self.counters.expert_tokens = sum_expert_load([r["expert_load"] for r in per_rank])
        self.counters.grammar = per_rank[0]["grammar"]

    def _wake(self) -> None:
        self._wakeup.set()
        if self._waiting_for_pulls:
            self._pull_wait_bell.ring()

    # -- the loop -------------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            while True:
                self._apply()
                if self.core.has_unfinished():
                    self._idle.clear()
                    await self._pace()
                    # hand-overs ride along in the step's trip to the thread (_step ticks them first;
                    # a prefill step's first tokens are delivered while it waits for their KV offers)
                    self._after_step(*await self._with_adoptions(self._step))
                    continue
                if not self._held:
                    self._idle.set()
                self._wakeup.clear()
                if self._inbox or self._aborts or self._releases:
                    continue
                if self._adoptions or self.handover.imports:
                    await self._idle_turn()
                    continue
                try:  # (asyncio.timeout, not wait_for: on 3.11 that drops a cancel that comes as the wait ends)
                    async with asyncio.timeout(self.health_period_s):
                        await self._wakeup.wait()
                except TimeoutError:
                    await self._idle_health_check()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(exc)

    async def _pace(self) -> None:
        """Paced overlap (SchedulerConfig.paced_overlap). With overlap the next step is planned as
        soon as the last one returns, while the device still runs the step before: a request
        that arrives after that planning waits for the running step and the planned one. While
        a step runs, wait here until most of the host's slack of the last steady decode has
        passed since that step began (docs/engine.md "Paced overlap"), so that an arrival
        meanwhile joins the next step; any wake (an arrival, an abort, a hand-over) ends the
        wait, and what came is applied."""
        core, paced, self._paced_s = self.core, self._paced_s, 0.0
        if not self.config.scheduler.paced_overlap:
            return
        if core.decode_slack_s is not None:
            # The host's slack in a steady decode: what the step waited in collect plus what this
            # loop waited before it (the wait alone would shrink by the pace: every other step paced).
            self._slack_s = core.decode_slack_s + paced
        # Paced while a step runs: one with a prompt in it runs longer than a decode step, so the
        # last decode's slack is a safe wait then too (arrivals come in bursts: right after one's
        # prefill is where the next one most needs it).
        if self._slack_s is None or not core.step_in_flight:
            return
        # Counted from when the running step began (the last collect's return), not from now: this
        # task may resume late after the step thread returned (other tasks ran first), and the
        # device must not run dry meanwhile.
        started = time.monotonic()
        wait = core.collected_at + self._slack_s * PACE_FRACTION - PACE_MARGIN_S - started
        if wait <= 0 or self._inbox or self._aborts or self._releases or self._adoptions or self.handover.imports:
            return
        self._wakeup.clear()  # (no await since the checks above: nothing can have come in between)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                await self._wakeup.wait()
        self._paced_s = time.monotonic() - started
        self._apply()

    async def _with_adoptions(self, fn: Callable[[list[Handoff]], object]):
        """fn(the hand-overs adopted since the last tick) in the step thread; then the settled
        hand-overs' sources may release their pins."""
        adoptions, self._adoptions = self._adoptions, []
        try:
            out = await self._in_thread(fn, adoptions)
        except BaseException:  # the replica fails or stops: what was not started goes back
            self._adoptions[:0] = [h for h in adoptions if not self.handover.imports.knows(h)]
            raise
        release_sources(self.handover.imports.take_settled())  # pulled, refused or failed alike
        return out

    async def _idle_turn(self) -> None:
        """Nothing to step, hand-overs to start or KV on its way: one trip to the step thread
        starts the imports, waits there for a rank to push a finished pull (any _wake interrupts
        the wait: the doorbell), adopts it and runs the first step (_await_imports). A wait that
        ran its whole health period checks the ranks' health."""
        self._waiting_for_pulls = True
        try:
            timed_out, stepped = await self._with_adoptions(self._await_imports)
        finally:
            self._waiting_for_pulls = False
        if stepped is not None:
            self._idle.clear()
            self._after_step(*stepped)
        elif timed_out and not self._wakeup.is_set():
            await self._idle_health_check()

    async def _idle_health_check(self) -> None:
        """Idle for a health period: make sure the ranks are still there."""
        await self._in_thread(self.executor.check_health)
        await self._in_thread(self._read_rank_counters)

    def _after_step(self, deltas: list[CompletionDelta], handoffs: list[Handoff]) -> None:
        """Deliver a step's deltas (those the step thread did not deliver already), then hand the
        requests whose first token was delivered and whose KV is offered (or is to be recomputed)
        to the coordinator. One no longer held here (aborted meanwhile) is not handed off; its
        offer is let go of."""
        self._deliver(deltas)
        for h in handoffs:
            rid = h.ticket.request_id
            if self._held.get(rid) is not h.ticket:
                release_sources([h])
                continue
            del self._held[rid]
            h.ticket.holder = None
            self.on_handoff(h)

    def _apply(self) -> None:
        """Releases, aborts and new requests, while no step runs."""
        core = self.core
        releases, self._releases = self._releases, []
        for pin in releases:
            self.handover.pins.release(pin)
        aborts, self._aborts = self._aborts, []
        for rid in aborts:
            if rid not in self._held:
                continue
            if rid in self._inbox:
                self._inbox.remove(rid)
            elif rid in self.handover.imports:  # its blocks are freed once the ranks' pulls ended
                self.handover.imports.abort(rid)
            else:
                core.abort(rid)
            self._end_aborted(rid)
        inbox, self._inbox = self._inbox, []
        for rid in inbox:
            ticket = self._held[rid]
            try:
                if ticket.request.output_ids:  # migrated: continue after what was streamed
                    core.adopt(ticket.request)
                else:
                    core.add(ticket.request, bounded=False)  # the pool bounds the queue (pools.py)
            except MeshserveError as exc:
                del self._held[rid]
                ticket.sink.put_nowait(exc)
                continue
            if not ticket.migrations:  # a moved request's prompt was counted where it arrived
                self.counters.prompt_tokens += ticket.request.num_input_tokens
            hop_trace.mark("replica.added", rid)

    def _end_aborted(self, rid: str) -> None:
        ticket = self._held.pop(rid)
        ticket.sink.put_nowait(CompletionDelta(rid, [], "", True, FinishReason.ABORT))
        request_event(rid, "aborted", replica=self.name)

    def _deliver(self, deltas: list[CompletionDelta]) -> None:
        for delta in deltas:
            rid = delta.request_id
            ticket = self._held.get(rid)
            if ticket is None:
                continue
            self.counters.generated_tokens += len(delta.token_ids)
            ticket.num_streamed += len(delta.token_ids)
            # A request the engine refused after admission (its grammar did not compile) ends its
            # stream with that error: a 400 / INVALID_ARGUMENT before anything streamed.
            ticket.sink.put_nowait(delta if delta.error is None else delta.error)
            hop_trace.mark("replica.delivered", rid)
            if delta.finished:
                del self._held[rid]
                request_event(rid, "finished" if delta.error is None else "failed", replica=self.name,
                              reason=delta.finish_reason)

    async def _in_thread(self, fn: Callable, *args):
        """fn(*args) in a worker thread, under the progress watchdog: no answer within the longest
        step's deadline (plus a rank call's, plus a margin: the executor's own deadline fires
        first where it has one) means a hung rank. The stuck thread is left behind."""
        limit = (self.deadline.seconds(self.config.scheduler.max_num_batched_tokens) + self.deadline.seconds()
                 + WATCHDOG_MARGIN_S)
        call = asyncio.ensure_future(asyncio.to_thread(self._locked, fn, *args))
        done, _ = await asyncio.wait({call}, timeout=limit)
        if not done:
            raise WorkerHungError(f"replica {self.name} made no progress for {limit:.1f} s (the progress "
                                  "watchdog): a rank is hung", waited_s=limit)
        return call.result()

    # -- step thread ----------------------------------------------------------------------------
    def _locked(self, fn, *args):
        with self._thread_busy:  # held while a step or channel call runs: stop() waits for it
            return fn(*args)

    def _step(self, adoptions: list[Handoff]) -> tuple[list[CompletionDelta], list[Handoff]]:
        """One engine step (after ticking hand-overs): (deltas to deliver, hand-offs). A request
        whose first token it gave and that continues elsewhere (prefill role) is detached and its
        ranks are asked to offer its KV without waiting (offer_start); then the step's deltas go to
        the loop to be delivered at once, while this thread waits for the ranks' answers: the
        first token never waits for the offer, and the hand-off needs no other trip."""
        if adoptions or self.handover.imports:  # KV that arrived joins this very step
            self._handover_tick(adoptions)
        hop_trace.mark("step.start")
        deltas = self.core.step()
        if deltas and hop_trace.enabled():  # keyed by the requests whose first token this step gave
            hop_trace.mark("step.end", *self._first_tokens(deltas))
        else:
            hop_trace.mark("step.end" if deltas else "step.end_empty")
        self.counters.steps += 1
        if self.counters.steps % RANK_COUNTERS_PERIOD == 0:
            self._read_rank_counters()
        offers = []
        for d in deltas:
            ticket = self._held.get(d.request_id)
            if ticket is not None and ticket.prefill_only and not d.finished:
                offers.append(self.handover.offer_start(ticket))
        if not offers:
            return deltas, []
        self._loop.call_soon_threadsafe(self._deliver, deltas)
        handoffs = [self.handover.offer_finish(p) for p in offers]
        return [], [h for h in handoffs if h is not None]

    def _first_tokens(self, deltas: list[CompletionDelta]) -> list[str]:
        """(Traced, step thread) The ids of the requests whose first token `deltas` carry: nothing
        of theirs streamed yet (the loop delivers a step's deltas before the next step runs)."""
        held = self._held
        return [d.request_id for d in deltas
                if d.token_ids and (t := held.get(d.request_id)) is not None and t.num_streamed == 0]

    def _await_imports(self, adoptions: list[Handoff]) -> tuple[bool, tuple | None]:
        """(Step thread, nothing to step) Start the imports of `adoptions`; while KV is still on its
        way and nothing else came (the doorbell: _wake), wait up to a health period for a rank to
        push a finished pull and adopt it; then, if a request is ready, run its first step here
        rather than going back to the loop for it. Returns (whether the wait ran its whole
        period, the step's (deltas, handoffs) or None)."""
        self._handover_tick(adoptions)
        timed_out = False
        if self.handover.imports and not self.core.has_unfinished():
            pulled = self.executor.wait_kv_pulls(self.health_period_s, self._pull_wait_bell)
            self._pull_wait_bell.clear()  # a ring after this only makes the next wait return at once
            if pulled:
                self._handover_tick([])
            timed_out = not pulled
        if self.core.has_unfinished():  # what arrived meanwhile (a new request, an abort) waits one step
            return timed_out, self._step([])
        return timed_out, None

    def _handover_tick(self, adoptions: list[Handoff]) -> None:
        """Start the imports of new hand-overs; adopt those whose KV arrived (or that recompute)."""
        self.handover.imports.drop([h for h in adoptions if h.ticket.request_id not in self._held])  # aborted meanwhile
        self.handover.imports.tick([h for h in adoptions if h.ticket.request_id in self._held])

    # -- failure --------------------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        self.state, self.error = ReplicaState.FAILED, exc
        cause = f"{type(exc).__name__}: {exc}" if not isinstance(exc, MeshserveError) else str(exc)
        log.warning("replica %s failed: %s", self.name, cause)
        if isinstance(exc, WorkerHungError):
            self.counters.hung_detect_s = exc.waited_s
        out = plan_failover(self.name, self._held, set(self._inbox), exc, cause, max_migrations=self.max_migrations)
        self.counters.migrated += out.num_migrated
        self.counters.migrations_refused += out.num_refused
        for ticket, error in out.failed:
            ticket.sink.put_nowait(error)
            request_event(ticket.request_id, "failed", replica=self.name)
        for ticket in out.rerun:
            ticket.holder = None
            if ticket.request.output_ids:
                request_event(ticket.request_id, "migrating", replica=self.name, streamed=ticket.num_streamed,
                              migrations=ticket.migrations)
        self._held.clear()
        self._inbox.clear()
        release_sources(self._adoptions + self.handover.imports.close())
        self._adoptions.clear()
        self.handover.close_offers()
        self._idle.set()
        if self.on_failed is not None:
            self.on_failed(self, exc, out.rerun)
