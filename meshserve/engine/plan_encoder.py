"""`PlanEncoder`: turns a step's scheduling decisions into the StepPlan its workers run.

The scheduler decides which requests run and how many tokens each computes (and updates their
counts); the encoder says it on the wire and remembers what the workers hold, so that a plan
carries only what changed:
- a request the workers have not seen is announced once (`NewRequest`: prompt, settings), with
  its first row, or alone (a request waiting for its grammar, which the driver compiles meanwhile);
- a request's block tables go whole the first time (and after new blocks replaced them:
  admission, preemption, a fork, a hand-over), afterwards per KV layer group only the blocks
  from the last one the workers hold (a copy-on-write replaces only a table's last block; new
  blocks are appended); entries a window released are never resent (the workers' stale ids
  there are never read);
- a new request's first row goes with its announcement (its tables whole); the rows of every
  other request go in the plan's columnar block (workers/step.py CachedRows), a decode that
  neither got a block nor copied one carrying no table change at all;
- requests that left (finished, detached) are named once in `finished` so workers forget them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshserve.engine.request import Request
from meshserve.errors import check
from meshserve.workers.step import CachedRows, NewRequest, StepPlan

if TYPE_CHECKING:
    from meshserve.kvstore.manager import KVCacheManager


@dataclass(slots=True)
class RowDecision:
    """What the scheduler decided for one request this step."""

    request: Request
    start: int  # tokens computed before this step (the first new token's position)
    num_tokens: int  # tokens this step computes, the one being drawn by the step in flight included
    sample: bool  # whether a token is drawn after the last of them


@dataclass(slots=True)
class _Sent:
    """Per KV layer group, how many blocks of a request's tables its workers hold and the last
    block id sent (-1: none)."""

    lens: list[int]
    tails: list[int]


_NO_CHANGE = ([],)  # one group, no block: a row that just continues


class PlanEncoder:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self._announced: set[str] = set()  # request ids the workers know
        self._sent: dict[str, _Sent] = {}  # request id -> the tables its workers hold
        self._to_forget: list[str] = []  # ids to tell the workers in the next plan
        self._step_id = 0

    def resend_tables(self, request_id: str) -> None:
        """The request's blocks were replaced (admitted, preempted, forked, imported): the next
        plan carries its tables whole."""
        self._sent.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """The request left this replica (finished or detached): the next plan tells the workers."""
        self._sent.pop(request_id, None)
        if request_id in self._announced:
            self._announced.discard(request_id)
            self._to_forget.append(request_id)

    def encode(self, rows: Sequence[RowDecision], *, announce: Sequence[Request] = (),
               grammar_timeout_s: float = 0.0) -> StepPlan:
        """announce: requests to make known to the workers without a row (they have none this step),
        whose grammars the driver compiles meanwhile, giving up after grammar_timeout_s."""
        new, announced, tables_of, sent_of = [], self._announced, self.kv.block_tables, self._sent
        for req in announce:
            if req.request_id not in announced:
                announced.add(req.request_id)
                new.append(NewRequest(req.request_id, req.prompt_ids, req.params.to_dict(), list(req.output_ids),
                                      list(req.encoder_ids or ()), num_tokens=0, sample=False,
                                      grammar_timeout_s=grammar_timeout_s))
        # The cached rows' columns (workers/step.py CachedRows).
        ids, num_tokens, tokens, contexts, samples, lasts, offsets, counts, blocks = [], [], [], [], [], [], [], [], []
        encoder_tables = {}
        for row in rows:  # per running request every step: kept lean
            req, start, n, sample = row.request, row.start, row.num_tokens, row.sample
            rid = req.request_id
            all_ids = req.all_token_ids
            known = len(all_ids)  # = req.num_tokens
            end = min(start + n, known)  # the tokens past `known`: the one the step in flight draws
            if rid not in announced:
                announced.add(rid)
                check(end == start + n, "num_tokens", n, f"the tokens {rid} has (a new request's first row "
                      "needs no token from a step in flight)")
                tables, _ = self._table_changes(rid)
                new.append(NewRequest(rid, req.prompt_for_workers, req.params.to_dict(), list(req.output_ids),
                                      list(req.encoder_ids or ()), start, n, sample, tables,
                                      None if req.encoder_ids is None else list(req.encoder_blocks)))
                continue
            sent, changes = sent_of.get(rid), None
            if sent is not None and len(sent.lens) == 1:  # one KV group (most models): does the row
                table, held = tables_of(rid)[0], sent.lens[0]  # just continue (no new block, no copied one)?
                if len(table) == held and (not held or table[-1] == sent.tails[0]):
                    changes, row_offsets = _NO_CHANGE, (held,)
            if changes is None:
                changes, row_offsets = self._table_changes(rid)
                if row_offsets is None:  # resent whole (new blocks after a preemption)
                    row_offsets = [0] * len(changes)
                    if req.encoder_ids is not None:
                        encoder_tables[rid] = list(req.encoder_blocks)
            ids.append(rid)
            num_tokens.append(end - start)
            tokens.extend(all_ids[start:end])
            contexts.append(start)
            samples.append(sample)
            lasts.append(end < start + n)
            offsets.extend(row_offsets)
            for change in changes:
                counts.append(len(change))
                blocks.extend(change)
        cached = None
        if ids:
            cached = CachedRows.of(ids, num_tokens, tokens, contexts, samples, lasts, offsets, counts, blocks,
                                   encoder_tables)
        plan = StepPlan(self._step_id, new, cached, self._to_forget, copies=self.kv.take_copies())
        self._to_forget = []
        self._step_id += 1
        return plan

    def _table_changes(self, request_id: str) -> tuple[list[list[int]], list[int] | None]:
        """What a plan carries of the request's block tables: whole the first time (offsets None),
        afterwards per group the blocks from the last one the workers hold on, or nothing at the
        table's end when neither a new block nor a copied last block came (most decode steps)."""
        tables = self.kv.block_tables(request_id)
        sent = self._sent.get(request_id)
        if sent is None:
            self._sent[request_id] = _Sent([len(t) for t in tables], [t[-1] if t else -1 for t in tables])
            return [list(t) for t in tables], None
        lens, tails = sent.lens, sent.tails
        changes, offsets = [], []
        for g, t in enumerate(tables):
            n = len(t)
            if n == lens[g] and (not n or t[-1] == tails[g]):
                changes.append([])
                offsets.append(n)
                continue
            o = max(lens[g] - 1, 0)
            changes.append(t[o:])
            offsets.append(o)
            lens[g], tails[g] = n, t[-1] if n else -1
        return changes, offsets
