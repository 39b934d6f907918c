"""What callers get back: a delta per step while streaming, a RequestOutput when done."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshserve.cluster.request import FinishReason
from meshserve.workers.sampler import TokenLogprobs


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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
