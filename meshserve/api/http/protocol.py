"""The request bodies of the OpenAI-compatible routes, as pydantic models, and their sampling settings.

Field names and defaults are OpenAI's; the extras that vLLM users pass (top_k, min_p,
repetition_penalty, ignore_eos, stop_token_ids, include_stop_str_in_output,
skip_special_tokens, add_generation_prompt, chat_template_kwargs, min_tokens, bad_words,
allowed_token_ids, truncate_prompt_tokens, structured_outputs and guided_*) are accepted too. An
unknown field is refused (400 naming it) rather than silently ignored. Ranges are checked by
SamplingParams and api/convert.py, the same checks gRPC requests get, so both faces refuse
the same values with the same messages.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from meshserve.api import convert, structured
from meshserve.api.convert import ApiLimits
from meshserve.api.tools.choice import ToolMode, ToolRequest
from meshserve.cluster.fair_queue import PRIORITY_RANGE
from meshserve.core.beam_params import BeamSearchParams
from meshserve.core.sampling_params import MAX_LOGPROBS, SamplingParams
from meshserve.core.structured_outputs import StructuredOutputs
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
    min_tokens: int = 0
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* (api/structured.py)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    _structured: StructuredOutputs | None = PrivateAttr(default=None)  # set by check_common

    priority: int = 0  # vLLM's: lower is served first (cluster/fair_queue.py)

    def check_common(self) -> None:
        low, high = PRIORITY_RANGE
        check(low <= self.priority <= high, "priority", self.priority, f"an integer in [{low}, {high}]")
        check(self.stream or self.stream_options is None, "stream_options", self.stream_options,
              "unset unless stream is true")
        check(self.guided_decoding_backend in (None, "auto", "xgrammar"), "guided_decoding_backend",
              self.guided_decoding_backend, "unset, 'auto' or 'xgrammar' (the engine this server runs)")
        check(self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1, "truncate_prompt_tokens",
              self.truncate_prompt_tokens, "unset or an integer >= 1")
        self._structured = self.structured()
        check(self._structured is None or not self.use_beam_search, "use_beam_search", True,
              "false with structured outputs")

    def structured(self) -> StructuredOutputs | None:
        """The one structured-output constraint the request asks for (None: free text)."""
        guided = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}
        so = self.structured_outputs
        check(so is None or isinstance(so, dict), "structured_outputs", so, "an object")
        vllm = structured.from_fields(so or {}, prefix="structured_outputs.")
        return structured.combine(("response_format", structured.from_response_format(self.response_format)),
                                  ("structured_outputs", vllm),
                                  ("guided_*", structured.from_fields(guided, prefix="guided_")))

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def truncated(self, ids: list[int]) -> list[int]:
        """The prompt's last truncate_prompt_tokens ids (all of them when unset)."""
        k = self.truncate_prompt_tokens
        return ids[-k:] if k is not None and len(ids) > k else ids

    def logit_bias_ids(self, vocab_size: int) -> dict[int, float]:
        out = {}
        for key, value in (self.logit_bias or {}).items():
            check(key.lstrip("-").isdigit() and 0 <= int(key) < vocab_size, "logit_bias", key,
                  f"token ids in [0, {vocab_size}) as strings")
            out[int(key)] = value
        return out

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def beam_params(self, *, max_tokens: int) -> BeamSearchParams | None:
        """use_beam_search: the search's settings (beam_width = n); sampling fields then stay unset."""
        if not self.use_beam_search:
            return None
        sampled = sorted(name for name in ("temperature", "top_p", "top_k", "min_p", "seed", "best_of",
                                           "prompt_logprobs") if getattr(self, name, None) is not None)
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
                              skip_special_tokens=self.skip_special_tokens and not self.keeps_special_tokens,
                              min_tokens=self.min_tokens, logit_bias=self.logit_bias_ids(vocab_size),
                              allowed_token_ids=self.allowed_token_ids, bad_words=tuple(self.bad_words or ()),
                              structured_outputs=self.constraint(), truncate_prompt_tokens=self.truncate_prompt_tokens,
                              prompt_logprobs=self.prompt_logprobs)

    def constraint(self) -> StructuredOutputs | None:
        """What constrains the output (set by check())."""
        return getattr(self, "_structured", None)

    @property
    def keeps_special_tokens(self) -> bool:
        """The text must keep special tokens (a tool-call parser reads its markers)."""
        return False


class CompletionRequest(_Sampling):
    """POST /v1/completions: OpenAI's fields and vLLM's extras (docs/http.md)."""

    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = Field(None, description="not supported: refused unless unset or null")

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
        calls = out.get("tool_calls")
        if isinstance(calls, list):  # templates write arguments with tojson: an object, not OpenAI's JSON text
            out["tool_calls"] = [_call_for_template(c) for c in calls]
        return out


def _call_for_template(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        arguments = json.loads(fn["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**fn, "arguments": arguments}}


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions: OpenAI's fields and vLLM's extras (docs/http.md)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    _tools: ToolRequest | None = PrivateAttr(default=None)
    _parses_tools: bool = PrivateAttr(default=False)

    def check(self, *, parses_tools: bool = False) -> None:
        """parses_tools: the server has a tool-call parser for this model (tool_choice auto)."""
        self.check_common()
        self._tools = tools = ToolRequest.of(self.tools, self.tool_choice,
                                             parallel=self.parallel_tool_calls is not False)
        grammar = tools.grammar()
        if grammar is not None:
            check(self._structured is None, "tool_choice", self.tool_choice,
                  "'auto' or 'none' when the request also asks for structured output")
            check(not self.use_beam_search, "use_beam_search", True, "false with tool_choice required or named")
            self._structured = grammar
        self._parses_tools = parses_tools and tools.mode is ToolMode.AUTO
        check(self.top_logprobs is None or (self.logprobs and 0 <= self.top_logprobs <= MAX_LOGPROBS),
              "top_logprobs", self.top_logprobs, f"unset, or an integer in [0, {MAX_LOGPROBS}] with logprobs true")
        reserved = sorted(set(self.chat_template_kwargs or ()) & _RESERVED)
        check(not reserved, "chat_template_kwargs", reserved, f"keys other than {sorted(_RESERVED)}")

    @property
    def tool_request(self) -> ToolRequest:
        """The tools and tool_choice (after check())."""
        return self._tools if self._tools is not None else ToolRequest.of(None, None)

    @property
    def keeps_special_tokens(self) -> bool:
        return self._parses_tools

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class EmbeddingRequest(_Body):
    """POST /v1/embeddings, for an embedding model (docs/http.md)."""

    model: str = ""
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        return prompt_list(self.input, "input")
