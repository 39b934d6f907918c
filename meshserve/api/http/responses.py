"""OpenAI's response bodies and stream chunks, built from the service's deltas.

Completions (`text_completion`) and chat completions (`chat.completion`, and
`chat.completion.chunk` while streaming) differ in where text and logprobs go; usage counts
are prompt tokens (after the chat template), generated tokens (a final EOS or stop token
included, as the engine counts them), their sum, and `prompt_tokens_details.cached_tokens`
(prompt tokens found in the prefix cache). A streamed response ends with a chunk of
empty choices carrying the usage when `stream_options.include_usage` is set, then
`data: [DONE]`; with `continuous_usage_stats` every chunk carries the usage so far.

`prompt_logprobs` (vLLM's shape): per prompt token, None for the first, then
`{"<token id>": {"logprob", "decoded_token", "rank"}}` for the token itself and the top n at its
position (rank 1..n for those; the prompt token's rank only when it is among them). The engine
computes them once per prompt; as vLLM, completions repeat them in every choice of that prompt
(streamed: with each choice's first chunk), chat has them once, at the top of the response
(streamed: with the first chunk that has them).

Chat choices with tools (api/tools/): the message's `tool_calls` and `content` (None when the
output was only calls), finish_reason "tool_calls" when the choice ended with calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import orjson

from meshserve.api.http.streams import Job
from meshserve.api.tools.choice import ToolRequest
from meshserve.api.tools.parsers import ToolParser
from meshserve.api.tools.streaming import split_output
from meshserve.core.outputs import CompletionDelta, TokenLogprobs

Detokenize = Callable[[Sequence[int]], str]


def sse(payload: dict | str) -> bytes:
    """One server-sent event. orjson, not json: a chunk is encoded per token per stream, and
    json.dumps took ~28 µs a completion chunk where orjson takes ~2 µs (measured on the 2-core CPU).
    Like json.dumps(ensure_ascii=False) it writes UTF-8 as is; a NaN or infinity becomes null
    (JSON has none)."""
    data = payload.encode() if isinstance(payload, str) else orjson.dumps(payload)
    return b"data: " + data + b"\n\n"


def usage_of(jobs: Sequence[Job]) -> dict:
    prompt = sum(len(j.prompt_ids) for j in jobs)
    completion = sum(j.num_tokens for j in jobs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(j.num_cached_tokens for j in jobs)}}


def finish_of(delta: CompletionDelta) -> str | None:
    """Set on a choice's last delta (with n > 1 a choice may end before the request)."""
    return str(delta.finish_reason) if delta.finish_reason is not None else None


def stop_reason_of(delta: CompletionDelta) -> str | int | None:
    return delta.stop_reason if delta.finish_reason is not None else None


class Shaper:
    """Bodies for one request: its id, creation time and model name."""

    def __init__(self, request_id: str, model: str, detokenize: Detokenize) -> None:
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.detokenize = detokenize

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -- logprobs ----------------------------------------------------------------------------------

    def _token(self, token_id: int) -> str:
        return self.detokenize([token_id])

    def completion_logprobs(self, lps: Sequence[TokenLogprobs], offset: int) -> dict:
        """{tokens, token_logprobs, top_logprobs, text_offset}; offsets count from `offset`."""
        tokens = [self._token(lp.token_id) for lp in lps]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self._token(t): v for t, v in lp.top} for lp in lps], "text_offset": offsets}

    def _chat_entry(self, token_id: int, logprob: float) -> dict:
        token = self._token(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    def chat_logprobs(self, lps: Sequence[TokenLogprobs]) -> dict:
        return {"content": [{**self._chat_entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._chat_entry(t, v) for t, v in lp.top]} for lp in lps]}

    def prompt_logprobs(self, lps: Sequence[TokenLogprobs | None] | None) -> list | None:
        if lps is None:
            return None
        out: list = []
        for lp in lps:
            if lp is None:
                out.append(None)
                continue
            entry = {str(t): {"logprob": v, "rank": r, "decoded_token": self._token(t)}
                     for r, (t, v) in enumerate(lp.top, start=1)}
            entry.setdefault(str(lp.token_id), {"logprob": lp.logprob, "decoded_token": self._token(lp.token_id)})
            out.append(entry)
        return out

    # -- whole responses ---------------------------------------------------------------------------

    def completion(self, jobs: Sequence[Job], *, echo: Sequence[str] | None, want_logprobs: bool) -> dict:
        choices = []
        prompt_logprobs = {id(job): self.prompt_logprobs(job.prompt_logprobs) for job in jobs}
        for job, pieces in ((j, p) for j in jobs for p in j.choices()):
            prefix = echo[job.index] if echo else ""
            last = pieces[-1]
            lps = [lp for d in pieces for lp in d.logprobs]
            choices.append({
                "index": job.choice_index(last), "text": prefix + "".join(d.text for d in pieces),
                "logprobs": self.completion_logprobs(lps, len(prefix)) if want_logprobs else None,
                "finish_reason": finish_of(last), "stop_reason": stop_reason_of(last)})
            if prompt_logprobs[id(job)] is not None:  # (the prompt's: the same in each of its choices)
                choices[-1]["prompt_logprobs"] = prompt_logprobs[id(job)]
        return {**self._head("text_completion"), "choices": choices, "usage": usage_of(jobs)}

    def chat(self, jobs: Sequence[Job], *, want_logprobs: bool, tools: ToolRequest | None = None,
             parser: ToolParser | None = None) -> dict:
        choices = []
        for pieces in (pieces for job in jobs for pieces in job.choices()):
            last = pieces[-1]
            lps = [lp for d in pieces for lp in d.logprobs]
            text = "".join(d.text for d in pieces)
            content, calls = split_output(tools, parser, text) if tools is not None else (text, [])
            message = {"role": "assistant", "content": content}
            finish = finish_of(last)
            if calls:
                message["tool_calls"] = [c.to_openai() for c in calls]
                finish = "tool_calls" if finish == "stop" else finish
            choices.append({
                "index": jobs[0].choice_index(last), "message": message,
                "logprobs": self.chat_logprobs(lps) if want_logprobs else None,
                "finish_reason": finish, "stop_reason": stop_reason_of(last)})
        out = {**self._head("chat.completion"), "choices": choices, "usage": usage_of(jobs)}
        if jobs and jobs[0].prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs(jobs[0].prompt_logprobs)
        return out

    # -- stream chunks -----------------------------------------------------------------------------

    def completion_chunk(self, job: Job, delta: CompletionDelta, *, offset: int, want_logprobs: bool,
                         usage: bool, prompt_logprobs: list | None = None) -> dict:
        """prompt_logprobs: already shaped (self.prompt_logprobs), for a choice's first chunk."""
        choice = {"index": job.choice_index(delta), "text": delta.text,
                  "logprobs": self.completion_logprobs(delta.logprobs, offset) if want_logprobs else None,
                  "finish_reason": finish_of(delta), "stop_reason": stop_reason_of(delta)}
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs
        out = {**self._head("text_completion"), "choices": [choice]}
        if usage:
            out["usage"] = None
        return out

    def chat_chunk(self, job: Job | None, delta: CompletionDelta | None, *, index: int = 0,
                   want_logprobs: bool = False, usage: bool = False, message: dict | None = None,
                   finish_reason: str | None = None) -> dict:
        """message: the chunk's `delta` object when not just the delta's text (tool calls);
        finish_reason: replaces the delta's ("tool_calls")."""
        if delta is None:  # the opening chunk of choice `index`: the role
            choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}
        else:
            if message is None:
                message = {"content": delta.text} if delta.text else {}
            choice = {"index": job.choice_index(delta), "delta": message,
                      "logprobs": self.chat_logprobs(delta.logprobs) if want_logprobs else None,
                      "finish_reason": finish_reason or finish_of(delta), "stop_reason": stop_reason_of(delta)}
        out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        if delta is not None and delta.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs(delta.prompt_logprobs)
        if usage:
            out["usage"] = None
        return out

    def usage_chunk(self, obj: str, jobs: Sequence[Job]) -> dict:
        return {**self._head(obj), "choices": [], "usage": usage_of(jobs)}
