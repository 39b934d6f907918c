"""LocalService: the InferenceService of one replica in this process (EngineCore + AsyncEngine).

It is what `meshserve serve` runs until the Ray Coordinator serves pools of replicas, and what
a program embeds to serve a model without Ray. It adds to the engine what serving needs:

- Admission: bad input raises ConfigError before anything is queued; a prompt plus max_tokens
  beyond max_model_len is refused (max_tokens names the allowed range); more than `max_queue`
  requests waiting (accepted, not yet running) raises QueueFullError.
- Replica health: a step that raises kills the replica. Its open streams end with
  ReplicaFailedError, health turns not serving (new requests get UnavailableError) and the
  replica is rebuilt in the background, with back-off, until it serves again.
- Counters that stay monotonic across rebuilt replicas (for Prometheus).

Everything but `stats`, `health`, `models` and `tokenize` must be called on one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from meshserve.cluster.async_engine import AsyncEngine, EngineDeadError
from meshserve.cluster.engine import EngineConfig, EngineCore, InProcessExecutor
from meshserve.cluster.service import ModelCard, ServiceHealth, ServiceStats
from meshserve.core.outputs import CompletionDelta
from meshserve.core.sampling_params import SamplingParams
from meshserve.errors import ConfigError, QueueFullError, ReplicaFailedError, UnavailableError, check
from meshserve.workers.checkpoint import load_tokenizer
from meshserve.workers.step import StepOutput, StepPlan

log = logging.getLogger("meshserve.local")

# The scheduler's own queue bound is enforced here instead (see `generate`): refused inside the
# engine loop, a request would kill the loop rather than get a status.
_SCHEDULER_QUEUE = 1 << 24


class _WatchedExecutor:
    """The in-process executor, reporting the exception of a failed step to the service and
    counting the tokens the replica samples (those of requests aborted later included)."""

    def __init__(self, inner: InProcessExecutor, on_failure: Callable[[BaseException], None]) -> None:
        self.inner = inner
        self.on_failure = on_failure
        self.num_sampled = 0

    def start(self):
        return self.inner.start()

    def expert_load(self) -> list[list[int]]:
        """The worker's rows per expert (MoE models), read from any thread: the counters only grow."""
        return self.inner.call("expert_load", [{}])[0]

    def execute_step(self, plan: StepPlan) -> StepOutput:
        self.submit_step(plan)
        return self.collect_step()

    def submit_step(self, plan: StepPlan) -> None:
        try:
            self.inner.submit_step(plan)
        except BaseException as exc:
            self.on_failure(exc)
            raise

    def collect_step(self) -> StepOutput:
        try:
            output = self.inner.collect_step()
        except BaseException as exc:
            self.on_failure(exc)
            raise
        self.num_sampled += len(output.sampled)
        return output

    def shutdown(self) -> None:
        self.inner.shutdown()


@dataclass
class _Totals:
    """Counters of replicas that died, added to the live replica's so totals never go back."""

    prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    generated_tokens: int = 0


class LocalService:
    """One in-process replica behind the InferenceService protocol.

    config:     the replica's settings (its scheduler's max_queue is the default queue bound)
    max_queue:  requests accepted but not yet running before QueueFullError
    model_name: the name clients use (default: the checkpoint folder's name)
    """

    def __init__(self, config: EngineConfig, *, max_queue: int | None = None, model_name: str | None = None,
                 device: str | None = None, progress: bool = False, retry_seconds: float = 0.5) -> None:
        check(config.model.model is not None, "model", None, "a checkpoint directory")
        self.max_queue = config.scheduler.max_queue if max_queue is None else max_queue
        check(isinstance(self.max_queue, int) and self.max_queue >= 1, "max_queue", self.max_queue, "an integer >= 1")
        self.config = replace(config, scheduler=replace(config.scheduler, max_queue=_SCHEDULER_QUEUE))
        self.model_name = model_name or _default_name(config.model.model)
        self._device = device
        self._progress = progress
        self._retry_seconds = retry_seconds
        self.tokenizer = load_tokenizer(config.model.model)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._active: dict[str, tuple[AsyncEngine, str]] = {}  # request id -> (its replica, the id it has there)
        self._serial = itertools.count()
        self._totals = _Totals()
        self._prompt_tokens = 0
        self._closed = False
        self._failure = ""  # why the replica is down; "" while it serves
        self._recovery: asyncio.Task | None = None
        self._engine: AsyncEngine | None = self._build()
        info = self._engine.core.info
        self._card = ModelCard(self.model_name, info.max_model_len, info.vocab_size)

    def _build(self) -> AsyncEngine:
        executor = _WatchedExecutor(InProcessExecutor(self.config, device=self._device, progress=self._progress),
                                    self._on_failure)
        return AsyncEngine(EngineCore(self.config, executor=executor))

    # -- InferenceService ----------------------------------------------------------------------

    def models(self) -> list[ModelCard]:
        return [self._card]

    async def embed(self, inputs, *, truncate: bool = False):
        """A generative model has no Embed (the protocol's task rule)."""
        raise ConfigError("model", self.model_name, "an embed model for Embed; this model's task is 'generate' "
                          "(use Generate)")

    def tokenize(self, text: str) -> list[int]:
        check(self.tokenizer is not None, "text", "text", "token ids: the checkpoint has no tokenizer.json")
        return self.tokenizer.encode(text).ids

    def detokenize(self, token_ids: Sequence[int]) -> str:
        check(self.tokenizer is not None, "token_ids", "ids", "a checkpoint with a tokenizer.json")
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams, *,
                       request_id: str) -> AsyncIterator[CompletionDelta]:
        """Deltas of one request. Every refusal is raised before the request is queued."""
        engine = self._serving_engine()
        self._loop = asyncio.get_running_loop()
        # The engine knows the request by a fresh id: a client may reuse an id as soon as its
        # stream ends, before the engine has processed the abort of the old one.
        engine_id = f"{next(self._serial)}:{request_id}"
        req = engine.core.make_request(prompt, params, request_id=engine_id)  # ConfigError
        self._check_fits(len(req.prompt_ids), params, engine.core)
        check(request_id not in self._active, "request_id", request_id, "an id not in use")
        if self.num_waiting >= self.max_queue:
            raise QueueFullError(f"the queue is full: {self.num_waiting} requests waiting, max_queue={self.max_queue}"
                                 "; retry later")
        self._active[request_id] = (engine, engine_id)
        self._prompt_tokens += len(req.prompt_ids)
        try:
            # aclosing: leaving this generator must close the engine's stream now (which aborts
            # the request and frees its blocks), not whenever the garbage collector gets to it.
            async with contextlib.aclosing(engine.stream(req.prompt_ids, params, request_id=engine_id)) as deltas:
                async for delta in deltas:
                    delta.request_id = request_id
                    yield delta
        except EngineDeadError as exc:
            if engine is self._engine:  # it died outside a step (the executor saw nothing)
                self._replica_died(exc.__cause__ or exc)
            raise ReplicaFailedError(f"the replica serving request {request_id!r} failed: {exc.__cause__!r}") from exc
        finally:
            self._active.pop(request_id, None)

    async def abort(self, request_id: str) -> bool:
        if request_id not in self._active:
            return False
        engine, engine_id = self._active[request_id]
        engine.abort(engine_id)
        return True

    def health(self) -> ServiceHealth:
        if self._closed:
            return ServiceHealth(False, 0, 1, "shutting down")
        serving = self._engine is not None
        return ServiceHealth(serving, int(serving), 1, self._failure)

    @property
    def num_running(self) -> int:
        engine = self._engine
        return len(engine.core.scheduler.running) if engine is not None else 0

    @property
    def num_waiting(self) -> int:
        """Accepted requests not running: queued in the engine, waiting, or preempted."""
        return max(0, len(self._active) - self.num_running)

    def stats(self) -> ServiceStats:
        engine = self._engine
        if engine is None:
            totals = self._totals
            return ServiceStats(len(self._active), 0, 0.0, 0, totals.prefix_hit_tokens, self._prompt_tokens,
                                totals.num_preemptions, totals.generated_tokens)
        core = engine.core
        return ServiceStats(
            num_waiting=self.num_waiting, num_running=self.num_running, kv_usage=core.kv.usage,
            num_free_kv_blocks=core.kv.num_free_blocks,
            prefix_hit_tokens=self._totals.prefix_hit_tokens + core.kv.stats.prefix_hit_tokens,
            prompt_tokens=self._prompt_tokens,
            num_preemptions=self._totals.num_preemptions + core.scheduler.stats.num_preemptions,
            generated_tokens=self._totals.generated_tokens + core.executor.num_sampled,
            expert_tokens=core.executor.expert_load(),
        )

    async def shutdown(self, *, drain: bool = True) -> None:
        """Refuse new requests; with drain, let running ones finish, otherwise abort them."""
        self._closed = True
        if not drain:
            for engine, engine_id in list(self._active.values()):
                engine.abort(engine_id)
        while self._active:
            await asyncio.sleep(0.02)
        if self._recovery is not None:
            self._recovery.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._recovery
        engine, self._engine = self._engine, None
        if engine is not None:
            await engine.shutdown()

    # -- admission ---------------------------------------------------------------------------

    def _serving_engine(self) -> AsyncEngine:
        if self._closed:
            raise UnavailableError("the server is shutting down")
        if self._engine is None:
            raise UnavailableError(f"no healthy replica: {self._failure or 'starting'}")
        return self._engine

    @staticmethod
    def _check_fits(num_prompt: int, params: SamplingParams, core: EngineCore) -> None:
        """The worker sizes the KV cache for at least one max_model_len sequence, so a request within
        max_model_len always fits the cache of one replica: no CapacityError can arise here."""
        max_len = core.info.max_model_len
        room = max_len - num_prompt
        check(params.max_tokens <= room, "max_tokens", params.max_tokens,
              f"an integer in [1, {room}]: max_model_len={max_len} minus the prompt's {num_prompt} tokens")

    # -- replica failure and recovery -----------------------------------------------------------

    def _on_failure(self, exc: BaseException) -> None:
        """Called in the engine's step thread when a step raised."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._replica_died, exc)

    def _replica_died(self, exc: BaseException) -> None:
        dead, self._engine = self._engine, None
        if dead is None or self._closed:
            return
        self._failure = f"replica failed: {exc!r}; rebuilding"
        log.error("replica failed: %r; rebuilding it", exc)
        self._totals.prefix_hit_tokens += dead.core.kv.stats.prefix_hit_tokens
        self._totals.num_preemptions += dead.core.scheduler.stats.num_preemptions
        self._totals.generated_tokens += dead.core.executor.num_sampled
        self._recovery = asyncio.get_running_loop().create_task(self._rebuild(dead))

    async def _rebuild(self, dead: AsyncEngine) -> None:
        # Only the executor is shut down: the dead engine's loop ends by itself once it has handed
        # the error to every open stream (cancelling it now could beat it to that and leave the
        # streams waiting forever).
        with contextlib.suppress(Exception):
            dead.core.shutdown()
        delay = self._retry_seconds
        while not self._closed:
            try:
                engine = await asyncio.to_thread(self._build)
            except Exception as exc:  # keep trying: a replica is never given up for good
                self._failure = f"rebuilding the replica failed: {exc!r}; retrying in {delay:.1f} s"
                log.error("%s", self._failure)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 30.0)
                continue
            if self._closed:
                await engine.shutdown()
                return
            self._engine, self._failure = engine, ""
            log.warning("replica rebuilt; serving again")
            return


def _default_name(model_dir: str | Path) -> str:
    from meshserve.demo_model import DEMO_MODEL_DIR

    path = Path(model_dir).resolve()
    return "meshserve-demo" if path == DEMO_MODEL_DIR else path.name

