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
    ERROR = "error"  # refused by the replica after admission (the delta's `error` says why)


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
    index: which completion of the request (n > 1: 0..n-1, best first when best_of > n). With
    n > 1 a completion ends at its delta with a finish_reason, and `finished` marks the request's
    last delta (all completions ended). cumulative_logprob: the completion's sum of token
    logprobs, on its last delta, when logprobs were computed (logprobs asked, or best_of > n).
    num_cached_tokens: prompt tokens the request found in the prefix cache (on every delta).
    prompt_logprobs: on the request's first delta when it asked for them: per prompt token, None
    for the first (nothing predicts it), then its logprobs (SamplingParams.prompt_logprobs).
    error: on a last delta with finish_reason ERROR, the error to give the caller (its grammar did
    not compile: docs/structured_outputs.md); the replica hands it to the stream in place of the
    delta, so front-ends see a refusal, not a delta.
    """

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    index: int = 0
    cumulative_logprob: float | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: Exception | None = None


@dataclass
class CompletionOutput:
    """One of a request's n completions (RequestOutput.outputs[index])."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """A finished request.

    token_ids: every generated token (a final EOS or stop token id included); text: their
    decoded text, cut before a stop string (unless include_stop_str_in_output).
    num_cached_tokens: prompt tokens served from the prefix cache.
    outputs: every completion (n of them, index order); token_ids, text, finish_reason,
    stop_reason and logprobs above are those of outputs[0].
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
    outputs: list[CompletionOutput] = field(default_factory=list)
    encoder_prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # as CompletionDelta's

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class ChoiceAccumulator:
    """A request's deltas gathered into its completions, by index (n >= 1)."""

    def __init__(self) -> None:
        self._by_index: dict[int, CompletionOutput] = {}
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None  # the request's (one delta carries them)

    def add(self, delta: CompletionDelta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        out = self._by_index.setdefault(delta.index, CompletionOutput(delta.index, [], "", None))
        out.token_ids += delta.token_ids
        out.text += delta.text
        if delta.logprobs:
            out.logprobs = (out.logprobs or []) + delta.logprobs
        if delta.finish_reason is not None:
            out.finish_reason, out.stop_reason = delta.finish_reason, delta.stop_reason
        if delta.cumulative_logprob is not None:
            out.cumulative_logprob = delta.cumulative_logprob

    def outputs(self) -> list[CompletionOutput]:
        return [self._by_index[i] for i in sorted(self._by_index)]


@dataclass
class BeamSequence:
    """One beam-search hypothesis: generated token ids (a final EOS included), their text,
    cum_logprob (sum of token logprobs) and score (cum_logprob / len(token_ids) ** length_penalty,
    what beams are ranked by)."""

    token_ids: list[int]
    cum_logprob: float
    score: float
    text: str
    finish_reason: FinishReason


@dataclass
class BeamSearchOutput:
    """LLM.beam_search's result for one prompt: `sequences` best first (beam_width of them)."""

    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]
