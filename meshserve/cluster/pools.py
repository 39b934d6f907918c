"""A pool: the replicas of one role (unified, prefill or decode), with routing, admission and repair.

Routing. New requests go to the ready replica with the longest cached prefix of the prompt,
then the least load (requests held). Hand-overs go to the ready decode replica with the most
free KV blocks, then the least load.

Admission. The pool's queue (requests not yet running: waiting inside replicas plus those the
pool holds while no replica is ready) is bounded by `max_queue`; beyond it QueueFullError. This
is the only queue bound: replicas add what the pool routes to them unbounded. When no replica
is ready (all starting, failed or being rebuilt), UnavailableError naming each replica's state
and the last failure: health says NOT_SERVING then, and a client does better to retry than to
wait for a model to reload. Hand-overs are never refused: their first token has already been
streamed.

Repair. A replica that fails is rebuilt in its slot (fresh ranks, fresh KV), with capped
backoff (1, 2, 5, 10, 10, ... s, each scaled by a random factor in [0.5, 1] so that replicas that
failed together do not retry in lock-step), until it serves again (or `max_rebuilds` attempts in
a row, when given). `num_rebuilds` and `num_rebuild_failures` count successes and failed attempts. Requests it
held that are to run again (migration.py: those that never ran, and those that migrate with the
tokens they streamed) come back to the pool and are routed again, a migrant by its prompt and
output so far (the replica caching most of it recomputes least); meanwhile they wait in the pool's queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from dataclasses import fields

from meshserve.cluster.handover import Handoff
from meshserve.cluster.handover_stats import HandoverStats
from meshserve.cluster.replica import Replica, ReplicaState
from meshserve.cluster.replica_stats import ReplicaStats
from meshserve.core.outputs import CompletionDelta, FinishReason
from meshserve.core.tasks import cancel_and_wait
from meshserve.engine.request import Ticket
from meshserve.errors import MeshserveError, QueueFullError, ReplicaFailedError, UnavailableError

log = logging.getLogger("meshserve.pool")

REBUILD_BACKOFF_S = (0.0, 1.0, 2.0, 5.0, 10.0)  # before attempt n (the last one repeats: the cap)


def rebuild_delay(attempt: int, *, rng: random.Random | None = None) -> float:
    """Seconds to wait before rebuild attempt `attempt` (0-based): capped backoff with jitter."""
    jitter = (rng or random).uniform(0.5, 1.0)
    return REBUILD_BACKOFF_S[min(attempt, len(REBUILD_BACKOFF_S) - 1)] * jitter


class ReplicaPool:
    """build(slot) -> a new, unstarted Replica for that slot (its callbacks point back here).

    max_rebuilds: attempts in a row to rebuild a failed slot; None (the default): forever.
    """

    def __init__(self, role: str, size: int, build: Callable[[int], Replica], *, max_queue: int,
                 max_rebuilds: int | None = None) -> None:
        self.role = role
        self.size = size
        self.build = build
        self.max_queue = max_queue
        self.max_rebuilds = max_rebuilds
        self.replicas: list[Replica] = []
        self._waiting: list[Ticket | Handoff] = []  # held until a replica is ready
        self._rebuilding: dict[int, asyncio.Task] = {}
        self._failures: dict[int, str] = {}  # slot -> why its last replica failed, until rebuilt
        self._retired = _zero_stats(role)  # counters of replicas that were replaced
        self.num_rebuilds = 0
        self.num_rebuild_failures = 0

    # -- life cycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every replica at once; if any fails, stop the others and raise."""
        self.replicas = [self.build(slot) for slot in range(self.size)]
        results = await asyncio.gather(*(r.start() for r in self.replicas), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.stop()
            raise errors[0]

    async def drain(self, timeout_s: float | None) -> None:
        await asyncio.gather(*(r.drain(timeout_s) for r in self.replicas))

    async def stop(self) -> None:
        await cancel_and_wait(*self._rebuilding.values())
        self._rebuilding.clear()
        await asyncio.gather(*(r.stop() for r in self.replicas), return_exceptions=True)
        for w in self._waiting:
            self._give_up(w, "the pool was shut down")
        self._waiting.clear()

    # -- routing --------------------------------------------------------------------------------
    @property
    def ready(self) -> list[Replica]:
        return [r for r in self.replicas if r.accepting]

    @property
    def num_queued(self) -> int:
        return len(self._waiting) + sum(r.num_waiting for r in self.replicas if r.accepting)

    def admit(self) -> None:
        """Raise unless one more new request may enter this pool now."""
        if not self.ready:
            raise UnavailableError(f"no healthy replica in the {self.role} pool: {self.describe()}")
        if self.num_queued >= self.max_queue:
            raise QueueFullError(f"the {self.role} pool's queue is full ({self.num_queued} of "
                                 f"max_queue={self.max_queue} requests waiting)")

    def submit(self, ticket: Ticket) -> None:
        replica = self._pick_for_prompt(ticket.request.all_token_ids)
        if replica is None:
            self._waiting.append(ticket)
        else:
            replica.submit(ticket)

    def hand_over(self, handoff: Handoff) -> None:
        replica = self._pick_for_decode()
        if replica is None:
            self._waiting.append(handoff)
        else:
            replica.adopt(handoff)

    def abort(self, ticket: Ticket) -> bool:
        for w in self._waiting:
            if _ticket(w) is ticket:
                self._waiting.remove(w)
                _release(w)
                ticket.sink.put_nowait(CompletionDelta(ticket.request_id, [], "", True, FinishReason.ABORT))
                return True
        return any(r.abort(ticket.request_id) for r in self.replicas if r.name == ticket.holder)

    def _pick_for_prompt(self, prompt_ids: list[int]) -> Replica | None:
        ready = self.ready
        if not ready:
            return None
        if len(ready) == 1:
            return ready[0]
        return max(ready, key=lambda r: (r.cached_prefix_tokens(prompt_ids), -r.load))

    def _pick_for_decode(self) -> Replica | None:
        alive = [r for r in self.replicas if r.alive]  # draining ones too: a hand-over is never refused
        return max(alive, key=lambda r: (r.num_free_blocks, -r.load)) if alive else None

    def _dispatch_waiting(self) -> None:
        waiting, self._waiting = self._waiting, []
        for w in waiting:
            if isinstance(w, Handoff):
                self.hand_over(w)
            else:
                self.submit(w)

    # -- repair ---------------------------------------------------------------------------------
    def on_failed(self, replica: Replica, error: BaseException, orphans: list[Ticket]) -> None:
        """A replica died: route the requests it gave back again and rebuild its slot."""
        self._waiting += orphans
        slot = self.replicas.index(replica) if replica in self.replicas else None
        if slot is not None:
            self._failures[slot] = f"{replica.name} failed: {_describe_error(error)}"
        if slot is not None and slot not in self._rebuilding:
            self._rebuilding[slot] = asyncio.get_running_loop().create_task(self._rebuild(slot))
        self._dispatch_waiting()

    async def _rebuild(self, slot: int) -> None:
        old = self.replicas[slot]
        with contextlib.suppress(Exception):
            await old.stop()
        self._retire(old.stats())
        attempt = 0
        try:
            while self.max_rebuilds is None or attempt < self.max_rebuilds:
                await asyncio.sleep(rebuild_delay(attempt))
                attempt += 1
                new = self.build(slot)
                self.replicas[slot] = new
                try:
                    await new.start()
                except Exception as exc:
                    self._failures[slot] = f"rebuilding {new.name} failed: {_describe_error(exc)}"
                    self.num_rebuild_failures += 1
                    log.warning("rebuilding %s failed (attempt %d): %r", new.name, attempt, exc)
                    continue
                self._failures.pop(slot, None)
                self.num_rebuilds += 1
                log.warning("replica %s rebuilt", new.name)
                return
            log.error("giving up on %s pool slot %d after %d attempts", self.role, slot, attempt)
        finally:
            self._rebuilding.pop(slot, None)
            self._dispatch_waiting()
            if not self.ready and not self._rebuilding:
                waiting, self._waiting = self._waiting, []
                for w in waiting:
                    self._give_up(w, f"no {self.role} replica could be rebuilt")

    def _give_up(self, w: Ticket | Handoff, why: str) -> None:
        _release(w)
        _ticket(w).sink.put_nowait(ReplicaFailedError(why))

    # -- health and stats -----------------------------------------------------------------------
    def describe(self, *, problems_only: bool = False) -> str:
        """Each replica's state (problems_only: of those not ready), and why a slot's replica
        failed until it serves again."""
        states = []
        for slot, r in enumerate(self.replicas):
            failure = self._failures.get(slot)
            if problems_only and r.accepting and not failure:
                continue
            states.append(f"{r.name}: {r.state.value}" + (f" ({failure}; rebuilding)" if failure else ""))
        return ", ".join(states) or ("" if problems_only else "no replicas")

    def _retire(self, s: ReplicaStats) -> None:
        for f in ("prefix_hit_tokens", "prompt_tokens", "generated_tokens", "num_preemptions", "num_handoffs",
                  "num_kv_imports", "num_recomputes", "num_migrated", "num_migrations_refused", "num_hung",
                  "hung_detect_s", "num_grammar_written_off", "num_grammar_refused"):
            setattr(self._retired, f, getattr(self._retired, f) + getattr(s, f))
        self._retired.handover.add(s.handover)

    def stats(self) -> list[ReplicaStats]:
        """One record per live replica, plus one named '<role>-retired' for counters of replaced ones."""
        return [r.stats() for r in self.replicas] + [self._retired]

    def states(self) -> list[ReplicaState]:
        return [r.state for r in self.replicas]


def _ticket(w: Ticket | Handoff) -> Ticket:
    return w.ticket if isinstance(w, Handoff) else w


def _release(w: Ticket | Handoff) -> None:
    if isinstance(w, Handoff) and w.offer is not None:
        w.source.release(w.offer.pin_id)


def _describe_error(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, MeshserveError) else f"{type(exc).__name__}: {exc}"


def _zero_stats(role: str) -> ReplicaStats:
    zero = {f.name: 0 for f in fields(ReplicaStats)}
    return ReplicaStats(**{**zero, "name": f"{role}-retired", "role": role, "state": "retired", "kv_usage": 0.0,
                           "handover": HandoverStats(), "expert_tokens": []})
