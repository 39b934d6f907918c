"""A replica's warm-up: a few short greedy requests through the whole engine before the first client's.

What a first request would otherwise pay once, inside its time to first token: FlashInfer modules
outside the prebuilt set JIT-built (a sliding-window + soft-cap prefill: 132 s on an H100,
docs/performance.md), Triton kernels compiled on a cold cache (a container's first start), cuBLAS
and allocator set-up. The requests take the paths a served step takes: two prompts prefilled
together from their own K/V (fresh prompts), then one whose prefix is cached (the paged prefill
over cached context), and decode steps with more than one row. A kernel that cannot run fails the
start here, not a client's request.

Nothing is left behind: the requests finish, their blocks are free again, the prefix hashes of
their random tokens are forgotten, the scheduler's counters (metrics) and the ranks' per-expert row
counts start from zero, and greedy
rows draw nothing from the sampler's generator (a request without a seed gets the tokens it
would have got without the warm-up).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from meshserve.core.sampling_params import SamplingParams
from meshserve.engine.scheduler import SchedulerStats
from meshserve.errors import MeshserveError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from meshserve.core.outputs import CompletionDelta
    from meshserve.engine.engine_config import EngineConfig
    from meshserve.engine.request import Request
    from meshserve.engine.scheduler import Scheduler
    from meshserve.kvstore.manager import KVCacheManager
    from meshserve.workers.worker import WorkerInfo

log = logging.getLogger("meshserve.engine")

# Prompt lengths of the first round (prefilled in one step), and how many tokens the second
# round's prompt adds to the first one's (its whole blocks come from the prefix cache).
FIRST_ROUND = (40, 77)
EXTENSION = 21
OUTPUT_TOKENS = 2
MAX_STEPS = 64  # far above what the three requests need: a scheduler that never finishes them is a bug


class RankCalls(Protocol):
    """What the warm-up uses of an executor: a method called on every rank."""

    def call(self, method: str, args: Sequence[dict]) -> list: ...


class Engine(Protocol):
    """What the warm-up uses of an EngineCore (engine_core.py runs it; no import back)."""

    config: EngineConfig
    executor: RankCalls
    info: WorkerInfo
    kv: KVCacheManager
    scheduler: Scheduler

    def make_request(self, prompt: Sequence[int], params: SamplingParams, *, request_id: str) -> Request: ...
    def add(self, request: Request) -> None: ...
    def has_unfinished(self) -> bool: ...
    def step(self) -> list[CompletionDelta]: ...


@dataclass(frozen=True)
class WarmupReport:
    """seconds: the warm-up's wall time; cached_tokens: the prompt tokens the third request found
    in the prefix cache (0 with prefix caching off)."""

    seconds: float
    requests: int
    cached_tokens: int


def wants_warmup(setting: bool | None, device: str) -> bool:
    """The setting, or unset: on where kernels are built or compiled at first use (CUDA)."""
    return setting if setting is not None else device == "cuda"


def warm_up(core: Engine) -> WarmupReport | None:
    """Run the warm-up requests to their end; None where this engine refuses them (admission's
    checks: a context shorter than a prompt, a scheduler that cannot take one; logged, nothing
    run). Each fits the KV pool alone (a pool holds a max_model_len sequence); together the
    scheduler runs them as the pool allows."""
    info = core.info
    if info.is_encoder_decoder:
        log.info("warm-up skipped: encoder-decoder model")
        return None
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    tokens = _tokens(info.vocab_size, sum(FIRST_ROUND) + EXTENSION)
    first = tokens[:FIRST_ROUND[0]]
    second = tokens[FIRST_ROUND[0]:sum(FIRST_ROUND)]
    third = first + tokens[sum(FIRST_ROUND):]
    try:  # checked whole before any is queued (make_request queues nothing)
        rounds = [[core.make_request(first, params, request_id="warmup-0"),
                   core.make_request(second, params, request_id="warmup-1")],
                  [core.make_request(third, params, request_id="warmup-2")]]  # reads the first one's cached blocks
    except MeshserveError as exc:  # a short context, no chunked prefill with fewer batched tokens, ...
        log.info("warm-up skipped: %s", exc)
        return None
    started = time.perf_counter()
    _run(core, rounds[0])
    cached = _run(core, rounds[1])
    core.kv.reset_prefix_cache()
    core.scheduler.stats = SchedulerStats()  # the metrics count clients' requests only
    core.executor.call("counters", [{"reset": True}] * core.config.parallel.tp)  # ... and the expert loads
    report = WarmupReport(time.perf_counter() - started, 3, cached)
    log.info("warm-up: %d requests through the engine in %.2f s (%d prompt tokens from the prefix cache)",
             report.requests, report.seconds, report.cached_tokens)
    return report


def _tokens(vocab_size: int, count: int) -> list[int]:
    """count token ids spread over the vocabulary (not the first 256: ids that are often special)."""
    low = min(256, vocab_size // 2)
    span = vocab_size - low
    return [low + (i * 7919 + 13) % span for i in range(count)]


def _run(core: Engine, requests: list[Request]) -> int:
    """Run the requests to their end; the prompt tokens they found cached."""
    for request in requests:
        core.add(request)
    cached = 0
    for _ in range(MAX_STEPS):
        if not core.has_unfinished():
            return cached
        for delta in core.step():
            if delta.error is not None:
                raise delta.error
            if delta.finished:
                cached += delta.num_cached_tokens
    raise RuntimeError(f"the warm-up requests did not finish within {MAX_STEPS} steps")
