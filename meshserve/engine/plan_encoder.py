"""`PlanEncoder`: turns a step's scheduling decisions into the StepPlan its workers run.

The scheduler decides which requests run and how many tokens each computes (and updates their
counts); the encoder says it on the wire and remembers what the workers hold, so that a plan
carries only what changed:
- a request the workers have not seen is announced once (`NewRequest`: prompt, settings);
- a request's block tables go whole the first time (and after new blocks replaced them:
  admission, preemption, a fork, a hand-over), afterwards per KV layer group only the blocks
  from the last one the workers hold (a copy-on-write replaces only a table's last block; new
  blocks are appended); entries a window released are never resent (the workers' stale ids
  there are never read);
- a decode row that just continues (one token, a sample after it, no table change) goes in the
  plan's columnar block (workers/step.py DecodeRows); every other row is a ScheduledSeq;
- requests that left (finished, detached) are named once in `finished` so workers forget them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from meshserve.engine.request import Request
from meshserve.workers.step import DecodeRows, NewRequest, ScheduledSeq, StepPlan

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

    def encode(self, rows: Sequence[RowDecision]) -> StepPlan:
        seqs, new, announced, tables_of, sent_of = [], [], self._announced, self.kv.block_tables, self._sent
        # Rows that just continue (workers/step.py DecodeRows): (id, token, context, from_last_step); table lens
        decodes, decode_lens = [], []
        for row in rows:  # per running request every step: kept lean
            req, start, n, sample = row.request, row.start, row.num_tokens, row.sample
            rid = req.request_id
            if rid not in announced:
                announced.add(rid)
                new.append(NewRequest(rid, req.prompt_ids, req.params.to_dict(), list(req.output_ids),
                                      list(req.encoder_ids or ())))
            all_ids = req.all_token_ids
            known = len(all_ids)  # = req.num_tokens
            sent, tables = sent_of.get(rid), None
            if n == 1 and sample and start and sent is not None:  # a decode: does it just continue?
                if len(sent.lens) == 1:  # one KV group (most models): no new block, no copied last block
                    table, held = tables_of(rid)[0], sent.lens[0]
                    quiet = len(table) == held and (not held or table[-1] == sent.tails[0])
                else:
                    tables, offsets = self._table_changes(rid)
                    quiet = not any(tables)
                if quiet:
                    last = start >= known  # from_last_step: the token the step in flight draws for it
                    decodes.append((rid, 0 if last else all_ids[start], start, last))
                    decode_lens.append(sent.lens)  # = the tables' lengths
                    continue
            if tables is None:
                tables, offsets = self._table_changes(rid)
            encoder = list(req.encoder_blocks) if offsets is None and req.encoder_ids is not None else None
            seqs.append(ScheduledSeq(rid, all_ids[start:min(start + n, known)], start, tables, sample,
                                     start + n > known, offsets, encoder))
        decode_rows = None
        if decodes:
            ids, tokens, contexts, lasts = zip(*decodes)
            decode_rows = DecodeRows(list(ids), np.array(tokens, np.int64), np.array(contexts, np.int64),
                                     np.array(lasts, bool), np.array(decode_lens, np.int64).reshape(len(ids), -1))
        plan = StepPlan(self._step_id, seqs, new, self._to_forget, copies=self.kv.take_copies(), decodes=decode_rows)
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
