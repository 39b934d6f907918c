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
from typing import TYPE_CHECKING

from meshserve.config import SchedulerConfig
from meshserve.core.beam_params import BeamSearchParams
from meshserve.core.checkpoint_files import encode_ids
from meshserve.core.sampling_params import SamplingParams
from meshserve.engine.request import Request
from meshserve.errors import check

if TYPE_CHECKING:
    from meshserve.workers.worker import WorkerInfo


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

    def __init__(self, tokenizer, *, vocab_size: int, max_model_len: int, scheduler: SchedulerConfig,
                 decoder_prompt: Sequence[int] = (), max_encoder_len: int = 0) -> None:
        """decoder_prompt, max_encoder_len: an encoder-decoder model's (WorkerInfo): the prompt is
        then the encoder's input and the decoder starts from decoder_prompt."""
        self.decoder_prompt = list(decoder_prompt)
        self.max_encoder_len = max_encoder_len
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.scheduler = scheduler

    @classmethod
    def of_model(cls, tokenizer, info: WorkerInfo, scheduler: SchedulerConfig) -> RequestValidator:
        """The checks of the model a replica's workers serve (their WorkerInfo)."""
        return cls(tokenizer, vocab_size=info.vocab_size, max_model_len=info.max_model_len, scheduler=scheduler,
                   decoder_prompt=info.decoder_prompt, max_encoder_len=info.max_encoder_len)

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
        if params.structured_outputs is not None:  # (a constraint made without its constructors; cached check)
            params.structured_outputs.check("structured_outputs")
        limit = self.scheduler.max_num_seqs
        check(params.num_samples <= limit, "best_of" if params.best_of is not None else "n", params.num_samples,
              f"at most max_num_seqs={limit} (the samples of a request run side by side)")
        text, ids = self.encode(prompt)
        if params.truncate_prompt_tokens is not None and len(ids) > params.truncate_prompt_tokens:
            ids = ids[-params.truncate_prompt_tokens:]  # the prompt's end is what the output continues
        if self.decoder_prompt:  # (its samples and beams would need the encoder's blocks forked too)
            check(beam is None, "beam", beam, "None: beam search is not built for encoder-decoder models")
            check(params.num_samples == 1, "n", params.num_samples, "1 for encoder-decoder models (best_of too)")
            return self._encoder_decoder(text, ids, params, request_id, arrival, fit_max_tokens)
        check_prompt_length(len(ids), max_model_len=self.max_model_len, scheduler=self.scheduler)
        if fit_max_tokens:
            room = self.max_model_len - len(ids)
            check(params.max_tokens <= room, "max_tokens", params.max_tokens,
                  f"an integer in [1, {room}]: max_model_len={self.max_model_len} minus the prompt's "
                  f"{len(ids)} tokens")
        return Request(request_id, ids, params, arrival=arrival, prompt=text, beam=beam)

    def _encoder_decoder(self, text: str | None, ids: list[int], params: SamplingParams, request_id: str,
                         arrival: int, fit_max_tokens: bool) -> Request:
        """The prompt is the encoder's input: it runs whole in the request's first step, beside the
        decoder's start tokens (encoder inputs are not chunked)."""
        start = len(self.decoder_prompt)
        limit = min(self.max_encoder_len, self.scheduler.max_num_batched_tokens - start)
        check(1 <= len(ids) <= limit, "prompt", f"{len(ids)} tokens",
              f"1..{limit} tokens: an encoder input runs whole in one step (the encoder's "
              f"max_position_embeddings={self.max_encoder_len}; max_num_batched_tokens="
              f"{self.scheduler.max_num_batched_tokens} minus {start} decoder start token(s))")
        check(start < self.max_model_len, "max_model_len", self.max_model_len,
              f"more than the {start} decoder start token(s)")
        if fit_max_tokens:
            room = self.max_model_len - start
            check(params.max_tokens <= room, "max_tokens", params.max_tokens,
                  f"an integer in [1, {room}]: max_model_len={self.max_model_len} (the decoder's length) minus "
                  f"{start} decoder start token(s)")
        return Request(request_id, list(self.decoder_prompt), params, arrival=arrival, prompt=text, encoder_ids=ids)
