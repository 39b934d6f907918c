"""EmbeddingService: the InferenceService of an embedding model served in this process.

An encoder-only model has no KV cache, no scheduler and no streams: each `embed` call runs the
Embedder (workers/embedder.py) once, in a worker thread so that the event loop keeps serving,
one call at a time (a lock; the model is not re-entrant), with at most `max_queue` calls
waiting for it (more raise QueueFullError). `generate` is refused with a
ConfigError naming the model's task, as the protocol asks. Nothing can fail in the background,
so health is constant: serving while not shut down.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from meshserve.cluster.service import ModelCard, ServiceHealth, ServiceStats
from meshserve.core.checkpoint_files import encode_ids
from meshserve.core.outputs import CompletionDelta
from meshserve.core.sampling_params import SamplingParams
from meshserve.errors import ConfigError, QueueFullError, UnavailableError, check
from meshserve.workers.embedder import Embedder, EmbeddingOutput


class EmbeddingService:
    """One in-process embedding model behind the InferenceService protocol.

    model_name: the name clients use (default: the checkpoint folder's name).
    max_queue:  embed calls waiting for the model before QueueFullError.
    """

    def __init__(self, embedder: Embedder, *, model_name: str | None = None, max_queue: int = 1024) -> None:
        check(isinstance(max_queue, int) and max_queue >= 1, "max_queue", max_queue, "an integer >= 1")
        self.embedder = embedder
        self.max_queue = max_queue
        self._waiting = 0
        self.model_name = model_name or Path(embedder.model_dir).name
        self._card = ModelCard(self.model_name, embedder.max_model_len, embedder.arch.vocab_size, task="embed")
        self._lock = asyncio.Lock()
        self._closed = False
        self._prompt_tokens = 0

    # -- InferenceService ----------------------------------------------------------------------

    def models(self) -> list[ModelCard]:
        return [self._card]

    def tokenize(self, text: str) -> list[int]:
        check(self.embedder.tokenizer is not None, "text", "text", "token ids: the checkpoint has no tokenizer.json")
        return encode_ids(self.embedder.tokenizer, text)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        check(self.embedder.tokenizer is not None, "token_ids", "ids", "text: the checkpoint has no tokenizer.json")
        return self.embedder.tokenizer.decode(list(token_ids))

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None, *, request_id: str,
                       beam=None, caller: str = "", priority: int = 0) -> AsyncIterator[CompletionDelta]:
        raise ConfigError("model", self.model_name, "a generate model for Generate; this model's task is 'embed' "
                          "(use Embed)")
        yield  # an async generator, like every other service's generate

    async def abort(self, request_id: str) -> bool:
        return False  # embeddings run to the end of their call; nothing is ever running by id

    async def embed(self, inputs: Sequence[str | Sequence[int]], *, truncate: bool = False) -> list[EmbeddingOutput]:
        if self._closed:
            raise UnavailableError(f"model {self.model_name!r} is shut down")
        if self._waiting >= self.max_queue:
            raise QueueFullError(f"{self._waiting} embed calls are waiting (max_queue={self.max_queue})")
        self._waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self._waiting -= 1
        try:
            outs = await asyncio.to_thread(self.embedder.embed, list(inputs), truncate=truncate)
        finally:
            self._lock.release()
        self._prompt_tokens += sum(o.num_tokens for o in outs)
        return outs

    def health(self) -> ServiceHealth:
        serving = not self._closed
        return ServiceHealth(serving=serving, healthy_replicas=int(serving), total_replicas=1,
                             detail="" if serving else "shut down")

    def stats(self) -> ServiceStats:
        return ServiceStats(num_waiting=self._waiting, num_running=int(self._lock.locked()), kv_usage=0.0,
                            num_free_kv_blocks=0, prefix_hit_tokens=0, prompt_tokens=self._prompt_tokens,
                            num_preemptions=0, generated_tokens=0)

    async def shutdown(self, *, drain: bool = True) -> None:
        if drain:
            async with self._lock:
                self._closed = True
        self._closed = True
