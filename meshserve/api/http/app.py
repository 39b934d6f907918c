"""The OpenAI-compatible routes over an InferenceService (FastAPI).

    GET  /health                 200 while the service can serve, else 503 (open without the token)
    GET  /v1/models              the served models; GET /v1/models/{id} one of them
    POST /v1/completions         text or token-id prompt(s); SSE when stream is true
    POST /v1/chat/completions    messages through the model's chat template; SSE when stream is true
    POST /v1/embeddings          pooled vectors of an embedding model (float lists or base64)
    /tokenize, /detokenize, /version, /metrics, /openapi.json: vLLM's utility routes (vllm_routes.py)

Every response carries x-request-id (the client's, else a fresh one: request_id.py).

Every /v1 route needs `Authorization: Bearer <token>` when the server has a token (the same
file as gRPC's); a body over `max_body_bytes` is a 413 before it is read whole. Each prompt of
a request is one request to the service (`<id>-<index>` when there are several), all opened
before the response starts (see streams.py).
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Sequence

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from meshserve.api import convert
from meshserve.api.auth import is_known
from meshserve.api.callers import http_caller
from meshserve.api.convert import ApiLimits
from meshserve.api.generation_defaults import SamplingDefaults
from meshserve.api.http.body import ShapeLimits, parse_body
from meshserve.api.http.chat import ChatTemplate
from meshserve.api.http.errors import error_of, error_response, install_handlers
from meshserve.api.http.openapi import ERROR_RESPONSES, add_body_schemas, request_body
from meshserve.api.http.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from meshserve.api.http.request_id import RequestIdMiddleware
from meshserve.api.http.responses import Shaper, finish_of, sse, usage_of
from meshserve.api.http.streams import (
    ClientGone,
    Drain,
    Job,
    SSEResponse,
    collect,
    merged,
    new_id,
    open_jobs,
    until_disconnect,
)
from meshserve.api.http.vllm_routes import TOKEN_PATHS, add_vllm_routes, version
from meshserve.api.metrics import ServerMetrics
from meshserve.api.tools.choice import ToolMode
from meshserve.api.tools.streaming import ToolStream
from meshserve.cluster.service import InferenceService, ModelCard
from meshserve.core import hop_trace
from meshserve.core.outputs import CompletionDelta
from meshserve.errors import ConfigError, UnavailableError, check

CLIENT_CLOSED = 499  # nginx's code for "the client closed the connection"; nobody reads it


class _Guard:
    """ASGI middleware: the bearer token on /v1 routes (401), and the body size limit (413)."""

    def __init__(self, app: ASGIApp, *, tokens: Sequence[str], max_body_bytes: int) -> None:
        self.app = app
        self.expected = tuple(t.encode() for t in tokens) or None
        self.max_body_bytes = max_body_bytes

    def _authorized(self, scope: Scope) -> bool:
        given = [v for k, v in scope["headers"] if k == b"authorization"]
        if len(given) != 1:
            return False
        scheme, _, token = given[0].partition(b" ")
        return scheme.lower() == b"bearer" and is_known(token.strip(), self.expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        guarded = path.startswith("/v1") or path in TOKEN_PATHS
        if self.expected is not None and guarded and not self._authorized(scope):
            response = error_response(401, "missing or wrong bearer token: send the header "
                                           "'Authorization: Bearer <token>'", headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        limit = self.max_body_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            return await error_response(413, f"the body has {int(length)} bytes; at most {limit} are allowed "
                                             "(--max-message-bytes)")(scope, receive, send)
        seen = 0

        async def counted() -> dict:  # a chunked body has no length: count as it comes
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise HTTPException(413, f"the body is over {limit} bytes (--max-message-bytes)")
            return message

        await self.app(scope, counted, send)


class OpenAIFrontend:
    """The routes, their service and settings. `app` is the ASGI application."""

    def __init__(self, service: InferenceService, *, metrics: ServerMetrics | None = None,
                 limits: ApiLimits = ApiLimits(), tokens: Sequence[str] = (),
                 chat_template: ChatTemplate | None = None, max_body_bytes: int = 16 << 20,
                 metrics_token: str | None = None, sampling_defaults: SamplingDefaults = SamplingDefaults()) -> None:
        self.service = service
        self.metrics = metrics
        self.limits = limits
        self.chat_template = chat_template
        self.sampling_defaults = sampling_defaults
        self.auth_required = bool(tokens)
        self.drain = Drain()  # expired by HttpServer.stop when the drain time is over
        api = FastAPI(title="meshserve", version=version(), docs_url=None, redoc_url=None,
                      openapi_url="/openapi.json")
        install_handlers(api)
        api.add_api_route("/health", self.health, methods=["GET"])
        api.add_api_route("/v1/models", self.list_models, methods=["GET"])
        api.add_api_route("/v1/models/{model_id:path}", self.get_model, methods=["GET"], responses=ERROR_RESPONSES)
        # These read their own body (body.py): the document gets its schema from openapi.py.
        for path, route, model in (("/v1/completions", self.completions, CompletionRequest),
                                   ("/v1/chat/completions", self.chat_completions, ChatCompletionRequest),
                                   ("/v1/embeddings", self.embeddings, EmbeddingRequest)):
            api.add_api_route(path, route, methods=["POST"], openapi_extra=request_body(model),
                              responses=ERROR_RESPONSES)
        add_body_schemas(api, (CompletionRequest, ChatCompletionRequest, EmbeddingRequest))
        add_vllm_routes(api, self, metrics_token=metrics_token)
        self.app = RequestIdMiddleware(_Guard(api, tokens=tokens, max_body_bytes=max_body_bytes))

    # -- small routes ------------------------------------------------------------------------------

    async def health(self) -> Response:
        state = self.service.health()
        if state.serving:
            return JSONResponse({"status": "ok", "healthy_replicas": state.healthy_replicas,
                                 "total_replicas": state.total_replicas})
        return error_response(503, f"not serving: {state.detail or 'no healthy replica'}")

    @staticmethod
    def _model_entry(card: ModelCard) -> dict:
        return {"id": card.name, "object": "model", "created": 0, "owned_by": "meshserve",
                "max_model_len": card.max_model_len, "vocab_size": card.vocab_size, "task": card.task}

    async def list_models(self) -> dict:
        return {"object": "list", "data": [self._model_entry(c) for c in self.service.models()]}

    async def get_model(self, model_id: str) -> dict:
        return self._model_entry(convert.find_model(self.service.models(), model_id))

    # -- generation --------------------------------------------------------------------------------

    def _generate_card(self, name: str) -> ModelCard:
        card = convert.find_model(self.service.models(), name)
        check(card.task == "generate", "model", card.name,
              f"a generate model for this route; this model's task is {card.task!r} (use /v1/embeddings)")
        return card

    def _tokenizer(self, card: ModelCard, field: str):
        """convert.tokenize for this model, the caps of `limits`, errors naming `field`."""
        return lambda text: convert.tokenize(self.service, text, card=card, limits=self.limits, field=field)

    def _jobs(self, request_id: str, prompts: Sequence[list[int]], body, card: ModelCard, *,
              max_tokens: int | None, logprobs: int | None, request: Request) -> list[Job]:
        """One job per prompt, within the request's token budget, for this caller (api/callers.py)."""
        caller = http_caller(request.scope["headers"], request.scope.get("client"), auth_required=self.auth_required)
        jobs = []
        for i, ids in enumerate(prompts):
            n = max_tokens if max_tokens is not None else max(1, card.max_model_len - len(ids))
            beam = body.beam_params(max_tokens=n)
            params = None if beam else body.sampling_params(max_tokens=n, logprobs=logprobs,
                                                            vocab_size=card.vocab_size, limits=self.limits)
            jobs.append(Job(i, request_id if len(prompts) == 1 else f"{request_id}-{i}", ids, params, beam,
                            caller=caller, priority=body.priority))
        convert.check_token_budget([len(j.prompt_ids) for j in jobs], body.width,
                                   [convert.max_tokens_of(j.params, j.beam) for j in jobs], self.limits,
                                   max_model_len=card.max_model_len)
        return jobs

    def _shape_limits(self) -> ShapeLimits:
        """What a body may hold: strings for the fields of max_prompts_per_request prompts (chat messages,
        stop strings, tools...), values for that many prompts of max_model_len token ids."""
        try:
            max_model_len = max(card.max_model_len for card in self.service.models())
        except UnavailableError:  # still starting: the route answers 503 after reading
            max_model_len = 1
        limits = self.limits
        ids = min(limits.max_prompts_per_request * max_model_len, limits.max_tokens_per_request)
        return ShapeLimits(max_strings=limits.max_json_strings, max_values=ids + limits.max_json_strings)

    async def _prompt_ids(self, prompts: Sequence[str | list[int]], card: ModelCard, *,
                          truncate_prompt_tokens: int | None = None) -> list[list[int]]:
        """Token ids of every prompt; texts are checked first, then tokenized (in one worker thread
        unless short: convert.INLINE_TOKENIZE_CHARS in all).
        Token-id prompts are cut to their last truncate_prompt_tokens before their length is
        checked (texts are cut once tokenized, by the caller)."""
        out: list[list[int] | None] = []
        for i, p in enumerate(prompts):
            field = "prompt"  # OpenAI's param; the message says which prompt
            if isinstance(p, str):
                check(p != "", field, "" if len(prompts) == 1 else f"<prompt {i}: empty>",
                      "a non-empty string (or token ids)")
                convert.check_text_size(p, max_model_len=card.max_model_len, limits=self.limits, field=field)
                convert.check_encodable(p, field)
                out.append(None)
            else:
                out.append(convert.token_ids_of(p, card.vocab_size, field=field, max_model_len=card.max_model_len,
                                                truncate_prompt_tokens=truncate_prompt_tokens))
        texts = [p for p in prompts if isinstance(p, str)]
        if texts:
            if sum(map(len, texts)) <= convert.INLINE_TOKENIZE_CHARS:  # short: the thread hop would cost more
                encoded = iter([self.service.tokenize(t) for t in texts])
            else:
                encoded = iter(await asyncio.to_thread(lambda: [self.service.tokenize(t) for t in texts]))
            out = [next(encoded) if x is None else x for x in out]
        return out

    async def _respond(self, request: Request, jobs: list[Job], whole, events) -> Response:
        """Open the jobs (refusals become the status), then stream `events()` or send `whole()`."""
        if events is not None:
            await self.drain.unless_expired(open_jobs(self.service, jobs, self.metrics))
            return SSEResponse(events(), jobs, drain=self.drain, error_event=lambda exc: sse(error_of(exc)[1]))

        async def run() -> dict:
            await open_jobs(self.service, jobs, self.metrics)
            await collect(jobs)
            return whole()

        try:
            return JSONResponse(await until_disconnect(request, self.drain.unless_expired(run())))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)

    @staticmethod
    async def _events(chunks: AsyncIterator[dict], jobs: list[Job], shaper: Shaper, obj: str,
                      include_usage: bool) -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield sse(chunk)
            if include_usage:
                yield sse(shaper.usage_chunk(obj, jobs))
        except Exception as exc:  # after the 200 went out, an error is an event
            yield sse(error_of(exc)[1])
        yield sse("[DONE]")

    async def completions(self, request: Request) -> Response:
        traced = hop_trace.enabled()
        client_id = request.headers.get("x-request-id") if traced else None  # the marks' key (request_id.py)
        hop_trace.mark("http.route", client_id)
        body = await parse_body(request, CompletionRequest, self._shape_limits())
        hop_trace.mark("http.body_parsed", client_id)
        body.check()
        body = self.sampling_defaults.apply(body)
        card = self._generate_card(body.model)
        prompts = body.prompts()
        convert.check_prompt_count(len(prompts), body.width, self.limits)
        ids = [body.truncated(x) for x in await self._prompt_ids(prompts, card,
                                                                 truncate_prompt_tokens=body.truncate_prompt_tokens)]
        request_id = new_id("cmpl")
        jobs = self._jobs(request_id, ids, body, card, max_tokens=body.max_tokens, logprobs=body.logprobs,
                          request=request)
        if traced:  # the client's id and the service's ids of its prompts, on one mark: one request
            hop_trace.mark("http.tokenized", client_id, *(job.request_id for job in jobs))
        shaper = Shaper(request_id, card.name, self.service.detokenize)
        want_logprobs = body.logprobs is not None
        echo = [p if isinstance(p, str) else self.service.detokenize(p) for p in prompts] if body.echo else None
        if not body.stream:
            return await self._respond(request, jobs, lambda: shaper.completion(jobs, echo=echo,
                                                                               want_logprobs=want_logprobs), None)

        async def chunks() -> AsyncIterator[dict]:
            offsets = [0] * sum(job.n for job in jobs)  # per choice
            prompt_logprobs: dict[int, list] = {}  # per job, shaped once: each of its choices' first chunk has them
            given: set[int] = set()  # choices whose chunk had them
            async for job, delta in merged(jobs):
                if delta.prompt_logprobs is not None:  # (on a request's first delta)
                    prompt_logprobs[job.index] = shaper.prompt_logprobs(delta.prompt_logprobs)
                i = job.choice_index(delta)
                owed = job.index in prompt_logprobs and i not in given
                if delta.text or delta.finish_reason is not None or delta.logprobs or owed:
                    if owed:
                        given.add(i)
                    chunk = shaper.completion_chunk(job, delta, offset=offsets[i], want_logprobs=want_logprobs,
                                                    usage=body.include_usage,
                                                    prompt_logprobs=prompt_logprobs[job.index] if owed else None)
                    if body.continuous_usage:
                        chunk["usage"] = usage_of(jobs)
                    yield chunk
                    offsets[i] += len(delta.text)

        return await self._respond(request, jobs, None, lambda: self._events(
            chunks(), jobs, shaper, "text_completion", body.include_usage))

    async def chat_completions(self, request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest, self._shape_limits())
        template = self.chat_template
        parser = template.tool_parser if template is not None else None
        body.check(parses_tools=parser is not None)
        body = self.sampling_defaults.apply(body)
        card = self._generate_card(body.model)
        convert.check_prompt_count(1, body.width, self.limits)
        if template is None:
            raise ConfigError("messages", f"<{len(body.messages)} messages>",
                              f"a model with a chat template: {card.name!r} has none (start the server with "
                              "--chat-template FILE, or use /v1/completions)")
        tools = body.tool_request
        text = template.render([m.for_template() for m in body.messages], tools=tools.template_tools(),
                               add_generation_prompt=body.add_generation_prompt, **(body.chat_template_kwargs or {}))
        ids = body.truncated(await template.prompt_ids(text, self._tokenizer(card, "messages")))
        request_id = new_id("chatcmpl")
        jobs = self._jobs(request_id, [ids], body, card, max_tokens=body.requested_max_tokens,
                          logprobs=body.num_logprobs, request=request)
        shaper = Shaper(request_id, card.name, self.service.detokenize)
        if not body.stream:
            return await self._respond(request, jobs, lambda: shaper.chat(jobs, want_logprobs=body.logprobs,
                                                                          tools=tools, parser=parser), None)
        streams: dict[int, ToolStream] = {}  # per choice, when tools shape the output

        def chat_chunks(job, delta) -> list[dict]:
            if tools.mode is ToolMode.NONE:
                return [shaper.chat_chunk(job, delta, want_logprobs=body.logprobs, usage=body.include_usage)]
            i = job.choice_index(delta)
            stream = streams.setdefault(i, ToolStream(tools, parser))
            parts = stream.feed(delta.text) + (stream.finish() if delta.finish_reason is not None else [])
            finish = "tool_calls" if stream.called and finish_of(delta) == "stop" else None
            parts = parts or [{}]
            return [shaper.chat_chunk(job, delta if k == len(parts) - 1 else CompletionDelta(
                        delta.request_id, [], "", index=delta.index, logprobs=delta.logprobs if k == 0 else []),
                        want_logprobs=body.logprobs, usage=body.include_usage, message=part, finish_reason=finish)
                    for k, part in enumerate(parts)]  # fmt: skip

        async def chunks() -> AsyncIterator[dict]:
            for i in range(jobs[0].n):
                yield shaper.chat_chunk(None, None, index=i, usage=body.include_usage)
            async for job, delta in merged(jobs):
                if delta.text or delta.finish_reason is not None or delta.logprobs or delta.prompt_logprobs:
                    for chunk in chat_chunks(job, delta):
                        if body.continuous_usage:
                            chunk["usage"] = usage_of(jobs)
                        yield chunk

        return await self._respond(request, jobs, None, lambda: self._events(
            chunks(), jobs, shaper, "chat.completion.chunk", body.include_usage))

    # -- embeddings --------------------------------------------------------------------------------

    async def embeddings(self, request: Request) -> Response:
        body = await parse_body(request, EmbeddingRequest, self._shape_limits())
        card = convert.find_model(self.service.models(), body.model)
        check(card.task == "embed", "model", card.name,
              f"an embed model for /v1/embeddings; this model's task is {card.task!r} (use /v1/completions)")
        inputs = convert.capped_embed_inputs(body.inputs(), card=card, limits=self.limits, field="input",
                                             truncate=False)
        try:
            outputs = await until_disconnect(request, self.service.embed(inputs))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        dims = outputs[0].embedding.shape[0]
        check(body.dimensions in (None, dims), "dimensions", body.dimensions, f"unset or {dims} (the model's size)")
        data = []
        for i, out in enumerate(outputs):
            vector = out.embedding.numpy().astype("<f4")
            value = base64.b64encode(vector.tobytes()).decode() if body.encoding_format == "base64" else vector.tolist()
            data.append({"object": "embedding", "index": i, "embedding": value})
        tokens = sum(o.num_tokens for o in outputs)
        return JSONResponse({"object": "list", "data": data, "model": card.name,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
