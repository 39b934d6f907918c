"""Identical step plans for several ModelRunners (the graph tests' eager oracle and the static
path): whole prompts or prompt chunks, decodes beside them, requests leaving; KV blocks handed
out from a shuffled free list (block 0, the null block, never)."""

from __future__ import annotations

import random

from meshserve.core.sampling_params import SamplingParams
from meshserve.workers.step import NewRequest, ScheduledSeq, StepPlan


class StepDriver:
    def __init__(self, num_groups: int, *, block_size: int, num_blocks: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.free = list(range(1, num_blocks))  # block 0 is the null block
        self.rng.shuffle(self.free)
        self.num_groups, self.block_size = num_groups, block_size
        self.tables: dict[str, list[list[int]]] = {}
        self.lens: dict[str, int] = {}
        self.last: dict[str, int] = {}  # each request's last sampled token (record)
        self.step = 0

    def blocks_for(self, rid: str, seq_len: int) -> list[list[int]]:
        tables = self.tables.setdefault(rid, [[] for _ in range(self.num_groups)])
        for t in tables:
            while len(t) * self.block_size < seq_len:
                t.append(self.free.pop())
        return [list(t) for t in tables]

    def plan(self, prompts: dict[str, list[int]], decodes=(), finished=()) -> StepPlan:
        """prompts: request -> the prompt tokens this step computes (a new request's whole prompt
        or first chunk, or a later chunk of one already announced); decodes: requests whose last
        recorded token this step feeds."""
        self.step += 1
        seqs, new = [], []
        for rid, toks in prompts.items():
            ctx = self.lens.get(rid, 0)
            self.lens[rid] = ctx + len(toks)
            seqs.append(ScheduledSeq(rid, toks, ctx, self.blocks_for(rid, ctx + len(toks))))
            if ctx == 0:
                new.append(NewRequest(rid, toks, SamplingParams(max_tokens=64).to_dict()))
        for rid in decodes:
            ctx = self.lens[rid]
            self.lens[rid] += 1
            seqs.append(ScheduledSeq(rid, [self.last[rid]], ctx, self.blocks_for(rid, ctx + 1)))
        return StepPlan.from_seqs(self.step, seqs, new, finished=list(finished))

    def prefill(self, rid: str, prompt: list[int]) -> StepPlan:
        return self.plan({rid: prompt})

    def decode(self, rids: list[str], finished=()) -> StepPlan:
        return self.plan({}, rids, finished)

    def record(self, out) -> dict[str, int]:
        """The tokens a runner's StepOutput sampled, kept as the requests' last."""
        toks = {s.request_id: s.token_id for s in out.sampled}
        self.last.update(toks)
        return toks
