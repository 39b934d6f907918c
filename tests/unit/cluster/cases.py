"""A mixed request set and its oracle, the single-process engine, for the cluster tests.

Twenty requests: prompts of 3..70 tokens (some longer than the prefill chunk), four sharing a
48-token prefix (prefix cache and prefix-aware routing), text prompts, greedy with and without
EOS, max_tokens from 1 (finishes on the prefill replica) to 24, a stop string, and a seeded
sampled request. The oracle runs the same requests through one in-process EngineCore.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from meshserve.config import AttentionConfig, CacheConfig, ModelConfig, SchedulerConfig
from meshserve.core.sampling_params import SamplingParams
from meshserve.engine.engine_config import EngineConfig
from meshserve.engine.engine_core import EngineCore
from tests.tiny_models import prompts

SHARED = prompts(1, seed=11, min_len=48, max_len=48)[0]


def engine_config(model_dir, **scheduler) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(model_dir)),
        cache=CacheConfig(block_size=16, num_kv_blocks=96),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, **scheduler),  # longer prompts are chunked
        attention=AttentionConfig(backend="TORCH"),
    )


def serve(config, body):
    """Start a Coordinator on `config`, run `body(coordinator)`, shut it down; returns body's result."""
    from meshserve.cluster.coordinator import Coordinator

    async def main():
        coord = await Coordinator(config).start()
        try:
            return await body(coord)
        finally:
            await coord.shutdown(drain=False)
    return asyncio.run(main())


def threads(model_dir, mode="unified", **kw):
    """A ClusterConfig with ranks on threads; `scheduler` (a dict) and PoolConfig fields as keywords."""
    from meshserve.cluster.coordinator import ClusterConfig
    from meshserve.config import PoolConfig

    sched = kw.pop("scheduler", {})
    return ClusterConfig(engine=engine_config(model_dir, **sched), pools=PoolConfig(mode=mode, **kw),
                         runtime="threads")


def mixed_requests() -> list[tuple[str, object, SamplingParams]]:
    """(request id, prompt, params) x 20."""
    greedy = dict(temperature=0, ignore_eos=True)
    out = []
    for i, p in enumerate(prompts(10, seed=5, min_len=3, max_len=70)):
        out.append((f"ids-{i}", p, SamplingParams(max_tokens=4 + 2 * i, **greedy)))
    for i, tail in enumerate(prompts(4, seed=6, min_len=2, max_len=9)):
        out.append((f"shared-{i}", SHARED + tail, SamplingParams(max_tokens=12, **greedy)))
    out.append(("text-0", "The quick brown fox jumps", SamplingParams(max_tokens=16, **greedy)))
    out.append(("text-1", "Hello world, hello", SamplingParams(temperature=0, max_tokens=20)))  # may stop at EOS
    out.append(("one-token", prompts(1, seed=8, min_len=20, max_len=20)[0], SamplingParams(max_tokens=1, **greedy)))
    out.append(("seeded", "Once upon a time", SamplingParams(temperature=0.9, top_k=40, seed=1234, max_tokens=16,
                                                             ignore_eos=True)))
    out.append(("stop-str", "one two three four", SamplingParams(max_tokens=24, stop=("e t",), **greedy)))
    out.append(("long", prompts(1, seed=9, min_len=120, max_len=120)[0], SamplingParams(max_tokens=8, **greedy)))
    return out


@dataclass
class Result:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_deltas: int = 0


def reference(model_dir, requests) -> dict[str, Result]:
    """The single-process engine's outputs for `requests`."""
    core = EngineCore(engine_config(model_dir), progress=False)
    for rid, prompt, params in requests:
        core.add_request(prompt, params, request_id=rid)
    out = {rid: Result([], "", None) for rid, _, _ in requests}
    while core.has_unfinished():
        for d in core.step():
            r = out[d.request_id]
            r.token_ids += d.token_ids
            r.text += d.text
            r.finish_reason = d.finish_reason
    core.shutdown()
    return out


async def collect(service, rid, prompt, params, *, started: asyncio.Event | None = None) -> Result:
    """The whole stream of one request; `started` is set at its first delta."""
    r = Result([], "", None)
    async for d in service.generate(prompt, params, request_id=rid):
        if started is not None:
            started.set()
        r.token_ids += d.token_ids
        r.text += d.text
        r.finish_reason = d.finish_reason
        r.num_deltas += 1
    return r


async def run_all(service, requests) -> dict[str, Result]:
    results = await asyncio.gather(*(collect(service, rid, p, sp) for rid, p, sp in requests))
    return {rid: r for (rid, _, _), r in zip(requests, results)}


def assert_same(got: dict[str, Result], want: dict[str, Result]) -> None:
    """Every result in `got` equals the oracle's (tokens, text, finish reason)."""
    assert got
    for rid, g in got.items():
        w = want[rid]
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason), rid


def assert_no_held_blocks(coordinator) -> None:
    """Every replica's KV manager is consistent and holds no request (cached blocks count as free)."""
    for replica in coordinator.replicas():
        kv = replica.core.kv
        kv.check_invariants()
        assert kv.num_requests == 0, (replica.name, kv.request_ids())
        assert kv.num_free_blocks == kv.num_total_blocks, replica.name


async def wait_until(condition: Callable[[], bool], what: str, *, timeout_s: float,
                     state: Callable[[], object] | None = None, poll_s: float = 0.01) -> None:
    """Poll `condition` until it holds; after `timeout_s` fail naming `what` and the last `state()`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            seen = "" if state is None else f"; last seen: {state()}"
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}{seen}", pytrace=False)
        await asyncio.sleep(poll_s)


async def wait_for_events(events: dict[str, asyncio.Event], what: str, *, timeout_s: float) -> None:
    """Wait until every event is set; after `timeout_s` fail naming `what` and the keys still unset."""
    try:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events.values())), timeout_s)
    except TimeoutError:
        missing = sorted(k for k, e in events.items() if not e.is_set())
        pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}: still waiting for {missing}", pytrace=False)


def holds_no_blocks(coordinator) -> bool:
    """No replica's KV manager holds a request any more (the condition assert_no_held_blocks checks)."""
    return all(r.core.kv.num_requests == 0 for r in coordinator.replicas())
