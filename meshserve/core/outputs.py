"""What callers get back: a delta per step while streaming, a RequestOutput when done.

Every layer speaks these: the sampler produces TokenLogprobs, the scheduler sets FinishReason,
the engines stream CompletionDelta and the API converts them to its messages.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached, or the context reached max_model_len
    ABORT = "abort"  # cancelled by the caller


@dataclass(frozen=True)
class TokenLogprobs:
    """logprob of the sampled token, and the top-n (token id, logprob) pairs, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass
class CompletionDelta:
    """New tokens and text of one request since its previous delta.

    finished is True on a request's last delta; finish_reason says why; stop_reason is the stop
    string or stop token id that ended it (None for EOS, length or abort).
    """

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass
class RequestOutput:
    """A finished request.

    token_ids: every generated token (a final EOS or stop token id included); text: their
    decoded text, cut before a stop string (unless include_stop_str_in_output).
    num_cached_tokens: prompt tokens served from the prefix cache.
    encoder_prompt_token_ids: encoder-decoder models (as vLLM's field): the encoder's input, the
    prompt given; prompt_token_ids are then the decoder's start tokens. None for decoder-only models.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    encoder_prompt_token_ids: list[int] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
