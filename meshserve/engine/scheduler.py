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
A request with structured_outputs is announced to the workers when it enters (the driver rank
starts compiling its grammar) and takes no step, nor a place at the head of the queue, until the
driver reports the grammar compiled (vLLM's WAITING_FOR_FSM): a slow compile delays that request
alone. A compile that fails, or takes longer than `grammar_compile_timeout_s`, finishes that
request alone with FinishReason.ERROR and the error for its caller.
The scheduler decides; its PlanEncoder (engine/plan_encoder.py) turns the step's decisions into
the StepPlan the workers run. `update` applies their sampled tokens and the token-level stop
rules (EOS, stop token ids, max_tokens, max_model_len).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from meshserve.config import SchedulerConfig
from meshserve.core.arith import cdiv
from meshserve.core.outputs import FinishReason
from meshserve.engine.admission import check_prompt_length
from meshserve.engine.plan_encoder import PlanEncoder, RowDecision
from meshserve.engine.request import Request, RequestStatus
from meshserve.errors import UnavailableError, check
from meshserve.workers.step import StepOutput, StepPlan

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
    polls: bool = False  # the plan goes out without rows: requests wait for their grammars

    @property
    def is_empty(self) -> bool:
        return not self.requests and not self.polls


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
        self.awaiting_grammar: dict[str, Request] = {}  # waiting or running, not scheduled until compiled
        self._to_announce: list[Request] = []  # awaiting ones the next plan makes known to the workers
        self.encoder = PlanEncoder(kv)  # what the workers hold; the wire plans
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
        self._await_grammar(request)
        bisect.insort(self.waiting, request, key=lambda r: r.arrival)

    def _await_grammar(self, request: Request) -> None:
        """A request entering this replica with a grammar waits for the driver rank to compile it
        (a request handed over or migrated here waits again: its grammar is this driver's to
        compile). A group's prompt-only root samples nothing, so it does not wait."""
        request.awaiting_grammar = request.params.structured_outputs is not None and request.fork_into is None
        if request.awaiting_grammar:
            self.awaiting_grammar[request.request_id] = request
            self._to_announce.append(request)

    def add_running(self, request: Request, num_computed_tokens: int) -> None:
        """Admit a request whose first `num_computed_tokens` tokens already have their K/V in the
        cache (a hand-over: `kv` holds its blocks). It is scheduled from the next step on."""
        check(request.request_id not in self.requests, "request_id", request.request_id, "an id not in use")
        check(request.request_id in self.kv, "request_id", request.request_id, "an id holding imported blocks")
        check(0 < num_computed_tokens < request.num_tokens, "num_computed_tokens", num_computed_tokens,
              f"an integer in [1, {request.num_tokens - 1}]")
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed_tokens
        self.encoder.resend_tables(request.request_id)
        self.requests[request.request_id] = request
        self._await_grammar(request)
        bisect.insort(self.running, request, key=lambda r: r.arrival)

    def detach(self, request_id: str) -> Request:
        """Remove an unfinished request without finishing it (it continues on another replica):
        its blocks are freed and the workers forget it. The request comes back ready to adopt."""
        req = self.requests.pop(request_id)
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self._free_blocks(req)
        else:
            self.waiting.remove(req)
        self.awaiting_grammar.pop(request_id, None)
        req.awaiting_grammar = False
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        self.encoder.forget(req.request_id)
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
            self._free_blocks(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        if req.awaiting_grammar:
            del self.awaiting_grammar[req.request_id]
            req.awaiting_grammar = False
        req.finish(reason, stop_reason)
        del self.requests[req.request_id]
        self.encoder.forget(req.request_id)

    def _free_blocks(self, req: Request) -> None:
        """Every block of a request leaving the running set: its tables and its encoder blocks."""
        self.kv.free(req.request_id)
        if req.encoder_blocks:
            self.kv.pool.free(req.encoder_blocks)
            req.encoder_blocks = []

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
        max_len, running, allocate = self.max_model_len, RequestStatus.RUNNING, self.kv.allocate_slots
        for req in list(self.running):  # per running request every step: kept lean
            if budget == 0:
                break
            if req.status is not running or req.held or req.awaiting_grammar:
                continue  # preempted earlier in this loop, or waiting for its search's choice or its grammar
            pending, all_ids = req.num_pending_outputs, req.all_token_ids
            num_tokens = len(all_ids)  # = req.num_tokens
            if (pending and len(req.output_ids) + pending >= req.params.max_tokens) or num_tokens + pending >= max_len:
                continue  # the token being drawn surely finishes it (max_tokens, max_model_len): not past it
            if req.hand_over_at and len(req.output_ids) + pending >= req.hand_over_at:
                continue  # handed over (cluster/handover.py) once the tokens drawn so far are known
            n = num_tokens + pending - req.num_computed_tokens  # its uncomputed tokens
            if n > budget:
                n = budget
            while not allocate(req.request_id, n, all_ids):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is running:
                scheduled.append((req, n))
                budget -= n
        if not preempted:
            budget = self._admit(budget, scheduled)
        plan = self._plan(scheduled)
        self._fork_groups(scheduled)
        return ScheduledStep(plan, scheduled, preempted, polls=bool(self.awaiting_grammar))

    def _admit(self, budget: int, scheduled: list[tuple[Request, int]]) -> int:
        while self.waiting and budget > 0 and self._seats_taken() < self.config.max_num_seqs:
            # Held ones wait for their search, awaiting ones for their grammar: neither blocks the queue.
            req = next((r for r in self.waiting if not r.held and not r.awaiting_grammar), None)
            if req is None or req.num_pending_outputs:
                break  # (pending: preempted while a token of it was drawn; resumes once that token is known)
            if req.fork_into and self.running and self._seats_taken() + len(req.fork_into) > self.config.max_num_seqs:
                break  # an n / best_of group's sequences run side by side
            if req.encoder_ids is not None:  # encoder-decoder: see _admit_encoder_decoder
                hit, n = None, self._admit_encoder_decoder(req, budget)
                if n == 0:
                    break
                cached, budget = 0, budget - len(req.encoder_ids)
            else:  # (prompt_logprobs: every prompt position's logits are needed, none come from the cache)
                hit = self.kv.lookup_prefix(req.all_token_ids) if req.params.prompt_logprobs is None else None
                cached = hit.num_tokens if hit is not None else 0
                n = req.num_tokens - cached
                if n > budget and not self.config.enable_chunked_prefill:
                    break
                n = min(n, budget)
                if not self.kv.allocate_slots(req.request_id, n, req.all_token_ids, prefix=hit):
                    if self._preempt_held():
                        continue  # a held request's blocks go to one that can run
                    break  # the head waits for blocks; nobody overtakes it
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = cached
            self.encoder.resend_tables(req.request_id)  # new blocks: the workers get the tables whole
            self.stats.num_prefix_hit_tokens += cached
            if req.num_preemptions == 0:
                req.num_cached_tokens = cached
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n
        return budget

    def _seats_taken(self) -> int:
        """Sequences running, counting each running n / best_of root as the samples it will fork
        into (admission must not promise two groups the same seats)."""
        return len(self.running) + sum(len(r.fork_into) - 1 for r in self.running if r.fork_into)

    def fork(self, parent: Request, child: Request) -> None:
        """Add `child`, which continues `parent`'s computed tokens with tokens of its own (a sample
        of an n group, a beam): running on parent's blocks, shared copy-on-write, when parent
        holds them; otherwise waiting, to be computed from its tokens like a preempted request."""
        check(child.request_id not in self.requests, "request_id", child.request_id, "an id not in use")
        check(child.all_token_ids[:parent.num_computed_tokens] == parent.all_token_ids[:parent.num_computed_tokens],
              "child", child.request_id, f"a continuation of {parent.request_id}'s computed tokens")
        self.requests[child.request_id] = child
        self._await_grammar(child)
        self.encoder.resend_tables(child.request_id)
        if parent.status is RequestStatus.RUNNING and parent.num_computed_tokens > 0:
            check(self.kv.num_tokens(parent.request_id) == parent.num_computed_tokens, "parent",
                  parent.request_id, "a request whose every allocated slot is scheduled")
            self.kv.fork(parent.request_id, child.request_id)
            child.status = RequestStatus.RUNNING
            child.num_computed_tokens = parent.num_computed_tokens
            bisect.insort(self.running, child, key=lambda r: r.arrival)
        else:
            child.status = RequestStatus.WAITING
            child.num_computed_tokens = 0
            bisect.insort(self.waiting, child, key=lambda r: r.arrival)

    def _fork_groups(self, scheduled: Sequence[tuple[Request, int]]) -> None:
        """Roots of n / best_of groups whose prompt is now scheduled hand their blocks to their
        samples and leave: each sample computes the prompt's last token itself (its first write
        copies the shared partial block) and draws its own first token from it."""
        for req, _ in scheduled:
            if req.fork_into is not None and req.num_computed_tokens == req.num_tokens and not req.is_finished:
                for child in req.fork_into:
                    self.fork(req, child)
                self._finish(req, FinishReason.STOP)

    def _preempt_held(self) -> bool:
        """Preempt the newest held running request (it waits for its search's choice or its
        grammar, so it would keep blocks idle); False if there is none."""
        held = next((r for r in reversed(self.running) if r.held or r.awaiting_grammar), None)
        if held is not None:
            self._preempt(held)
        return held is not None

    def _admit_encoder_decoder(self, req: Request, budget: int) -> int:
        """Blocks for an encoder-decoder request's first step, which runs its whole encoder input
        (never chunked: admission refuses one that leaves no room in a step's budget) and as many
        of its decoder tokens as fit beside it (the start tokens; after a preemption also the
        outputs to recompute, whose rest follow as chunks). No prefix lookup: the decoder's
        tokens mean nothing without the encoder's (the same start token begins every request),
        and the cross K/V are the request's own. Returns the decoder tokens scheduled, 0 when
        the step's budget or the pool cannot take it now (nothing is held then)."""
        n = min(req.num_tokens, budget - len(req.encoder_ids))
        if n < 1:
            return 0
        pool = self.kv.pool
        num_encoder_blocks = cdiv(len(req.encoder_ids), self.kv.tokens_per_block)
        if not pool.can_allocate(num_encoder_blocks + self.kv.blocks_needed(req.request_id, n)):
            return 0
        req.encoder_blocks = pool.allocate(num_encoder_blocks)
        if not self.kv.allocate_slots(req.request_id, n, req.all_token_ids):
            pool.free(req.encoder_blocks)  # not expected after the check above; hold nothing
            req.encoder_blocks = []
            return 0
        return n

    def _preempt(self, req: Request) -> None:
        """Recompute later: free the blocks, requeue by arrival (ahead of younger requests)."""
        self.running.remove(req)
        self._free_blocks(req)
        self.encoder.resend_tables(req.request_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        bisect.insort(self.waiting, req, key=lambda r: r.arrival)

    def _plan(self, scheduled: Sequence[tuple[Request, int]]) -> StepPlan:
        """Commit the step's decisions to its requests (computed tokens, a token being drawn,
        held for a search) and have the encoder say them on the wire."""
        rows = []
        for req, n in scheduled:  # per running request every step: kept lean
            start = req.num_computed_tokens
            sample = start + n == len(req.all_token_ids) + req.num_pending_outputs and req.fork_into is None
            req.num_computed_tokens = start + n
            req.num_pending_outputs += sample
            req.held |= sample and req.chosen_by_search
            rows.append(RowDecision(req, start, n, sample))
        self.stats.num_steps += bool(scheduled)
        self.stats.num_computed_tokens += sum(n for _, n in scheduled)
        announce, self._to_announce = self._to_announce, []
        return self.encoder.encode(rows, announce=[r for r in announce if r.awaiting_grammar],
                                   grammar_timeout_s=self.config.grammar_compile_timeout_s)

    def update(self, step: ScheduledStep, output: StepOutput) -> list[Request]:
        """Apply a step's results; returns the requests that received a token (some now finished).

        With overlap scheduling the next step is already planned: a request finished here may
        be in it, and its token there is dropped (the request is finished by then)."""
        row_of = dict(zip(output.request_ids, range(len(output.request_ids))))
        tokens, logprobs = output.token_ids, output.logprobs
        if output.prompt_logprobs:  # (requests asking for prompt_logprobs)
            ran = {req.request_id: req for req, _ in step.requests}  # (a group root forked and left by now)
            for rid, items in output.prompt_logprobs.items():
                req = ran.get(rid)
                if req is not None:
                    for i, lp in items:
                        req.prompt_logprobs.setdefault(i, lp)
        touched, finished = [], RequestStatus.FINISHED
        if self.awaiting_grammar:
            touched += self._grammar_outcomes(output)
        for req, _ in step.requests:  # per running request every step: kept lean
            if req.status is finished:
                continue  # aborted or stopped while the step ran
            i = row_of.get(req.request_id)
            if i is None:
                continue  # a prompt chunk that is not the last
            token = tokens[i]
            req.num_pending_outputs -= 1
            req.append_output(token)
            if logprobs and i in logprobs:
                req.output_logprobs.append(logprobs[i])
            touched.append(req)
            self._check_stop(req, token)
        return touched

    def _grammar_outcomes(self, output: StepOutput) -> list[Request]:
        """Let the requests whose grammar the driver compiled be scheduled; finish those whose
        compile failed or passed the bound (returned, each with its `error`). The driver decides
        both (its clock, not this one's: the schedulers of SPMD ranks must agree)."""
        for rid in output.grammars_ready:
            req = self.awaiting_grammar.pop(rid, None)
            if req is not None:
                req.awaiting_grammar = False
        failed = []
        for rid, reason in output.grammar_errors.items():
            req = self.awaiting_grammar.get(rid)
            if req is not None:
                self._finish(req, FinishReason.ERROR)
                req.error = req.params.structured_outputs.not_compiled(reason)
                failed.append(req)
        for rid, reason in output.grammar_busy.items():  # the server's state, not the grammar: 503
            req = self.awaiting_grammar.get(rid)
            if req is not None:
                self._finish(req, FinishReason.ERROR)
                req.error = UnavailableError(f"structured_outputs: {reason}")
                failed.append(req)
        return failed

    def _check_stop(self, req: Request, token: int) -> None:
        p = req.params
        if not p.ignore_eos and token in self.eos_token_ids:
            self._finish(req, FinishReason.STOP)
        elif token in p.stop_token_ids:
            self._finish(req, FinishReason.STOP, token)
        elif len(req.output_ids) >= p.max_tokens or len(req.all_token_ids) >= self.max_model_len:
            self._finish(req, FinishReason.LENGTH)
