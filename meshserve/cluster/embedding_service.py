"""EmbeddingService: the InferenceService of an embedding model served in this process.

An encoder-only model has no KV cache, no scheduler and no streams: each `embed` call runs the
Embedder (workers/embedder.py) once, in a worker thread so that the event loop keeps serving,
one call at a time (a lock; the model is not re-entrant). `generate` is refused with a
ConfigError naming the model's task, as the protocol asks. Nothing can fail in the background,
so health is constant: serving while not shut down.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from meshserve.cluster.outputs import CompletionDelta
from meshserve.cluster.service import ModelCard, ServiceHealth, ServiceStats
from meshserve.errors import ConfigError, UnavailableError, check
from meshserve.workers.embedder import Embedder, EmbeddingOutput
from meshserve.workers.sampling_params import SamplingParams


class EmbeddingService:
    """One in-process embedding model behind the InferenceService protocol.

    model_name: the name clients use (default: the checkpoint folder's name).
    """

    def __init__(self, embedder: Embedder, *, model_name: str | None = None) -> None:
        self.embedder = embedder
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
        return self.embedder.tokenizer.encode(text).ids

    def detokenize(self, token_ids: Sequence[int]) -> str:
        check(self.embedder.tokenizer is not None, "token_ids", "ids", "text: the checkpoint has no tokenizer.json")
        return self.embedder.tokenizer.decode(list(token_ids))

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams, *,
                       request_id: str) -> AsyncIterator[CompletionDelta]:
        raise ConfigError("model", self.model_name, "a generate model for Generate; this model's task is 'embed' "
                          "(use Embed)")
        yield  # an async generator, like every other service's generate

    async def abort(self, request_id: str) -> bool:
        return False  # embeddings run to the end of their call; nothing is ever running by id

    async def embed(self, inputs: Sequence[str | Sequence[int]], *, truncate: bool = False) -> list[EmbeddingOutput]:
        if self._closed:
            raise UnavailableError(f"model {self.model_name!r} is shut down")
        async with self._lock:
            outs = await asyncio.to_thread(self.embedder.embed, list(inputs), truncate=truncate)
        self._prompt_tokens += sum(o.num_tokens for o in outs)
        return outs

    def health(self) -> ServiceHealth:
        serving = not self._closed
        return ServiceHealth(serving=serving, healthy_replicas=int(serving), total_replicas=1,
                             detail="" if serving else "shut down")

    def stats(self) -> ServiceStats:
        return ServiceStats(num_waiting=0, num_running=int(self._lock.locked()), kv_usage=0.0, num_free_kv_blocks=0,
                            prefix_hit_tokens=0, prompt_tokens=self._prompt_tokens, num_preemptions=0,
                            generated_tokens=0)

    async def shutdown(self, *, drain: bool = True) -> None:
        if drain:
            async with self._lock:
                self._closed = True
        self._closed = True
