"""Scheduler forks (n / best_of groups, beams) and held requests, against the fake paged worker of
test_scheduler.py taught to apply the plan's copy-on-write pairs.

Every forked sequence must generate what it would alone (`reference`): a fork that shares a
block it should have copied, a copy made after the write, or a wrong table after a fork changes
the fake model's tokens. The KV manager's invariants are checked after every step.
"""

from meshserve.core.sampling_params import SamplingParams
from meshserve.engine.request import Request, RequestStatus
from tests.unit.engine.test_scheduler import BS, FakeWorker, make, reference, req


class CowWorker(FakeWorker):
    def execute(self, plan):
        for src, dst in plan.copies:  # before any token of the step is written, as the runner does
            for i in range(BS):
                if src * BS + i in self.slots:
                    self.slots[dst * BS + i] = self.slots[src * BS + i]
        return super().execute(plan)


def _step(sched, worker, kv):
    step = sched.schedule()
    touched = sched.update(step, worker.execute(step.plan))
    kv.check_invariants()
    return step, touched


def test_group_root_forks_samples_that_each_equal_a_lone_run():
    sched, kv = make()
    prompt = list(range(3, 3 + 2 * BS + 2))  # the last prompt block is partial: forks must copy it
    samples = [req(10 + i, prompt, max_tokens=6) for i in range(3)]
    root = Request("root", prompt[:-1], samples[0].params, arrival=10, fork_into=samples)
    sched.add_request(root)
    worker = CowWorker()
    step, _ = _step(sched, worker, kv)
    assert not any(s.sample for s in step.plan.all_seqs())  # the root samples nothing
    assert root.is_finished and all(s.status is RequestStatus.RUNNING for s in samples)
    assert len({tuple(kv.block_tables(s.request_id)[0][:-1]) for s in samples}) == 1  # shared prompt blocks
    while sched.has_unfinished():
        _step(sched, worker, kv)
    assert kv.stats.cow_copies == 2  # two samples copied the partial block; the last one kept it
    for s in samples:
        assert s.output_ids == reference(prompt, 6)
    assert kv.num_free_blocks == kv.num_total_blocks


def test_a_held_request_waits_and_a_fork_continues_with_its_own_token():
    sched, kv = make()
    prompt = [5, 9, 11, 2, 8, 13]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    parent = Request("p", prompt, params, arrival=0, chosen_by_search=True)
    sched.add_request(parent)
    worker = CowWorker()
    _step(sched, worker, kv)
    assert parent.held and len(parent.output_ids) == 1
    step, _ = _step(sched, worker, kv)
    assert step.is_empty  # held: not scheduled past a token its owner has not chosen
    first = parent.output_ids[0]
    child = Request("c", prompt, params, arrival=0, output_ids=[first + 1], chosen_by_search=True)
    sched.fork(parent, child)
    parent.held = child.held = False
    for _ in range(3):  # each held after each token; released at once here
        _step(sched, worker, kv)
        assert parent.held and child.held
        parent.held = child.held = False
    assert parent.output_ids == [first] + reference(prompt + [first], 3)
    assert child.output_ids == [first + 1] + reference(prompt + [first + 1], 3)
    assert kv.stats.cow_copies >= 1
    sched.abort("p")
    sched.abort("c")
    assert kv.num_free_blocks == kv.num_total_blocks


def test_held_requests_yield_their_blocks_to_the_queue_head():
    sched, kv = make(num_blocks=6)  # 5 usable blocks of 4 tokens
    held = Request("h", list(range(3, 14)), SamplingParams(temperature=0, max_tokens=4), arrival=0,
                   chosen_by_search=True)
    sched.add_request(held)
    worker = CowWorker()
    _step(sched, worker, kv)
    assert held.held and held.status is RequestStatus.RUNNING
    other = req(1, list(range(20, 34)), max_tokens=2)  # needs 4 blocks: only 2 are free
    sched.add_request(other)
    _step(sched, worker, kv)
    assert held.status is RequestStatus.WAITING and sched.stats.num_preemptions == 1
    assert other.status is RequestStatus.RUNNING
    while other.status is not RequestStatus.FINISHED:
        _step(sched, worker, kv)
    assert other.output_ids == reference(other.prompt_ids, 2)
    first = held.output_ids[0]
    held.held = False  # released: recomputed from its tokens
    while not held.is_finished:
        _step(sched, worker, kv)
        held.held = False
    assert held.output_ids == [first] + reference(held.prompt_ids + [first], 3)
    assert kv.num_free_blocks == 5


def test_two_groups_admitted_together_never_run_more_than_max_num_seqs():
    """Each running root counts as the samples it will fork into: with one request running and
    max_num_seqs 8, two groups of n = 4 cannot both be admitted (1 + 4 + 4 sequences)."""
    sched, kv = make(num_blocks=128, max_num_seqs=8)
    worker = CowWorker()
    lone = req(0, [4, 6, 8], max_tokens=12)
    sched.add_request(lone)
    _step(sched, worker, kv)
    groups = []
    for g in range(2):
        prompt = [3 + g, 7, 9, 12, 5]
        samples = [req(10 * (g + 1) + i, prompt, max_tokens=4) for i in range(4)]
        sched.add_request(Request(f"root{g}", prompt[:-1], samples[0].params, arrival=1 + g, fork_into=samples))
        groups.append((prompt, samples))
    most = 0
    while sched.has_unfinished():
        _step(sched, worker, kv)
        most = max(most, len(sched.running))
        assert len(sched.running) <= 8
    assert most == 5  # the first group ran beside the lone request; the second waited for seats
    assert lone.output_ids == reference([4, 6, 8], 12)
    for prompt, samples in groups:
        for s in samples:
            assert s.output_ids == reference(prompt, 4)
    assert kv.num_free_blocks == kv.num_total_blocks
