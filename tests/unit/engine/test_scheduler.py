"""Scheduler against a fake worker that keeps tokens in a paged 'cache' addressed by block tables.

The fake model's next token is a fixed function of the whole sequence so far, read back
through the block table. A wrong block table, a wrong context length, a prefix-cache block
with other contents or a recompute that skips tokens changes (or breaks) the output, which
must equal one-request-at-a-time generation.
"""

import pytest

from meshserve.config import SchedulerConfig
from meshserve.core.outputs import FinishReason
from meshserve.core.sampling_params import SamplingParams
from meshserve.engine.request import Request, RequestStatus
from meshserve.engine.scheduler import Scheduler
from meshserve.errors import ConfigError
from meshserve.kvstore.manager import KVCacheManager
from meshserve.workers.step import SampledToken, StepOutput, StepPlan, apply_table_changes

BS = 4
EOS = 0


def next_token(prefix):
    return 1 + sum((i + 7) * t for i, t in enumerate(prefix)) % 97


class FakeWorker:
    """Keeps each request's tables (plans carry what changed) and its tokens in slots."""

    def __init__(self):
        self.slots: dict[int, int] = {}
        self.known: set[str] = set()
        self.tables: dict[str, list[list[int]]] = {}
        self.computed_tokens = 0

    def execute(self, plan: StepPlan) -> StepOutput:
        plan = StepPlan.from_msgpack(plan.to_msgpack())
        self.known |= {r.request_id for r in plan.new_requests}
        out = [tok for s in plan.all_seqs() if (tok := self.compute(s, list(s.token_ids))) is not None]
        self.known -= set(plan.finished)
        return StepOutput.of(plan.step_id, out)

    def compute(self, s, tokens: list[int]) -> SampledToken | None:
        """Store the seq's new `tokens` through its tables; its next token when it samples."""
        assert s.request_id in self.known
        assert len(tokens) == s.num_new_tokens
        self.tables[s.request_id] = apply_table_changes(self.tables.get(s.request_id, [[]]), s)
        table = self.tables[s.request_id][0]
        self.computed_tokens += len(tokens)
        for i, t in enumerate(tokens):
            pos = s.context_len + i
            self.slots[table[pos // BS] * BS + pos % BS] = t
        if not s.sample:
            return None
        prefix = [self.slots[table[p // BS] * BS + p % BS] for p in range(s.seq_len)]
        return SampledToken(s.request_id, next_token(prefix))


def reference(prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


def run(sched, worker, max_steps=10_000, on_step=None):
    steps = 0
    while sched.has_unfinished():
        step = sched.schedule()
        if on_step:
            on_step(step)
        sched.update(step, worker.execute(step.plan))
        steps += 1
        assert steps < max_steps
    return steps


def make(num_blocks=64, max_model_len=128, **cfg):
    kv = KVCacheManager(num_blocks, BS)
    return Scheduler(SchedulerConfig(**cfg), kv, max_model_len=max_model_len, eos_token_ids=[EOS]), kv


def req(i, prompt, max_tokens=10, **kw):
    return Request(f"r{i}", list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens, **kw), arrival=i)


PROMPTS = [[(7 * i + j) % 50 + 3 for j in range(5 + 6 * i)] for i in range(6)]


def test_continuous_batching_respects_budget_and_max_seqs():
    sched, kv = make(max_num_batched_tokens=16, max_num_seqs=3)
    reqs = [req(i, p) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        sched.add_request(r)
    worker = FakeWorker()

    def check(step):
        assert sum(len(s.token_ids) for s in step.plan.all_seqs()) <= 16
        assert len(sched.running) <= 3
        # chunks that do not end the known tokens do not sample (a step advances num_computed_tokens
        # as it is scheduled)
        for r, _ in step.requests:
            assert (r.num_computed_tokens == r.num_tokens) == next(
                s.sample for s in step.plan.all_seqs() if s.request_id == r.request_id)

    run(sched, worker, on_step=check)
    for r, p in zip(reqs, PROMPTS):
        assert r.output_ids == reference(p, 10)
        assert r.finish_reason is FinishReason.LENGTH
    assert kv.num_free_blocks == 63


def test_chunked_prefill_splits_a_long_prompt():
    sched, _ = make(max_num_batched_tokens=8)
    r = req(0, list(range(3, 40)), max_tokens=3)
    sched.add_request(r)
    chunks = []
    run(sched, FakeWorker(), on_step=lambda s: chunks.append([len(x.token_ids) for x in s.plan.all_seqs()]))
    assert chunks[:5] == [[8], [8], [8], [8], [5]]
    assert r.output_ids == reference(list(range(3, 40)), 3)


def test_without_chunked_prefill_a_prompt_over_budget_is_refused():
    sched, _ = make(max_num_batched_tokens=8, enable_chunked_prefill=False)
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        sched.add_request(req(0, list(range(3, 20))))
    assert not sched.has_unfinished()


def test_preemption_by_recompute_keeps_outputs_and_order():
    # 12 blocks of 4 tokens: six prompts plus 20 outputs each cannot all stay resident.
    sched, kv = make(num_blocks=12, max_model_len=48, max_num_batched_tokens=32)
    reqs = [req(i, p, max_tokens=20) for i, p in enumerate(PROMPTS[:4])]
    for r in reqs:
        sched.add_request(r)
    preempted = []
    run(sched, FakeWorker(), on_step=lambda s: preempted.extend(v.request_id for v in s.preempted))
    assert preempted, "the pool was meant to run out"
    for r, p in zip(reqs, PROMPTS):
        assert r.output_ids == reference(p, 20)
    # the newest running request is the one preempted; the oldest never is
    assert "r0" not in preempted
    assert kv.num_free_blocks == 11


def test_fcfs_admission_and_no_overtaking():
    sched, _ = make(num_blocks=10, max_model_len=40, max_num_batched_tokens=64)
    big = req(0, list(range(3, 30)), max_tokens=4)  # needs 8 blocks
    small = [req(i, [5, 6], max_tokens=2) for i in range(1, 4)]
    for r in [big, *small]:
        sched.add_request(r)
    admitted = []

    def record(step):
        for r, _ in step.requests:
            if r.request_id not in admitted:
                admitted.append(r.request_id)

    run(sched, FakeWorker(), on_step=record)
    assert admitted == ["r0", "r1", "r2", "r3"]


def test_prefix_cache_hits_skip_computation():
    sched, _ = make(max_num_batched_tokens=64)
    shared = list(range(3, 23))  # 20 tokens = 5 full blocks
    worker = FakeWorker()
    first = req(0, shared + [40, 41], max_tokens=4)
    sched.add_request(first)
    run(sched, worker)
    before = worker.computed_tokens
    second = req(1, shared + [50, 51, 52], max_tokens=4)
    sched.add_request(second)
    run(sched, worker)
    assert second.num_cached_tokens == 20
    assert worker.computed_tokens - before == 3 + 3  # 3 new prompt tokens, then 3 decodes
    assert second.output_ids == reference(shared + [50, 51, 52], 4)
    # the whole prompt cached: the last token is still computed to get logits
    third = req(2, shared, max_tokens=2)
    sched.add_request(third)
    run(sched, worker)
    assert third.num_cached_tokens == 16 and third.output_ids == reference(shared, 2)


def test_abort_frees_blocks_and_tells_workers():
    sched, kv = make()
    a, b = req(0, PROMPTS[2], max_tokens=50), req(1, PROMPTS[3], max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    worker = FakeWorker()
    step = sched.schedule()
    sched.update(step, worker.execute(step.plan))
    assert sched.abort("r0") is a and a.finish_reason is FinishReason.ABORT
    assert sched.abort("r0") is None
    step = sched.schedule()
    assert "r0" in step.plan.finished and all(s.request_id != "r0" for s in step.plan.all_seqs())
    sched.update(step, worker.execute(step.plan))
    run(sched, worker)
    assert kv.num_free_blocks == 63 and "r0" not in worker.known


def test_stop_rules():
    sched, _ = make(max_model_len=12)
    eos_first = reference([3, 4], 1)[0]
    a = req(0, [3, 4], max_tokens=5, stop_token_ids=(eos_first,))
    b = req(1, [3, 4, 5, 6, 7, 8, 9, 10, 11], max_tokens=50)  # hits max_model_len
    c = req(2, [3, 4], max_tokens=5, ignore_eos=True)
    for r in (a, b, c):
        sched.add_request(r)
    run(sched, FakeWorker())
    assert a.output_ids == [eos_first] and a.finish_reason is FinishReason.STOP and a.stop_reason == eos_first
    assert b.num_tokens == 12 and b.finish_reason is FinishReason.LENGTH
    assert len(c.output_ids) == 5 and c.status is RequestStatus.FINISHED


def test_bad_requests_leave_no_state():
    sched, _ = make(max_model_len=16)
    with pytest.raises(ConfigError, match="max_model_len=16"):
        sched.add_request(req(0, list(range(3, 30))))
    with pytest.raises(ConfigError, match="prompt"):
        sched.add_request(req(1, []))
    sched.add_request(req(2, [4]))
    with pytest.raises(ConfigError, match="request_id"):
        sched.add_request(Request("r2", [5], SamplingParams(), arrival=9))
    assert sched.num_unfinished == 1


def test_plans_carry_table_changes_not_whole_tables():
    """The first plan of a request carries its tables whole, later ones only the last block the
    workers hold (a copy-on-write replaces it) and the new ones; a preempted request starts over."""
    sched, kv = make(num_blocks=24, max_num_batched_tokens=64)
    prompts = [list(range(3, 40)), list(range(5, 45))]  # 37 and 40 tokens: 10 blocks each
    reqs = [req(i, p, max_tokens=30) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    carried: dict[str, list[tuple[list[int] | None, int, int]]] = {r.request_id: [] for r in reqs}

    def record(step):
        for s in step.plan.all_seqs():
            carried[s.request_id].append((s.table_offsets, len(s.block_tables[0]), s.num_new_tokens))

    run(sched, FakeWorker(), on_step=record)
    assert sched.stats.num_preemptions > 0  # 23 usable blocks cannot hold both at 70 tokens
    for r, p in zip(reqs, prompts):
        assert r.output_ids == reference(p, 30)  # the fake worker rebuilt every table from the changes
        plans = carried[r.request_id]
        assert plans[0][0] is None  # the first plan: its tables whole
        decodes = [n for offsets, n, new in plans if offsets is not None and new == 1]
        assert decodes and max(decodes) <= 2  # the held last block and at most one new one
        # A decode step that neither opens a block nor copies one carries no block at all.
        assert decodes.count(0) >= len(decodes) // 2  # blocks of BS=4 tokens: 3 steps in 4
    # (a request the workers know gets its tables whole as changes from offset 0)
    restarts = sum(offsets is None or not any(offsets) for plans in carried.values() for offsets, _, _ in plans)
    assert restarts > len(reqs)  # a re-admitted request got its (new) tables whole
    assert kv.num_free_blocks == 23


def test_decode_rows_that_just_continue_carry_no_blocks():
    """A request's first row comes with its announcement (tables whole); later rows are columns of
    the plan's CachedRows: a decode whose tables did not change carries no block (its offset is
    the length the workers hold), the step that gives it a new block (every BS tokens) carries
    that block; tokens stay exact."""
    sched, _ = make()
    worker = FakeWorker()
    reqs = [req(i, PROMPTS[i], max_tokens=12) for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    kinds = []

    def record(step):
        rows = step.plan.cached
        changed, quiet = {}, {}
        if rows is not None:
            assert not rows.from_last_step.any()  # no overlap here: every token is known
            assert rows.num_tokens.tolist() == [1] * len(rows)
            assert all(sched.requests[r].all_token_ids[c] == t
                       for r, c, t in zip(rows.request_ids, rows.context_lens.tolist(), rows.token_ids.tolist()))
            for rid, ctx, count in zip(rows.request_ids, rows.context_lens.tolist(), rows.block_counts[:, 0].tolist()):
                (changed if count else quiet)[rid] = ctx
        kinds.append(([r.request_id for r in step.plan.new_requests], changed, quiet))

    run(sched, worker, on_step=record)
    first, later = kinds[0], kinds[1:]
    assert sorted(first[0]) == ["r0", "r1"] and not first[1] and not first[2]  # prompts: announced, tables whole
    for new, changed, quiet in later:
        assert not new
        assert all(ctx % BS == 0 for ctx in changed.values())  # a new block: the row carries it
        assert all(ctx % BS != 0 for ctx in quiet.values())  # else no block at all
    assert sum(len(q) for _, _, q in later) > sum(len(c) for _, c, _ in later) > 0
    # tokens as one request at a time would get them (the fake worker reads them through the tables)
    assert all(r.output_ids == reference(r.prompt_ids, 12) for r in reqs)
