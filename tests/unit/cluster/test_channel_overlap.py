"""Overlap scheduling through the step channel: the driver submits step N+1 before it collects step N
(channel.py SUBMIT); the rank queues N+1, answers N, and answers the last step when no message follows.

Oracle: the in-process engine without overlap on the same tiny checkpoint (greedy and seeded
tokens identical; ranks on a thread, and tp=2 subprocess ranks over gloo), NullWorker's
deterministic tokens for the failure paths.
"""

from __future__ import annotations

import dataclasses

import pytest

from meshserve.cluster.executors.channel_executor import ChannelExecutor, ThreadRanks
from meshserve.cluster.executors.executor import RankError, WorkerSpec
from meshserve.cluster.executors.multiproc import MultiprocExecutor
from meshserve.config import AttentionConfig, CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from meshserve.core.outputs import FinishReason
from meshserve.core.sampling_params import SamplingParams
from meshserve.engine.engine_config import EngineConfig
from meshserve.engine.engine_core import EngineCore
from tests.null_worker import POISON_TOKEN, next_token
from tests.tiny_models import prompts
from tests.unit.cluster.cases import (
    assert_no_held_blocks,
    assert_same,
    mixed_requests,
    reference,
    run_all,
    serve,
    threads,
)

PARAMS = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.9, top_k=40, seed=7, max_tokens=10, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),  # finishes while the others decode
          SamplingParams(temperature=0, max_tokens=16)]


def engine_config(model: str, *, overlap: bool | None) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=model), cache=CacheConfig(block_size=16, num_kv_blocks=64),
                        scheduler=SchedulerConfig(max_num_batched_tokens=64, async_scheduling=overlap),
                        attention=AttentionConfig(backend="TORCH"))


def thread_executor(cfg: EngineConfig, worker_class: str | None = None) -> ChannelExecutor:
    spec = WorkerSpec(cfg.model, cfg.cache, cfg.attention, cfg.parallel, "cpu",
                      **({"worker_class": worker_class} if worker_class else {}))
    return ChannelExecutor(ThreadRanks(spec), name="overlap-test")


def run(core: EngineCore, requests, *, abort_after: dict[str, int] | None = None) -> dict[str, list[int]]:
    """Every request's streamed tokens; abort_after: abort a request once it streamed that many."""
    for rid, prompt, params in requests:
        core.add_request(prompt, params, request_id=rid)
    out: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    abort_after = dict(abort_after or {})
    while core.has_unfinished():
        for d in core.step():
            out[d.request_id] += d.token_ids
        for rid, n in list(abort_after.items()):
            if len(out[rid]) >= n:
                del abort_after[rid]
                assert core.abort(rid) is not None
    return out


class Spy:
    """Counts what the driver asked of the executor: steps outstanding, rows fed from the last draw."""

    def __init__(self, executor: ChannelExecutor) -> None:
        self.max_outstanding = 0
        self.rows_from_last_step = 0
        submit = executor.submit_step

        def spying_submit(plan):
            submit(plan)
            self.max_outstanding = max(self.max_outstanding, len(executor._submitted))
            if plan.cached is not None:
                self.rows_from_last_step += int(plan.cached.from_last_step.sum())
        executor.submit_step = spying_submit


def test_overlapped_channel_steps_match_the_in_process_engine_and_free_every_block(tiny_llama):
    requests = [(f"r{i}", p, PARAMS[i % len(PARAMS)])
                for i, p in enumerate(prompts(6, seed=3, min_len=3, max_len=40))]
    oracle = EngineCore(engine_config(str(tiny_llama), overlap=False), progress=False)
    assert not oracle.overlap
    want = run(oracle, requests)
    oracle.shutdown()

    executor = thread_executor(engine_config(str(tiny_llama), overlap=True))
    core = EngineCore(engine_config(str(tiny_llama), overlap=True), executor=executor)
    try:
        assert core.overlap and not executor.runs_async  # forced: the ranks run on a CPU
        spy = Spy(executor)
        assert run(core, requests) == want
        assert spy.max_outstanding == 2 and spy.rows_from_last_step > 0  # N+1 went out before N came back
        # Aborted mid-stream (a step of it in flight) and run to the end: no block left on the driver.
        more = [(f"a{i}", p, PARAMS[0]) for i, p in enumerate(prompts(4, seed=4, min_len=5, max_len=30))]
        got = run(core, more, abort_after={"a0": 1, "a2": 5})
        assert 1 <= len(got["a0"]) < 12 and 5 <= len(got["a2"]) < 12
        assert len(got["a1"]) == len(got["a3"]) == 12
        core.kv.check_invariants()
        assert core.kv.num_requests == 0 and core.kv.num_free_blocks == core.kv.num_total_blocks
    finally:
        core.shutdown()


def null_config(tmp_path) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=str(tmp_path)), cache=CacheConfig(num_kv_blocks=64),
                        scheduler=SchedulerConfig(async_scheduling=True))


def expected(prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


@pytest.mark.parametrize("worker", ["tests.null_worker:NullWorker",  # fails at submit (computed there)
                                    "tests.unit.cluster.fault_workers:OverlapNullWorker"])  # fails at collect
def test_a_failed_step_fails_its_own_collect_and_nothing_hangs(tmp_path, worker):
    cfg = null_config(tmp_path)
    executor = thread_executor(cfg, worker)
    core = EngineCore(cfg, executor=executor)
    try:
        assert core.overlap
        core.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=40), request_id="ok")
        got = []
        for _ in range(4):
            got += [t for d in core.step() for t in d.token_ids]
        core.add_request([1, POISON_TOKEN], SamplingParams(temperature=0, max_tokens=4), request_id="poison")
        got += [t for d in core.step() for t in d.token_ids]  # submits the poisoned step, collects the one before
        assert got == expected([1, 2, 3], len(got)) and len(got) >= 4
        with pytest.raises(RankError, match="rank 0 failed: RuntimeError: poisoned request poison"):
            core.step()
    finally:
        core.shutdown()  # returns: the rank loop heard the stop


def test_a_step_still_running_when_no_message_comes_is_answered_once_done(tmp_path, monkeypatch):
    """The rank polls its step while the driver is idle (the last step, and every step here: the
    driver's host work is shorter than the "device" time), and answers each in order."""
    from tests.unit.cluster.fault_workers import OverlapNullWorker

    monkeypatch.setattr(OverlapNullWorker, "DEVICE_S", 0.01)
    cfg = null_config(tmp_path)
    executor = thread_executor(cfg, "tests.unit.cluster.fault_workers:OverlapNullWorker")
    core = EngineCore(cfg, executor=executor)
    try:
        spy = Spy(executor)
        prompts_ = [[1, 2, 3], [7] * 20, [4, 5]]
        for i, p in enumerate(prompts_):
            core.add_request(p, SamplingParams(temperature=0, max_tokens=8 + i), request_id=f"r{i}")
        out = {f"r{i}": [] for i in range(len(prompts_))}
        while core.has_unfinished():
            for d in core.step():
                out[d.request_id] += d.token_ids
        assert [out[f"r{i}"] for i in range(3)] == [expected(p, 8 + i) for i, p in enumerate(prompts_)]
        assert spy.max_outstanding == 2
        core.kv.check_invariants()
        assert core.kv.num_free_blocks == core.kv.num_total_blocks
    finally:
        core.shutdown()


def test_disaggregated_hand_over_with_overlap_forced_matches(tiny_llama):
    requests = mixed_requests()
    want = reference(tiny_llama, requests)

    async def body(c):
        (prefill,), (decode,) = c.replicas("prefill"), c.replicas("decode")
        assert prefill.core.overlap and decode.core.overlap
        got = await run_all(c, requests)
        handed = sum(1 for r in want.values() if len(r.token_ids) > 1)
        assert decode.stats().num_kv_imports == handed and decode.stats().num_recomputes == 0
        assert_no_held_blocks(c)
        return got
    got = serve(threads(tiny_llama, "disaggregated", scheduler={"async_scheduling": True}), body)
    assert_same(got, want)
    assert all(r.finish_reason in (FinishReason.LENGTH, FinishReason.STOP) for r in got.values())


def test_tp2_subprocess_ranks_overlap_with_rank0s_draw_broadcast(tiny_llama):
    """tp=2 over gloo: rank 1 takes a `from_last_step` token from rank 0's draw (broadcast in the
    TP group), so both ranks compute the same step; tokens as the one-rank engine's."""
    requests = [(f"r{i}", p, PARAMS[i % len(PARAMS)])
                for i, p in enumerate(prompts(4, seed=3, min_len=3, max_len=40))]
    oracle = EngineCore(engine_config(str(tiny_llama), overlap=False), progress=False)
    want = run(oracle, requests)
    oracle.shutdown()

    cfg = dataclasses.replace(engine_config(str(tiny_llama), overlap=True), parallel=ParallelConfig(tp=2))
    executor = MultiprocExecutor(cfg, device="cpu")
    core = EngineCore(cfg, executor=executor)
    try:
        assert core.overlap
        spy = Spy(executor)
        assert run(core, requests) == want
        assert spy.max_outstanding == 2 and spy.rows_from_last_step > 0
    finally:
        core.shutdown()
