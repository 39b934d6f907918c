"""The methods of meshserve.v1.Inference over an InferenceService.

Generate, step by step: parse (a body that does not parse is INVALID_ARGUMENT), find the model
(NOT_FOUND), check prompt and sampling settings (INVALID_ARGUMENT), tokenize a text prompt, ask
the service for a stream (its refusals become their status codes, nothing is queued), then
write one response per delta. When the client cancels, or its deadline passes, gRPC cancels
this coroutine; closing the service's stream then aborts the request and frees its KV blocks
at once. The handler writes with `context.write` (not by yielding) so that the closing happens
here, deterministically, whatever gRPC was doing when the cancellation came.

Request ids are the caller's: the service sees `<scope>:<id>`, where the scope is a digest of
the caller's bearer token (auth.scope_of), so Abort finds only the caller's own requests
(another caller's id is NOT_FOUND, as an unknown one) and a duplicate id is one of the
caller's own running requests. Every method parses its body strictly (INVALID_ARGUMENT).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from importlib.metadata import PackageNotFoundError, version

import grpc

from meshserve.api import convert
from meshserve.api.auth import scope_of
from meshserve.api.callers import grpc_caller
from meshserve.api.convert import ApiLimits, Malformed
from meshserve.api.generation_defaults import SamplingDefaults
from meshserve.api.metrics import ServerMetrics
from meshserve.api.status import status_of
from meshserve.cluster.service import InferenceService, ModelCard
from meshserve.core import hop_trace
from meshserve.errors import ConfigError, MeshserveError, NotFoundError, UnavailableError
from meshserve.v1 import inference_pb2 as pb

DRAINED = "the server is shutting down: the drain time (--drain-seconds) is over; retry on another server"


def _version() -> str:
    try:
        return version("meshserve")
    except PackageNotFoundError:
        return "unknown"


class InferenceServicer:
    def __init__(self, service: InferenceService, *, metrics: ServerMetrics, limits: ApiLimits = ApiLimits(),
                 max_message_bytes: int, max_queue: int, auth_required: bool, tls: bool,
                 sampling_defaults: SamplingDefaults = SamplingDefaults()) -> None:
        self.service = service
        self.sampling_defaults = sampling_defaults  # --generation-config
        self.metrics = metrics
        self.limits = limits
        self._info = dict(max_message_bytes=max_message_bytes, max_queue=max_queue, auth_required=auth_required,
                          tls=tls)
        self._streams: set[asyncio.Task] = set()  # Generate calls in flight (their handler tasks)
        self._drained = False

    def expire_streams(self) -> int:
        """The drain time is over: every Generate still open ends UNAVAILABLE with the reason."""
        self._drained = True
        for task in self._streams:
            task.cancel()
        return len(self._streams)

    # -- helpers --------------------------------------------------------------------------------

    def _model(self, name: str) -> ModelCard:
        return convert.find_model(self.service.models(), name)

    async def _tokenize(self, text: str, card: ModelCard) -> list[int]:
        return await convert.tokenize(self.service, text, card=card, limits=self.limits, field="text")

    def _scope(self, context: grpc.aio.ServicerContext) -> str:
        return scope_of(context.invocation_metadata(), auth_required=self._info["auth_required"])

    def _scoped(self, request_id: str, context: grpc.aio.ServicerContext, scope: str | None = None) -> str:
        """The service's id of the caller's `request_id` (see the module doc); scope: the call's,
        when the caller has read it already."""
        return f"{self._scope(context) if scope is None else scope}:{request_id}"

    @staticmethod
    def _parsed(request):
        """The request, or INVALID_ARGUMENT for a body that did not parse."""
        if isinstance(request, Malformed):
            raise request.error()
        return request

    @staticmethod
    async def _fail(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
        code, message = status_of(exc)
        await context.abort(code, message)

    # -- Generate ---------------------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest | Malformed, context: grpc.aio.ServicerContext) -> None:
        if hop_trace.enabled():  # keyed by the client's request_id (a malformed request has none)
            hop_trace.mark("grpc.handler", getattr(request, "request_id", None))
        timer = self.metrics.timer()
        code, completed = grpc.StatusCode.OK, False
        stream = scoped = None
        task = asyncio.current_task()
        self._streams.add(task)
        try:
            if self._drained:
                raise UnavailableError(DRAINED)
            card = self._model(self._parsed(request).model)
            beam = convert.beam_params_of(request)
            params = None if beam else convert.sampling_params_of(self.sampling_defaults.apply_proto(request.sampling),
                                                                  card.vocab_size, self.limits)
            truncate = params.truncate_prompt_tokens if params is not None else None  # (checked: >= 1)
            prompt = convert.prompt_of(request, card.vocab_size, max_model_len=card.max_model_len,
                                       truncate_prompt_tokens=truncate)
            request_id = convert.request_id_of(request.request_id, self.limits) or uuid.uuid4().hex
            width = convert.width_of(params, beam)
            convert.check_prompt_count(1, width, self.limits)
            ids = await self._tokenize(prompt, card) if isinstance(prompt, str) else prompt
            if params is not None and params.truncate_prompt_tokens is not None:
                ids = ids[-params.truncate_prompt_tokens:]  # (the engine would too: usage counts what runs)
            convert.check_token_budget([len(ids)], width, [convert.max_tokens_of(params, beam)], self.limits,
                                       max_model_len=card.max_model_len)
            scope = self._scope(context)  # read once: for the stream's id and the caller's name
            scoped = self._scoped(request_id, context, scope)
            caller = grpc_caller(context, auth_required=self._info["auth_required"], scope=scope)
            stream = self.service.generate(ids, params, request_id=scoped, beam=beam, caller=caller,
                                           priority=request.priority)
            num_tokens = 0
            async for delta in stream:
                timer.tokens(len(delta.token_ids))
                num_tokens += len(delta.token_ids)
                if not delta.token_ids and delta.finish_reason is None:
                    continue
                usage = pb.Usage(prompt_tokens=len(ids), completion_tokens=num_tokens,
                                 cached_tokens=delta.num_cached_tokens) if delta.finished else None
                response = convert.response_of(delta, request_id, usage)
                hop_trace.mark("grpc.write", request_id, scoped)  # the client's id and the service's: links them
                await context.write(response)
                if delta.finished:
                    completed = True
                    break
        except asyncio.CancelledError:
            if self._drained and task.cancelling() == 1 and not context.cancelled():  # expire_streams, not the client
                task.uncancel()
                code = grpc.StatusCode.UNAVAILABLE
                await context.abort(code, DRAINED)
            remaining = context.time_remaining()
            expired = remaining is not None and remaining <= 0
            code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:
            if scoped is not None and isinstance(exc, ConfigError) and (exc.field, exc.value) == ("request_id", scoped):
                exc = ConfigError("request_id", request_id, exc.allowed)  # the caller's id, not the scoped one
            code, message = status_of(exc)
            await context.abort(code, message, trailing_metadata=_retry_after(exc))
        finally:
            self._streams.discard(task)
            if stream is not None:
                with contextlib.suppress(Exception):
                    await stream.aclose()  # aborts the request if it is still running
            timer.finish(code.name, completed=completed)

    # -- the others -------------------------------------------------------------------------------

    async def Tokenize(self, request: pb.TokenizeRequest | Malformed, context) -> pb.TokenizeResponse:
        try:
            card = self._model(self._parsed(request).model)
            return pb.TokenizeResponse(token_ids=await self._tokenize(request.text, card))
        except MeshserveError as exc:
            await self._fail(context, exc)

    async def ListModels(self, request: pb.ListModelsRequest | Malformed, context) -> pb.ListModelsResponse:
        try:
            self._parsed(request)
            return pb.ListModelsResponse(models=[convert.model_of(c) for c in self.service.models()])
        except MeshserveError as exc:
            await self._fail(context, exc)

    async def Abort(self, request: pb.AbortRequest | Malformed, context) -> pb.AbortResponse:
        try:
            request_id = convert.request_id_of(self._parsed(request).request_id, self.limits)
            if request_id == "":
                raise ConfigError("request_id", "", "the id of a running request")
            if not await self.service.abort(self._scoped(request_id, context)):
                raise NotFoundError(f"request_id={request_id!r} is not a running request of yours")
            return pb.AbortResponse()
        except MeshserveError as exc:
            await self._fail(context, exc)

    async def Embed(self, request: pb.EmbedRequest | Malformed, context) -> pb.EmbedResponse:
        """Every input checked, then one call to the service (it runs the model off the loop)."""
        try:
            card = self._model(self._parsed(request).model)
            inputs = convert.embed_inputs_of(request, card=card, limits=self.limits)
            return convert.embed_response_of(await self.service.embed(inputs, truncate=request.truncate))
        except MeshserveError as exc:
            await self._fail(context, exc)

    async def ServerInfo(self, request: pb.ServerInfoRequest | Malformed, context) -> pb.ServerInfoResponse:
        try:
            self._parsed(request)
        except MeshserveError as exc:
            await self._fail(context, exc)  # raises: the call ends here
        health = self.service.health()
        info = self._info
        try:
            models = [convert.model_of(c) for c in self.service.models()]
        except UnavailableError:  # still starting: the status call answers, with no model yet
            models = []
        return pb.ServerInfoResponse(
            version=_version(), models=models,
            serving=health.serving, healthy_replicas=health.healthy_replicas,
            total_replicas=health.total_replicas, health_detail=health.detail,
            stats=convert.stats_of(self.service.stats()),
            limits=self.limits.to_proto(max_message_bytes=info["max_message_bytes"], max_queue=info["max_queue"]),
            auth_required=info["auth_required"], tls=info["tls"])


def _retry_after(exc: BaseException) -> tuple:
    """A refusal to retry later carries `retry-after` (seconds) in the trailing metadata, as HTTP's header."""
    seconds = getattr(exc, "retry_after_s", None)
    return () if seconds is None else (("retry-after", str(seconds)),)


def method_handlers(servicer: InferenceServicer) -> grpc.GenericRpcHandler:
    """The service's handlers, registered by hand rather than with the generated helper so that
    requests parse leniently (see convert.lenient_parser)."""
    service = pb.DESCRIPTOR.services_by_name["Inference"]
    handlers = {}
    for method in service.methods:
        request_type = getattr(pb, method.input_type.name)
        response_type = getattr(pb, method.output_type.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(getattr(servicer, method.name),
                                     request_deserializer=convert.lenient_parser(request_type),
                                     response_serializer=response_type.SerializeToString)
    return grpc.method_handlers_generic_handler(service.full_name, handlers)
