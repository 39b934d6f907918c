"""Overlap scheduling: step N+1 is planned before step N's tokens are known.

The fake worker of test_scheduler keeps tokens in a paged 'cache'; here it also keeps each
request's last drawn token on its side, as the runner keeps it on the device, and fills the
`from_last_step` token from it. Oracle: one-request-at-a-time generation (`reference`) and the
same scheduler run without overlap.
"""

from __future__ import annotations

from collections import deque

from meshserve.core.outputs import FinishReason
from meshserve.engine.request import RequestStatus
from meshserve.workers.step import StepOutput, StepPlan
from tests.unit.engine.test_scheduler import EOS, PROMPTS, FakeWorker, make, reference, req, run


class OverlapWorker(FakeWorker):
    """submit/collect like ModelRunner: a step may be submitted before the previous is collected."""

    def __init__(self) -> None:
        super().__init__()
        self.last: dict[str, int] = {}  # request id -> token drawn by the latest step (device side)
        self.out: deque[StepOutput] = deque()
        self.from_last_step = 0

    def submit(self, plan: StepPlan) -> None:
        plan = StepPlan.from_msgpack(plan.to_msgpack())  # the flag travels
        self.known |= {r.request_id for r in plan.new_requests}
        drawn = []
        for s in plan.all_seqs():
            tokens = list(s.token_ids)
            if s.from_last_step:
                tokens.append(self.last[s.request_id])
                self.from_last_step += 1
            if (tok := self.compute(s, tokens)) is not None:
                drawn.append(tok)
        self.last.update((d.request_id, d.token_id) for d in drawn)
        self.known -= set(plan.finished)
        self.out.append(StepOutput.of(plan.step_id, drawn))

    def collect(self) -> StepOutput:
        return self.out.popleft()


def run_overlapped(sched, worker, max_steps=10_000, on_step=None) -> int:
    in_flight, steps = None, 0
    while sched.has_unfinished() or in_flight is not None:
        step = sched.schedule()
        if on_step:
            on_step(step)
        if not step.is_empty:
            worker.submit(step.plan)
        if in_flight is not None:
            sched.update(in_flight, worker.collect())
        in_flight = None if step.is_empty else step
        steps += 1
        assert steps < max_steps
    return steps


def test_overlapped_outputs_equal_one_at_a_time_and_waste_nothing():
    sched, kv = make(max_num_batched_tokens=16, max_num_seqs=3)
    reqs = [req(i, p) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        sched.add_request(r)
    worker = OverlapWorker()
    run_overlapped(sched, worker)
    for r, p in zip(reqs, PROMPTS):
        assert r.output_ids == reference(p, 10)
        assert r.finish_reason is FinishReason.LENGTH and r.num_pending_outputs == 0
    assert worker.from_last_step > 0  # decodes ran before their input token was known on the host
    assert kv.num_free_blocks == 63  # nothing leaked
    # A request is never scheduled past its last token: the same K/V work as without overlap.
    sync_sched, _ = make(max_num_batched_tokens=16, max_num_seqs=3)
    for i, p in enumerate(PROMPTS):
        sync_sched.add_request(req(i, p))
    sync_worker = FakeWorker()
    run(sync_sched, sync_worker)
    assert worker.computed_tokens == sync_worker.computed_tokens


def test_a_stop_token_drawn_in_flight_drops_the_next_steps_token():
    prompt = [5, 9, 13]
    want = reference(prompt, 6)
    eos_at = 3  # make the fourth token the EOS
    sched, kv = make()
    sched.eos_token_ids = frozenset({want[eos_at]})
    r = req(0, prompt, max_tokens=50)
    sched.add_request(r)
    worker = OverlapWorker()
    run_overlapped(sched, worker)
    assert r.output_ids == want[: eos_at + 1]  # the token computed after EOS was dropped
    assert r.finish_reason is FinishReason.STOP
    assert kv.num_free_blocks == 63


def test_preemption_and_prefix_hits_under_overlap_keep_outputs():
    shared = [11, 12, 13, 14, 15, 16, 17, 18]
    prompts = [shared + p[:6] for p in PROMPTS]
    sched, kv = make(num_blocks=14, max_num_batched_tokens=12, max_num_seqs=4)
    reqs = [req(i, p, max_tokens=12) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    run_overlapped(sched, OverlapWorker())
    assert sched.stats.num_preemptions > 0 and sched.stats.num_prefix_hit_tokens > 0
    for r, p in zip(reqs, prompts):
        assert r.output_ids == reference(p, 12)
    assert kv.num_free_blocks == 13


def test_abort_while_a_step_is_in_flight():
    sched, kv = make()
    a, b = req(0, PROMPTS[0], max_tokens=30), req(1, PROMPTS[1], max_tokens=30)
    sched.add_request(a)
    sched.add_request(b)
    worker = OverlapWorker()
    first = sched.schedule()
    worker.submit(first.plan)
    second = sched.schedule()  # planned while the first runs: both decode the tokens it draws
    assert all(s.from_last_step and not s.token_ids for s in second.plan.all_seqs())
    worker.submit(second.plan)
    sched.update(first, worker.collect())
    assert sched.abort(a.request_id) is a
    sched.update(second, worker.collect())  # a's token from the second step is dropped
    assert a.status is RequestStatus.FINISHED and len(a.output_ids) == 1
    assert len(b.output_ids) == 2 and b.output_ids == reference(PROMPTS[1], 2)
    assert a.request_id in sched.schedule().plan.finished  # the workers are told to forget it
    sched.abort(b.request_id)
    assert kv.num_free_blocks == 63


def test_eos_as_first_token_under_overlap():
    prompt = [21, 22, 23]
    sched, kv = make()
    sched.eos_token_ids = frozenset({reference(prompt, 1)[0], EOS})
    r = req(0, prompt, max_tokens=5)
    sched.add_request(r)
    run_overlapped(sched, OverlapWorker())
    assert len(r.output_ids) == 1 and r.finish_reason is FinishReason.STOP
    assert kv.num_free_blocks == 63
