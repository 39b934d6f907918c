"""What a request must satisfy before anything is queued, checked in one place.

`RequestValidator` turns (prompt, sampling settings, id) into a `Request`, or refuses them with
a ConfigError naming the field, the value and the allowed range; a refusal leaves nothing
behind. The Coordinator (every front-end: gRPC, HTTP, `LLM.stream`) and EngineCore (the offline
`LLM.generate` path) use the same validator; the scheduler adds only what depends on its own
state (an id in use, its queue bound) and reuses `check_prompt_length` for requests handed
over from another replica.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshserve.cluster.request import Request
from meshserve.config import SchedulerConfig
from meshserve.core.beam_params import BeamSearchParams
from meshserve.core.sampling_params import SamplingParams
from meshserve.errors import check
from meshserve.workers.checkpoint import encode_ids


def check_prompt_length(num_tokens: int, *, max_model_len: int, scheduler: SchedulerConfig) -> None:
    """A prompt of `num_tokens` can run: at least one token, room for one more, and one step's
    token budget when prompts are not chunked."""
    check(num_tokens >= 1, "prompt", num_tokens, "at least one token")
    check(num_tokens < max_model_len, "prompt", f"{num_tokens} tokens", f"fewer than max_model_len={max_model_len}")
    if not scheduler.enable_chunked_prefill:
        check(num_tokens <= scheduler.max_num_batched_tokens, "prompt", f"{num_tokens} tokens",
              f"at most max_num_batched_tokens={scheduler.max_num_batched_tokens} without chunked prefill")


class RequestValidator:
    """The admission checks of one model: its tokenizer (None: token-id prompts only), vocabulary
    size, context length and scheduler settings."""

    def __init__(self, tokenizer, *, vocab_size: int, max_model_len: int, scheduler: SchedulerConfig) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.scheduler = scheduler

    def encode(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        """(the text or None, the token ids) of a prompt; token ids must be in the vocabulary."""
        if isinstance(prompt, str):
            check(self.tokenizer is not None, "prompt", "text",
                  "token ids: the checkpoint has no tokenizer.json to encode text")
            return prompt, encode_ids(self.tokenizer, prompt)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        check(not bad, "prompt", bad[:5], f"token ids in [0, {self.vocab_size})")
        return None, ids

    def make(self, prompt: str | Sequence[int], params: SamplingParams | None, *, request_id: str, arrival: int,
             fit_max_tokens: bool = False, beam: BeamSearchParams | None = None) -> Request:
        """A checked Request. fit_max_tokens: refuse a max_tokens the context cannot hold (a
        server refuses what it would cut short; the offline engine stops at max_model_len).
        beam: search instead of sampling (params must be None; the engine checks what depends
        on the model's EOS ids)."""
        if beam is not None:
            check(isinstance(beam, BeamSearchParams), "beam", type(beam).__name__, "a BeamSearchParams")
            check(params is None, "params", params, "None with beam search (BeamSearchParams holds its settings)")
            params = SamplingParams(temperature=0, max_tokens=beam.max_tokens, ignore_eos=True)
            check(beam.beam_width <= self.scheduler.max_num_seqs, "beam_width", beam.beam_width,
                  f"at most max_num_seqs={self.scheduler.max_num_seqs} (the beams run side by side)")
        params = params or SamplingParams()
        check(isinstance(params, SamplingParams), "params", type(params).__name__, "a SamplingParams")
        params.check_vocab(self.vocab_size)
        limit = self.scheduler.max_num_seqs
        check(params.num_samples <= limit, "best_of" if params.best_of is not None else "n", params.num_samples,
              f"at most max_num_seqs={limit} (the samples of a request run side by side)")
        text, ids = self.encode(prompt)
        check_prompt_length(len(ids), max_model_len=self.max_model_len, scheduler=self.scheduler)
        if fit_max_tokens:
            room = self.max_model_len - len(ids)
            check(params.max_tokens <= room, "max_tokens", params.max_tokens,
                  f"an integer in [1, {room}]: max_model_len={self.max_model_len} minus the prompt's "
                  f"{len(ids)} tokens")
        return Request(request_id, ids, params, arrival=arrival, prompt=text, beam=beam)
