"""The request bodies of the OpenAI-compatible routes, as pydantic models, and their sampling settings.

Field names and defaults are OpenAI's; the extras that vLLM users pass (top_k, min_p,
repetition_penalty, ignore_eos, stop_token_ids, include_stop_str_in_output,
skip_special_tokens, add_generation_prompt, chat_template_kwargs) are accepted too. An
unknown field is refused (400 naming it) rather than silently ignored. Ranges are checked by
SamplingParams and api/convert.py, the same checks gRPC requests get, so both faces refuse
the same values with the same messages.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from meshserve.api import convert
from meshserve.api.convert import ApiLimits
from meshserve.cluster.fair_queue import PRIORITY_RANGE
from meshserve.core.beam_params import BeamSearchParams
from meshserve.core.sampling_params import MAX_LOGPROBS, SamplingParams
from meshserve.errors import check

Prompt = str | list[str] | list[int] | list[list[int]]
# What the route itself passes to the chat template; chat_template_kwargs may not override them.
_RESERVED = frozenset({"messages", "add_generation_prompt", "tools", "documents"})


def prompt_list(value: Prompt, field: str) -> list[str | list[int]]:
    """One text, texts, one token-id list, or token-id lists -> a list of prompts."""
    if isinstance(value, str):
        return [value]
    check(len(value) > 0, field, [], "a non-empty string, list of strings, or token-id list(s)")
    if all(isinstance(x, int) for x in value):
        return [list(value)]
    return list(value)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Body):
    """What completions and chat completions share."""

    model: str = ""
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    use_beam_search: bool = False  # beam search with beam_width = n (vLLM's extra)
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    priority: int = 0  # vLLM's: lower is served first (cluster/fair_queue.py)

    def check_common(self) -> None:
        check(not self.logit_bias, "logit_bias", self.logit_bias, "unset or empty (logit bias is not supported)")
        low, high = PRIORITY_RANGE
        check(low <= self.priority <= high, "priority", self.priority, f"an integer in [{low}, {high}]")
        check(self.stream or self.stream_options is None, "stream_options", self.stream_options,
              "unset unless stream is true")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def beam_params(self, *, max_tokens: int) -> BeamSearchParams | None:
        """use_beam_search: the search's settings (beam_width = n); sampling fields then stay unset."""
        if not self.use_beam_search:
            return None
        sampled = sorted(name for name in ("temperature", "top_p", "top_k", "min_p", "seed", "best_of")
                         if getattr(self, name, None) is not None)
        check(not sampled, sampled[0] if sampled else "", "set", "unset with use_beam_search")
        return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens, length_penalty=self.length_penalty,
                                early_stopping=self.early_stopping, ignore_eos=self.ignore_eos,
                                skip_special_tokens=self.skip_special_tokens)

    @property
    def width(self) -> int:
        """Sequences each prompt runs: n beams, else max(n, best_of)."""
        return self.n if self.use_beam_search else max(self.n, getattr(self, "best_of", None) or 1)

    def sampling_params(self, *, max_tokens: int, logprobs: int | None, vocab_size: int,
                        limits: ApiLimits) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        stop, stop_ids = convert.check_stops(stop, list(self.stop_token_ids or ()), vocab_size, limits)
        check(self.top_k is None or self.top_k >= -1, "top_k", self.top_k, "-1 or 0 (off), or an integer >= 1")
        kw: dict[str, Any] = {name: getattr(self, name) for name in (
            "temperature", "top_p", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty")
            if getattr(self, name) is not None}
        return SamplingParams(**kw, n=self.n, best_of=getattr(self, "best_of", None),
                              top_k=self.top_k if self.top_k and self.top_k >= 1 else None,
                              max_tokens=max_tokens, stop=stop, stop_token_ids=stop_ids, ignore_eos=self.ignore_eos,
                              logprobs=logprobs, include_stop_str_in_output=self.include_stop_str_in_output,
                              skip_special_tokens=self.skip_special_tokens)


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        self.check_common()
        check(self.suffix is None, "suffix", self.suffix, "unset (suffix is not supported)")
        check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", self.logprobs,
              f"unset or an integer in [0, {MAX_LOGPROBS}]")
        check(not (self.echo and self.stream), "echo", self.echo, "false when stream is true")

    def prompts(self) -> list[str | list[int]]:
        return prompt_list(self.prompt, "prompt")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message; fields beyond role and content (name, tool_calls, reasoning_content, ...) reach the template."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[TextPart] | None = None

    def for_template(self) -> dict[str, Any]:
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):  # text parts are joined: text-only templates read a string
            out["content"] = "\n".join(part.text for part in self.content)
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        self.check_common()
        fmt = (self.response_format or {}).get("type", "text")
        check(fmt == "text", "response_format", self.response_format, "unset or {'type': 'text'}")
        check(not self.tools and self.tool_choice in (None, "none"), "tools", "<tools>",
              "unset: tool calls are not parsed by this server")
        check(self.top_logprobs is None or (self.logprobs and 0 <= self.top_logprobs <= MAX_LOGPROBS),
              "top_logprobs", self.top_logprobs, f"unset, or an integer in [0, {MAX_LOGPROBS}] with logprobs true")
        reserved = sorted(set(self.chat_template_kwargs or ()) & _RESERVED)
        check(not reserved, "chat_template_kwargs", reserved, f"keys other than {sorted(_RESERVED)}")

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class EmbeddingRequest(_Body):
    model: str = ""
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        return prompt_list(self.input, "input")
