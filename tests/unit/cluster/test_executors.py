"""Executors over the step channel: subprocess ranks at tp=2 (one rendezvous, every rank gets every
plan), the allow-list, rank errors, and a killed rank reported with its cause."""

import os
import signal
import time

import pytest

from meshserve.cluster.executors.channel_executor import ChannelExecutor, ThreadRanks
from meshserve.cluster.executors.executor import RankError, WorkerDiedError, WorkerSpec
from meshserve.cluster.executors.multiproc import MultiprocExecutor
from meshserve.config import CacheConfig, ModelConfig, ParallelConfig
from meshserve.core.sampling_params import SamplingParams
from meshserve.engine.engine_config import EngineConfig
from meshserve.engine.engine_core import EngineCore
from meshserve.errors import ConfigError
from tests.null_worker import POISON_TOKEN, next_token

NULL = "tests.null_worker:NullWorker"
GREEDY = SamplingParams(temperature=0, max_tokens=6)


def config(tmp_path, tp=1) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=str(tmp_path)), cache=CacheConfig(num_kv_blocks=64),
                        parallel=ParallelConfig(tp=tp))


def expected(prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


def run(core, prompts):
    for i, p in enumerate(prompts):
        core.add_request(p, GREEDY, request_id=f"r{i}")
    out = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_unfinished():
        for d in core.step():
            out[d.request_id] += d.token_ids
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_worker_spec_round_trips_through_msgpack(tmp_path):
    cfg = config(tmp_path, tp=2)
    spec = WorkerSpec(cfg.model, cfg.cache, cfg.attention, cfg.parallel, "cpu", NULL)
    assert WorkerSpec.from_msgpack(spec.to_msgpack()) == spec


def test_two_subprocess_ranks_share_plans_report_errors_and_deaths(tmp_path):
    executor = MultiprocExecutor(config(tmp_path, tp=2), worker_class=NULL)
    core = EngineCore(config(tmp_path, tp=2), executor=executor)
    try:
        prompts = [[1, 2, 3], [7] * 20, [4, 5]]
        assert run(core, prompts) == [expected(p, 6) for p in prompts]  # rank 0 checked rank 1 agreed
        assert [h["alive"] for h in executor.check_health()] == [True, True]
        core.add_request([1, POISON_TOKEN], GREEDY, request_id="poison")
        with pytest.raises(RankError, match=r"rank [01] failed: RuntimeError: poisoned request poison"):
            core.step()

        victim = executor.ranks.procs[1]
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match=rf"rank 1 process \(pid {victim.pid}\) died: killed by SIGKILL"):
            executor.call("check_health", [{}, {}])
        assert time.monotonic() - t0 < 5.0  # the requirement: a dead rank surfaces within seconds
    finally:
        core.shutdown()
    assert all(p.returncode is not None for p in [victim])
    assert executor.ranks.procs == []


def test_ranks_refuse_methods_outside_the_allow_list(tmp_path):
    cfg = config(tmp_path)
    executor = ChannelExecutor(ThreadRanks(WorkerSpec(cfg.model, cfg.cache, cfg.attention, cfg.parallel,
                                                      worker_class=NULL)))
    executor.start()
    try:
        with pytest.raises(RankError, match="method='shutdown' is not allowed"):
            executor.call("shutdown", [{}])
        assert executor.call("check_health", [{}])[0]["started"]
    finally:
        executor.shutdown()
    with pytest.raises(ConfigError, match="tp=2"):
        ThreadRanks(WorkerSpec(cfg.model, parallel=ParallelConfig(tp=2)))
