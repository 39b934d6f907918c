"""Continuous (in-flight) batching under a token budget, with chunked prefill and preemption.

Each step reads like this:
  1. Running requests, oldest first, each get their uncomputed tokens (1 when decoding, a
     chunk when a prompt is longer than the budget left). When the KV pool cannot take them,
     the newest running request is preempted: its blocks are freed and it goes back to the
     waiting queue to be recomputed later (its generated tokens become part of its prompt).
  2. If nothing was preempted, waiting requests are admitted oldest first while the budget,
     max_num_seqs and the pool allow. A prefix-cache hit counts its tokens as already
     computed. The queue head is never skipped: a request that does not fit blocks the ones
     behind it, so no request starves.
The step becomes one StepPlan for the workers; `update` applies their sampled tokens and the
token-level stop rules (EOS, stop token ids, max_tokens, max_model_len).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from meshserve.cluster.admission import check_prompt_length
from meshserve.cluster.request import Request, RequestStatus
from meshserve.config import SchedulerConfig
from meshserve.core.outputs import FinishReason
from meshserve.errors import check
from meshserve.workers.step import NewRequest, ScheduledSeq, StepOutput, StepPlan

if TYPE_CHECKING:
    from meshserve.kvstore.manager import KVCacheManager


@dataclass
class SchedulerStats:
    """Counters since start (for metrics and tests)."""

    num_steps: int = 0
    num_computed_tokens: int = 0  # tokens whose K/V a step computed
    num_prefix_hit_tokens: int = 0  # tokens served from the prefix cache instead
    num_preemptions: int = 0


@dataclass
class ScheduledStep:
    """A step's plan and, per scheduled request, how many tokens it computes."""

    plan: StepPlan
    requests: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, *, max_model_len: int,
                 eos_token_ids: Iterable[int] = ()) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[Request] = []  # sorted by arrival
        self.running: list[Request] = []  # sorted by arrival
        self.requests: dict[str, Request] = {}
        self._announced: set[str] = set()  # request ids the workers know
        self._to_forget: list[str] = []  # finished ids to tell the workers in the next plan
        self._step_id = 0
        self.stats = SchedulerStats()

    # -- requests in and out ---------------------------------------------------------------

    def check_request(self, request: Request, *, bounded: bool = True) -> None:
        """Refuse a request that could never run, before anything is queued. bounded=False skips
        the queue bound (a request handed over from another replica must not be refused)."""
        check_prompt_length(len(request.prompt_ids), max_model_len=self.max_model_len, scheduler=self.config)
        check(request.request_id not in self.requests, "request_id", request.request_id, "an id not in use")
        check(not bounded or len(self.waiting) < self.config.max_queue, "max_queue", self.config.max_queue,
              f"more than {len(self.waiting)} waiting requests (queue full)")

    def add_request(self, request: Request, *, bounded: bool = True) -> None:
        self.check_request(request, bounded=bounded)
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=lambda r: r.arrival)

    def add_running(self, request: Request, num_computed_tokens: int) -> None:
        """Admit a request whose first `num_computed_tokens` tokens already have their K/V in the
        cache (a hand-over: `kv` holds its blocks). It is scheduled from the next step on."""
        check(request.request_id not in self.requests, "request_id", request.request_id, "an id not in use")
        check(request.request_id in self.kv, "request_id", request.request_id, "an id holding imported blocks")
        check(0 < num_computed_tokens < request.num_tokens, "num_computed_tokens", num_computed_tokens,
              f"an integer in [1, {request.num_tokens - 1}]")
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed_tokens
        request.sent_table_lens = None
        self.requests[request.request_id] = request
        bisect.insort(self.running, request, key=lambda r: r.arrival)

    def detach(self, request_id: str) -> Request:
        """Remove an unfinished request without finishing it (it continues on another replica):
        its blocks are freed and the workers forget it. The request comes back ready to adopt."""
        req = self.requests.pop(request_id)
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.kv.free(req.request_id)
        else:
            self.waiting.remove(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.sent_table_lens = None
        if req.request_id in self._announced:
            self._announced.discard(req.request_id)
            self._to_forget.append(req.request_id)
        return req

    def abort(self, request_id: str) -> Request | None:
        """Finish a request as aborted, freeing its blocks. None if unknown or already finished."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        self._finish(req, FinishReason.ABORT)
        return req

    def finish(self, request: Request, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        """Finish a request for a reason decided outside (a stop string)."""
        if not request.is_finished:
            self._finish(request, reason, stop_reason)

    def _finish(self, req: Request, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.kv.free(req.request_id)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        req.finish(reason, stop_reason)
        del self.requests[req.request_id]
        if req.request_id in self._announced:
            self._announced.discard(req.request_id)
            self._to_forget.append(req.request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished(self) -> bool:
        return self.num_unfinished > 0

    # -- one step ----------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        max_len, running = self.max_model_len, RequestStatus.RUNNING
        for req in list(self.running):  # per running request every step: kept lean
            if budget == 0:
                break
            if req.status is not running:
                continue  # preempted earlier in this loop
            pending = req.num_pending_outputs
            num_tokens = len(req.all_token_ids)  # = req.num_tokens
            if (pending and req.ends_with_pending) or num_tokens + pending >= max_len:
                continue  # the token still being drawn finishes it (overlap scheduling)
            n = min(num_tokens + pending - req.num_computed_tokens, budget)  # its uncomputed tokens
            while not self.kv.allocate_slots(req.request_id, n, req.all_token_ids):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                scheduled.append((req, n))
                budget -= n
        if not preempted:
            budget = self._admit(budget, scheduled)
        return ScheduledStep(self._plan(scheduled), scheduled, preempted)

    def _admit(self, budget: int, scheduled: list[tuple[Request, int]]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.num_pending_outputs:
                break  # preempted while a token of it was being drawn: resumes once that token is known
            hit = self.kv.lookup_prefix(req.all_token_ids)
            cached = hit.num_tokens
            n = req.num_tokens - cached
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not self.kv.allocate_slots(req.request_id, n, req.all_token_ids, prefix=hit):
                break  # the head waits for blocks; nobody overtakes it
            self.waiting.pop(0)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = cached
            req.sent_table_lens = None  # new blocks: the workers get the tables whole
            self.stats.num_prefix_hit_tokens += cached
            if req.num_preemptions == 0:
                req.num_cached_tokens = cached
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n
        return budget

    def _preempt(self, req: Request) -> None:
        """Recompute later: free the blocks, requeue by arrival (ahead of younger requests)."""
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.sent_table_lens = None
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        bisect.insort(self.waiting, req, key=lambda r: r.arrival)

    def _plan(self, scheduled: Sequence[tuple[Request, int]]) -> StepPlan:
        seqs, new, announced = [], [], self._announced
        for req, n in scheduled:  # per running request every step: kept lean
            rid = req.request_id
            if rid not in announced:
                announced.add(rid)
                new.append(NewRequest(rid, req.prompt_ids, req.params.to_dict(), list(req.output_ids)))
            start, known = req.num_computed_tokens, len(req.all_token_ids)  # = req.num_tokens
            sample = start + n == known + req.num_pending_outputs
            tables, offsets = self._table_changes(req)
            # (request_id, token_ids, context_len, block_tables, sample, from_last_step, table_offsets);
            # from_last_step: the token the step in flight draws for it
            seqs.append(ScheduledSeq(rid, req.all_token_ids[start:min(start + n, known)], start, tables, sample,
                                     start + n > known, offsets))
            req.num_computed_tokens = start + n
            req.num_pending_outputs += sample
        self.stats.num_steps += bool(seqs)
        self.stats.num_computed_tokens += sum(n for _, n in scheduled)
        plan = StepPlan(self._step_id, seqs, new, self._to_forget, copies=self.kv.take_copies())
        self._to_forget = []
        self._step_id += 1
        return plan

    def _table_changes(self, req: Request) -> tuple[list[list[int]], list[int] | None]:
        """What a plan carries of the request's block tables: whole the first time (offsets None),
        afterwards per group the blocks from the last one the workers hold on (a copy-on-write
        replaces only a table's last block; new blocks are appended), or nothing at the table's
        end when neither happened (most decode steps). Entries the window released are not
        resent: the workers' stale ids there are never read (outside every window)."""
        tables = self.kv.block_tables(req.request_id)
        sent, tails = req.sent_table_lens, req.sent_table_tails
        if sent is None:
            req.sent_table_lens = [len(t) for t in tables]
            req.sent_table_tails = [t[-1] if t else -1 for t in tables]
            return [list(t) for t in tables], None
        if len(tables) == 1:  # most models: one group, the decode step's common case without a loop
            t = tables[0]
            n = len(t)
            if n == sent[0] and (not n or t[-1] == tails[0]):
                return [[]], [n]
        changes, offsets = [], []
        for g, t in enumerate(tables):
            n = len(t)
            if n == sent[g] and (not n or t[-1] == tails[g]):
                changes.append([])
                offsets.append(n)
                continue
            o = max(sent[g] - 1, 0)
            changes.append(t[o:])
            offsets.append(o)
            sent[g], tails[g] = n, t[-1] if n else -1
        return changes, offsets

    def update(self, step: ScheduledStep, output: StepOutput) -> list[Request]:
        """Apply a step's results; returns the requests that received a token (some now finished).

        With overlap scheduling the next step is already planned: a request finished here may
        be in it, and its token there is dropped (the request is finished by then)."""
        tokens = {s.request_id: s for s in output.sampled}
        touched = []
        for req, _ in step.requests:
            if req.is_finished:
                continue  # aborted or stopped while the step ran
            sampled = tokens.get(req.request_id)
            if sampled is None:
                continue  # a prompt chunk that is not the last
            req.num_pending_outputs -= 1
            req.append_output(sampled.token_id)
            if sampled.logprobs is not None:
                req.output_logprobs.append(sampled.logprobs)
            touched.append(req)
            self._check_stop(req, sampled.token_id)
        return touched

    def _check_stop(self, req: Request, token: int) -> None:
        p = req.params
        if not p.ignore_eos and token in self.eos_token_ids:
            self._finish(req, FinishReason.STOP)
        elif token in p.stop_token_ids:
            self._finish(req, FinishReason.STOP, token)
        elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            self._finish(req, FinishReason.LENGTH)
