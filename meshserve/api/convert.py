"""Proto messages to meshserve values and back, checking what the engine does not.

The engine's SamplingParams checks every sampling range (the message names the field with
its proto name: they are the same). This layer adds the limits of a public endpoint (how
many stop strings, how long, request id shape), the prompt's shape and the token id range,
and turns `top_k` -1/0 (the proto's "off") into None.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError, Message

from meshserve.cluster.service import InferenceService, ModelCard, ServiceStats
from meshserve.config import ServerConfig
from meshserve.core.beam_params import BeamSearchParams
from meshserve.core.outputs import CompletionDelta, FinishReason
from meshserve.core.sampling_params import MAX_LOGPROBS, SamplingParams
from meshserve.core.structured_outputs import StructuredOutputs
from meshserve.errors import ConfigError, NotFoundError, check, quote
from meshserve.v1 import inference_pb2 as pb

# Texts longer than this are tokenized in a thread so that the event loop keeps serving; shorter
# ones on the loop (the hop to a worker thread costs more than their tokenizing: ~0.3 ms on the
# 2-core CPU, docs/performance.md "Served time to first token, hop by hop").
INLINE_TOKENIZE_CHARS = 1 << 12
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]+")
_FINISH = {None: pb.FINISH_REASON_UNSPECIFIED, FinishReason.STOP: pb.FINISH_REASON_STOP,
           FinishReason.LENGTH: pb.FINISH_REASON_LENGTH, FinishReason.ABORT: pb.FINISH_REASON_ABORT}
# Optional scalar fields copied to SamplingParams unchanged when set.
_PLAIN = ("temperature", "top_p", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty",
          "max_tokens", "logprobs", "skip_special_tokens", "n", "best_of", "min_tokens", "truncate_prompt_tokens",
          "prompt_logprobs")
_EARLY_STOPPING = {pb.EARLY_STOPPING_HEURISTIC: False, pb.EARLY_STOPPING_ON: True, pb.EARLY_STOPPING_NEVER: "never"}


@dataclass(frozen=True)
class ApiLimits:
    """What one request may ask for, beyond the engine's own ranges."""

    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 64
    max_request_id_chars: int = 128
    # A text longer than max_model_len * this many characters cannot fit the context whatever
    # the tokenizer does (no real vocabulary averages 32 characters a token): it is refused
    # before tokenizing, so that a huge prompt costs neither tokenizer time nor memory.
    max_chars_per_token: int = 32
    # What one request may cost (ServerConfig's fields of the same names; docs/api.md).
    max_prompts_per_request: int = 64
    max_sequences_per_request: int = 256
    max_tokens_per_request: int = 1 << 22
    # JSON strings one HTTP body may hold (keys too); bodies are counted as they arrive (http/body.py).
    max_json_strings: int = 1 << 16

    @classmethod
    def of(cls, server: ServerConfig) -> ApiLimits:
        """The defaults, with the request cost limits of the server's flags."""
        return cls(max_prompts_per_request=server.max_prompts_per_request,
                   max_sequences_per_request=server.max_sequences_per_request,
                   max_tokens_per_request=server.max_tokens_per_request)

    def to_proto(self, *, max_message_bytes: int, max_queue: int) -> pb.Limits:
        return pb.Limits(max_message_bytes=max_message_bytes, max_queue=max_queue,
                         max_stop_strings=self.max_stop_strings, max_stop_string_chars=self.max_stop_string_chars,
                         max_stop_token_ids=self.max_stop_token_ids,
                         max_request_id_chars=self.max_request_id_chars, max_logprobs=MAX_LOGPROBS)


@dataclass(frozen=True)
class Malformed:
    """A request body that did not parse (bad protobuf, or a string that is not UTF-8)."""

    type_name: str
    reason: str

    def error(self) -> ConfigError:
        return ConfigError("request", f"<{self.type_name} that does not parse>",
                           f"a valid protobuf message with UTF-8 text fields ({self.reason})")


def lenient_parser(message_type: type[Message]):
    """A request deserializer that returns Malformed instead of raising (which gRPC would
    report as UNKNOWN), so that the servicer can answer INVALID_ARGUMENT."""
    name = message_type.DESCRIPTOR.full_name

    def parse(data: bytes) -> Message | Malformed:
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return Malformed(name, str(exc).removeprefix(f"Error parsing message with type '{name}': "))

    return parse


def find_model(models: Sequence[ModelCard], name: str) -> ModelCard:
    """The served model called `name` ("" = the first one), or NotFoundError listing them."""
    if name == "":
        return models[0]
    for card in models:
        if card.name == name:
            return card
    raise NotFoundError(f"model={quote(name)} is not served here; models: {[c.name for c in models]}")


def check_text_size(text: str, *, max_model_len: int, limits: ApiLimits, field: str) -> None:
    """Refuse a text that cannot fit max_model_len tokens, by its length alone (before tokenizing)."""
    limit = max_model_len * limits.max_chars_per_token
    check(len(text) <= limit, field, f"<{len(text)} characters>",
          f"at most {limit} characters (max_model_len={max_model_len} tokens x "
          f"{limits.max_chars_per_token} characters per token)")


async def tokenize(service: InferenceService, text: str, *, card: ModelCard, limits: ApiLimits,
                   field: str) -> list[int]:
    """The service's tokenization of `text`, for every front-end (gRPC and HTTP).

    A text over the character cap (check_text_size) is refused before the tokenizer sees it;
    texts over a few KiB are tokenized in a thread. The service's tokenizer releases the GIL
    while it works (tokenizers' encode_batch), so the event loop keeps serving meanwhile."""
    check_text_size(text, max_model_len=card.max_model_len, limits=limits, field=field)
    check_encodable(text, field)
    if len(text) <= INLINE_TOKENIZE_CHARS:
        return service.tokenize(text)
    return await asyncio.to_thread(service.tokenize, text)


def check_prompt_count(num_prompts: int, width: int, limits: ApiLimits) -> None:
    """Before tokenizing: the number of prompts, and of sequences (prompts x `width`: max(n,
    best_of), or the beam width), within the per-request limits."""
    check(num_prompts <= limits.max_prompts_per_request, "prompt", f"<{num_prompts} prompts>",
          f"at most max_prompts_per_request={limits.max_prompts_per_request} prompts in one request")
    seqs = num_prompts * width
    check(seqs <= limits.max_sequences_per_request, "n", f"{num_prompts} prompts x {width}",
          f"at most max_sequences_per_request={limits.max_sequences_per_request} sequences in one request "
          "(prompts x max(n, best_of), or x the beam width)")


def check_token_budget(prompt_lens: Sequence[int], width: int, max_tokens: Sequence[int], limits: ApiLimits, *,
                       max_model_len: int) -> None:
    """After tokenizing: the request's cost, every sequence's prompt + max_tokens summed, within
    max_tokens_per_request (each prompt runs `width` sequences). A sequence counts at most
    max_model_len tokens: a max_tokens past the context is the engine's error to name."""
    cost = sum(width * min(p + m, max_model_len) for p, m in zip(prompt_lens, max_tokens, strict=True))
    check(cost <= limits.max_tokens_per_request, "max_tokens", f"<{cost} tokens of prompt + max_tokens>",
          f"at most max_tokens_per_request={limits.max_tokens_per_request} tokens over the request's sequences "
          "(prompts x max(n, best_of) x (prompt tokens + max_tokens)): lower max_tokens, n or the prompts")


def width_of(params: SamplingParams | None, beam: BeamSearchParams | None) -> int:
    """Sequences one prompt runs: the beam width, else max(n, best_of)."""
    return beam.beam_width if beam is not None else params.num_samples


def max_tokens_of(params: SamplingParams | None, beam: BeamSearchParams | None) -> int:
    return beam.max_tokens if beam is not None else params.max_tokens


def check_encodable(text: str, field: str) -> None:
    """Text the tokenizer can take: UTF-8-encodable, so no lone surrogate (JSON's "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(field, f"<text with {exc.reason} at character {exc.start}>",
                          "text of Unicode characters (a lone UTF-16 surrogate such as \\ud800 is not one)") from None


def _short(text: str, n: int = 40) -> str:
    return text if len(text) <= n else f"{text[:n]}... ({len(text)} characters)"


def prompt_of(request: pb.GenerateRequest, vocab_size: int, *, max_model_len: int | None = None,
              truncate_prompt_tokens: int | None = None) -> str | list[int]:
    """The prompt as text or token ids; refuses an empty or missing prompt and unknown ids. Token
    ids are cut to their last truncate_prompt_tokens (a checked SamplingParams') before any
    length check; a text is cut once tokenized."""
    which = request.WhichOneof("prompt")
    check(which is not None, "prompt", None, "set: one of text or token_ids")
    if which == "text":
        check(request.text != "", "text", "", "a non-empty UTF-8 string")
        return request.text
    return token_ids_of(request.token_ids.ids, vocab_size, max_model_len=max_model_len,
                        truncate_prompt_tokens=truncate_prompt_tokens)


def token_ids_of(ids: Sequence[int], vocab_size: int, *, field: str = "token_ids",
                 max_model_len: int | None = None, truncate_prompt_tokens: int | None = None) -> list[int]:
    """A prompt given as token ids: non-empty; with truncate_prompt_tokens = k (>= 1, checked by
    the caller) only its last k ids are kept, first, as vLLM does (a client asking for the end of
    a long prompt gets it, not a length error); then shorter than max_model_len (by its length
    alone: millions of ids cost nothing more) and every kept id in the vocabulary."""
    check(len(ids) > 0, field, [], "a non-empty list of token ids")
    if truncate_prompt_tokens is not None and len(ids) > truncate_prompt_tokens:
        ids = ids[-truncate_prompt_tokens:]  # (the prompt's end is what the output continues)
    if max_model_len is not None:
        check(len(ids) < max_model_len, "prompt", f"{len(ids)} tokens", f"fewer than max_model_len={max_model_len}")
    ids = list(ids)
    if min(ids) < 0 or max(ids) >= vocab_size:  # at C speed; the list of bad ones only for the message
        bad = [t for t in ids if not 0 <= t < vocab_size]
        check(not bad, field, bad[:5], f"token ids in [0, {vocab_size})")
    return ids


def request_id_of(text: str, limits: ApiLimits) -> str:
    """The client's request id ("" = none given), checked."""
    n = limits.max_request_id_chars
    ok = len(text) <= n and (text == "" or _REQUEST_ID.fullmatch(text) is not None)
    check(ok, "request_id", _short(text), f"at most {n} characters of letters, digits and ._:-")
    return text


def sampling_params_of(msg: pb.SamplingParams, vocab_size: int, limits: ApiLimits) -> SamplingParams:
    # One ListFields call names the fields the client set (a repeated or map field: when not
    # empty): a request sets few, and a HasField / list() per field is ~30 upb calls (issue 41).
    present = {f.name: value for f, value in msg.ListFields()}
    kw: dict[str, object] = {name: present[name] for name in _PLAIN if name in present}
    if "top_k" in present:
        check(msg.top_k >= -1, "top_k", msg.top_k, "-1 or 0 (off), or an integer >= 1")
        kw["top_k"] = msg.top_k if msg.top_k >= 1 else None
    stop, ids = check_stops(list(present.get("stop", ())), list(present.get("stop_token_ids", ())), vocab_size,
                            limits)
    logit_bias, allowed = present.get("logit_bias", {}), present.get("allowed_token_ids", ())
    if logit_bias or allowed:
        bad = [t for t in [*logit_bias, *allowed] if not 0 <= t < vocab_size]
        check(not bad, "logit_bias" if set(bad) & set(logit_bias) else "allowed_token_ids", bad[:5],
              f"token ids in [0, {vocab_size})")
    return SamplingParams(stop=stop, stop_token_ids=ids, ignore_eos=msg.ignore_eos,
                          include_stop_str_in_output=msg.include_stop_str_in_output,
                          logit_bias=dict(sorted(logit_bias.items())),
                          allowed_token_ids=list(allowed) or None, bad_words=list(present.get("bad_words", ())),
                          structured_outputs=structured_outputs_of(msg) if "structured_outputs" in present else None,
                          **kw)


def structured_outputs_of(msg: pb.SamplingParams) -> StructuredOutputs | None:
    if not msg.HasField("structured_outputs"):
        return None
    so = msg.structured_outputs
    kind = so.WhichOneof("kind")
    check(kind is not None, "structured_outputs", "{}", "one of json, json_object, regex, choice, grammar")
    if kind == "json":
        return StructuredOutputs.json_schema(so.json, field="structured_outputs.json")
    if kind == "regex":
        return StructuredOutputs.regex(so.regex, field="structured_outputs.regex")
    if kind == "choice":
        return StructuredOutputs.choice(list(so.choice.choices), field="structured_outputs.choice")
    if kind == "grammar":
        return StructuredOutputs.ebnf(so.grammar, field="structured_outputs.grammar")
    check(so.json_object, "structured_outputs.json_object", False, "true (or another kind)")
    return StructuredOutputs.json_object()


def beam_params_of(request: pb.GenerateRequest) -> BeamSearchParams | None:
    """The request's beam search settings (None: it samples); `sampling` must then be unset."""
    if not request.HasField("beam_search"):
        return None
    check(not request.HasField("sampling"), "sampling", "set", "unset when beam_search is set")
    msg = request.beam_search
    kw: dict[str, object] = {name: getattr(msg, name) for name in ("max_tokens", "length_penalty")
                             if msg.HasField(name)}
    check(msg.early_stopping in _EARLY_STOPPING, "early_stopping", msg.early_stopping,
          "EARLY_STOPPING_HEURISTIC, EARLY_STOPPING_ON or EARLY_STOPPING_NEVER")
    return BeamSearchParams(beam_width=msg.beam_width, early_stopping=_EARLY_STOPPING[msg.early_stopping],
                            ignore_eos=msg.ignore_eos, **kw)


def check_stops(stop: list[str], stop_token_ids: list[int], vocab_size: int,
                limits: ApiLimits) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Stop strings and stop token ids within a public endpoint's limits (gRPC and HTTP alike)."""
    check(len(stop) <= limits.max_stop_strings, "stop", f"{len(stop)} strings",
          f"at most {limits.max_stop_strings} stop strings")
    for s in stop:
        check(1 <= len(s) <= limits.max_stop_string_chars, "stop", _short(s),
              f"strings of 1 to {limits.max_stop_string_chars} characters")
    check(len(stop_token_ids) <= limits.max_stop_token_ids, "stop_token_ids", f"{len(stop_token_ids)} ids",
          f"at most {limits.max_stop_token_ids} ids")
    bad = [t for t in stop_token_ids if not 0 <= t < vocab_size]
    check(not bad, "stop_token_ids", bad[:5], f"token ids in [0, {vocab_size})")
    return tuple(stop), tuple(stop_token_ids)


def response_of(delta: CompletionDelta, request_id: str, usage: pb.Usage | None) -> pb.GenerateResponse:
    out = pb.GenerateResponse(request_id=request_id, token_ids=delta.token_ids, text=delta.text,
                              finish_reason=_FINISH[delta.finish_reason], index=delta.index)
    if delta.cumulative_logprob is not None:
        out.cumulative_logprob = delta.cumulative_logprob
    for lp in delta.logprobs:
        out.logprobs.append(pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                                            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]))
    for lp in filter(None, (delta.prompt_logprobs or ())[1:]):
        out.prompt_logprobs.append(pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                                                   top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]))
    if isinstance(delta.stop_reason, str):
        out.stop_string = delta.stop_reason
    elif isinstance(delta.stop_reason, int):
        out.stop_token_id = delta.stop_reason
    if usage is not None:
        out.usage.CopyFrom(usage)
    return out


def embed_inputs_of(request: pb.EmbedRequest, *, card: ModelCard, limits: ApiLimits) -> list[str | list[int]]:
    """The inputs as texts or token-id lists (the embedder checks lengths and id ranges), texts
    within the character cap (see capped_embed_inputs)."""
    check(len(request.inputs) >= 1, "inputs", [], "at least one input (text or token_ids)")
    out: list[str | list[int]] = []
    for i, item in enumerate(request.inputs):
        which = item.WhichOneof("input")
        check(which is not None, f"inputs[{i}]", None, "set: one of text or token_ids")
        out.append(item.text if which == "text" else list(item.token_ids.ids))
    return capped_embed_inputs(out, card=card, limits=limits, field="inputs", truncate=request.truncate)


def capped_embed_inputs(inputs: Sequence[str | list[int]], *, card: ModelCard, limits: ApiLimits, field: str,
                        truncate: bool) -> list[str | list[int]]:
    """Embedding inputs within the character cap, before any is tokenized: a longer text is
    refused, or with `truncate` cut to the cap (it still holds more than max_model_len tokens,
    which the embedder then cuts exactly)."""
    limit = card.max_model_len * limits.max_chars_per_token
    out = []
    for i, x in enumerate(inputs):
        if isinstance(x, str):
            check_encodable(x, f"{field}[{i}]")
        if isinstance(x, str) and len(x) > limit:
            if not truncate:
                check_text_size(x, max_model_len=card.max_model_len, limits=limits, field=f"{field}[{i}]")
            x = x[:limit]
        out.append(x)
    return out


def embed_response_of(outputs) -> pb.EmbedResponse:
    """EmbeddingOutputs (float32 vectors) -> the response, in input order."""
    dims = outputs[0].embedding.shape[0] if outputs else 0
    return pb.EmbedResponse(dimensions=dims, embeddings=[
        pb.Embedding(values=o.embedding.tolist(), num_tokens=o.num_tokens) for o in outputs])


def model_of(card: ModelCard) -> pb.Model:
    return pb.Model(name=card.name, max_model_len=card.max_model_len, vocab_size=card.vocab_size, task=card.task)


def stats_of(stats: ServiceStats) -> pb.Stats:
    return pb.Stats(num_waiting=stats.num_waiting, num_running=stats.num_running, kv_usage=stats.kv_usage,
                    num_free_kv_blocks=stats.num_free_kv_blocks, prefix_hit_tokens=stats.prefix_hit_tokens,
                    prompt_tokens=stats.prompt_tokens, num_preemptions=stats.num_preemptions,
                    generated_tokens=stats.generated_tokens)
