"""InferenceClient (synchronous) and AsyncInferenceClient (asyncio, grpc.aio): clients of
meshserve.v1.Inference. The `meshserve client` command is api/client_cli.py.

    from meshserve.api.client import InferenceClient, AsyncInferenceClient

    with InferenceClient("127.0.0.1:50051") as client:
        for text in client.stream_text("The for statement", max_tokens=32, temperature=0):
            print(text, end="", flush=True)
        reply = client.generate("Python supports", max_tokens=16)   # the whole response at once
        print(reply.text, reply.finish_reason, reply.usage.completion_tokens)

    async with AsyncInferenceClient("127.0.0.1:50051", wait_for_ready=True) as client:
        async for text in client.stream_text("Python supports", max_tokens=16):
            print(text, end="")
        info = await client.server_info()      # a ServerInfo dataclass, not a protobuf

Sampling settings are the fields of meshserve.v1.SamplingParams as keywords. Errors are
grpc.RpcError (grpc.aio.AioRpcError) with the server's status code and message.

Retries: the idempotent calls (Tokenize, ListModels, ServerInfo, Embed, health Check) are
retried by gRPC itself on UNAVAILABLE (a server restarting, a replica being rebuilt) with
exponential back-off, per the channel's service config (RETRY_POLICY); Generate and Abort are
not (a retried Generate would run twice). `wait_for_ready=True` makes every call wait for the
channel to connect (up to its timeout) instead of failing UNAVAILABLE at once while the server
is still starting. This module imports grpc and the generated stubs only (no torch).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field, fields

import grpc

from meshserve.v1 import inference_pb2 as pb
from meshserve.v1 import inference_pb2_grpc as pb_grpc

FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}
SERVICE = "meshserve.v1.Inference"
IDEMPOTENT = (("meshserve.v1.Inference", "Tokenize"), ("meshserve.v1.Inference", "ListModels"),
              ("meshserve.v1.Inference", "ServerInfo"), ("meshserve.v1.Inference", "Embed"),
              ("grpc.health.v1.Health", "Check"))
RETRY_POLICY = {"maxAttempts": 5, "initialBackoff": "0.1s", "maxBackoff": "2s", "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"]}


def channel_options(*, max_message_bytes: int, server_name: str | None, retries: bool) -> list[tuple[str, object]]:
    """Message limits both ways, the TLS name override, and the retry policy of the idempotent calls."""
    options: list[tuple[str, object]] = [("grpc.max_receive_message_length", max_message_bytes),
                                         ("grpc.max_send_message_length", max_message_bytes)]
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    if retries:
        config = {"methodConfig": [{"name": [{"service": s, "method": m} for s, m in IDEMPOTENT],
                                    "retryPolicy": RETRY_POLICY}]}
        options += [("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(config))]
    else:
        options.append(("grpc.enable_retries", 0))
    return options


# -- typed results ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    vocab_size: int
    task: str  # "generate" or "embed"


@dataclass(frozen=True)
class ServerStats:
    """Load at the moment of the call; counters are totals since the server started."""

    num_waiting: int
    num_running: int
    kv_usage: float
    num_free_kv_blocks: int
    prefix_hit_tokens: int
    prompt_tokens: int
    num_preemptions: int
    generated_tokens: int


@dataclass(frozen=True)
class ServerLimits:
    max_message_bytes: int
    max_queue: int
    max_stop_strings: int
    max_stop_string_chars: int
    max_stop_token_ids: int
    max_request_id_chars: int
    max_logprobs: int


@dataclass(frozen=True)
class ServerInfo:
    version: str
    models: tuple[ModelInfo, ...]
    serving: bool
    healthy_replicas: int
    total_replicas: int
    health_detail: str
    stats: ServerStats
    limits: ServerLimits
    auth_required: bool
    tls: bool


def typed(cls, message):
    """The dataclass `cls` from the same-named fields of a protobuf `message`."""
    values = {f.name: getattr(message, f.name) for f in fields(cls)}
    if cls is ServerInfo:
        values.update(models=tuple(typed(ModelInfo, m) for m in message.models),
                      stats=typed(ServerStats, message.stats), limits=typed(ServerLimits, message.limits))
    return cls(**values)


@dataclass
class Completion:
    """A whole Generate call: joined text and tokens of completion 0, its last response's fields,
    and every completion by index in `choices` (n > 1, beam search; one entry otherwise)."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finish_reason: str = ""
    stop_reason: str | int | None = None
    usage: pb.Usage = field(default_factory=pb.Usage)
    cumulative_logprob: float | None = None
    choices: dict[int, Completion] = field(default_factory=dict)
    prompt_logprobs: list[pb.TokenLogprob] = field(default_factory=list)  # prompt tokens 1.. (prompt_logprobs)

    def add(self, r: pb.GenerateResponse) -> None:
        self.request_id = r.request_id
        if r.HasField("usage"):
            self.usage = r.usage
        self.prompt_logprobs += r.prompt_logprobs
        choice = self.choices.setdefault(r.index, Completion(request_id=r.request_id))
        for out in (choice, self) if r.index == 0 else (choice,):
            out.text += r.text
            out.token_ids += r.token_ids
            out.logprobs += r.logprobs
            if r.HasField("cumulative_logprob"):
                out.cumulative_logprob = r.cumulative_logprob
            if r.finish_reason:
                out.finish_reason = FINISH_NAMES[r.finish_reason]
                which = r.WhichOneof("stop_reason")
                out.stop_reason = getattr(r, which) if which else None


def generate_request(prompt: str | Sequence[int], *, model: str = "", request_id: str = "",
                     beam_search: dict | None = None, **sampling) -> pb.GenerateRequest:
    """beam_search: BeamSearchParams fields (beam_width=..., ...) instead of sampling settings."""
    req = pb.GenerateRequest(model=model, request_id=request_id)
    if beam_search is not None:
        req.beam_search.CopyFrom(pb.BeamSearchParams(**beam_search))
    if sampling or beam_search is None:
        req.sampling.CopyFrom(pb.SamplingParams(**sampling))
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def embed_request(inputs: Sequence[str | Sequence[int]], *, model: str = "", truncate: bool = False) -> pb.EmbedRequest:
    request = pb.EmbedRequest(model=model, truncate=truncate)
    for item in inputs:
        if isinstance(item, str):
            request.inputs.add(text=item)
        else:
            request.inputs.add().token_ids.ids.extend(item)
    return request


def _health_request(service: str):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    return health_pb2, health_pb2_grpc, health_pb2.HealthCheckRequest(service=service)


class _Base:
    """What both clients share: channel settings, credentials and per-call keywords."""

    def _setup(self, module, address: str, *, token: str | None, tls: bool, root_certificates: bytes | None,
               server_name: str | None, max_message_bytes: int, wait_for_ready: bool, retries: bool) -> None:
        options = channel_options(max_message_bytes=max_message_bytes, server_name=server_name, retries=retries)
        if tls or root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self.channel = module.secure_channel(address, creds, options=options)
        else:
            self.channel = module.insecure_channel(address, options=options)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.wait_for_ready = wait_for_ready

    def _kw(self, timeout: float | None = None) -> dict:
        return {"metadata": self.metadata, "timeout": timeout, "wait_for_ready": self.wait_for_ready}


class InferenceClient(_Base):
    """address: host:port. token: the bearer token when the server asks for one.
    root_certificates: PEM bytes of the CA that signed the server's certificate (turns TLS on;
    tls=True with None uses the system's roots). server_name: the name to check in the
    certificate when it differs from the host. wait_for_ready: calls wait for the channel to
    connect instead of failing at once. retries: gRPC retries idempotent calls on UNAVAILABLE."""

    def __init__(self, address: str = "127.0.0.1:50051", *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, server_name: str | None = None,
                 max_message_bytes: int = 16 << 20, wait_for_ready: bool = False, retries: bool = True) -> None:
        self._setup(grpc, address, token=token, tls=tls, root_certificates=root_certificates,
                    server_name=server_name, max_message_bytes=max_message_bytes, wait_for_ready=wait_for_ready,
                    retries=retries)

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Block until the channel is connected (grpc.FutureTimeoutError after `timeout`)."""
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    request = staticmethod(generate_request)

    def stream(self, prompt: str | Sequence[int], *, timeout: float | None = None, model: str = "",
               request_id: str = "", **sampling) -> Iterator[pb.GenerateResponse]:
        """The raw responses. Leaving the loop early cancels the call (the server aborts the request)."""
        call = self.stub.Generate(generate_request(prompt, model=model, request_id=request_id, **sampling),
                                  **self._kw(timeout))
        try:
            yield from call
        finally:
            call.cancel()  # no-op when the call already ended

    def stream_text(self, prompt: str | Sequence[int], **kwargs) -> Iterator[str]:
        for response in self.stream(prompt, **kwargs):
            if response.text:
                yield response.text

    def generate(self, prompt: str | Sequence[int], **kwargs) -> Completion:
        out = Completion()
        for r in self.stream(prompt, **kwargs):
            out.add(r)
        return out

    def tokenize(self, text: str, *, model: str = "", timeout: float | None = None) -> list[int]:
        return list(self.stub.Tokenize(pb.TokenizeRequest(model=model, text=text), **self._kw(timeout)).token_ids)

    def embed(self, inputs: Sequence[str | Sequence[int]], *, model: str = "", truncate: bool = False,
              timeout: float | None = None) -> pb.EmbedResponse:
        """One float32 vector per input (text or token ids), in order: response.embeddings[i].values."""
        return self.stub.Embed(embed_request(inputs, model=model, truncate=truncate), **self._kw(timeout))

    def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        reply = self.stub.ListModels(pb.ListModelsRequest(), **self._kw(timeout))
        return [typed(ModelInfo, m) for m in reply.models]

    def abort(self, request_id: str, *, timeout: float | None = None) -> None:
        self.stub.Abort(pb.AbortRequest(request_id=request_id), **self._kw(timeout))

    def server_info(self, *, timeout: float | None = None) -> ServerInfo:
        return typed(ServerInfo, self.stub.ServerInfo(pb.ServerInfoRequest(), **self._kw(timeout)))

    def health(self, service: str = SERVICE, *, timeout: float = 5.0) -> str:
        """"SERVING", "NOT_SERVING", ... of grpc.health.v1 (needs no token)."""
        health_pb2, health_pb2_grpc, request = _health_request(service)
        reply = health_pb2_grpc.HealthStub(self.channel).Check(request, timeout=timeout,
                                                                wait_for_ready=self.wait_for_ready)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


class AsyncInferenceClient(_Base):
    """The same calls as InferenceClient, as coroutines over a grpc.aio channel (create it inside
    the event loop that uses it). `stream` and `stream_text` are async iterators; leaving them
    early cancels the call, which aborts the request on the server."""

    def __init__(self, address: str = "127.0.0.1:50051", *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, server_name: str | None = None,
                 max_message_bytes: int = 16 << 20, wait_for_ready: bool = False, retries: bool = True) -> None:
        self._setup(grpc.aio, address, token=token, tls=tls, root_certificates=root_certificates,
                    server_name=server_name, max_message_bytes=max_message_bytes, wait_for_ready=wait_for_ready,
                    retries=retries)

    async def __aenter__(self) -> AsyncInferenceClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def wait_until_ready(self, timeout: float | None = None) -> None:
        """Until the channel is connected (asyncio.TimeoutError after `timeout`)."""
        import asyncio

        async with asyncio.timeout(timeout):
            await self.channel.channel_ready()

    async def stream(self, prompt: str | Sequence[int], *, timeout: float | None = None, model: str = "",
                     request_id: str = "", **sampling) -> AsyncIterator[pb.GenerateResponse]:
        call = self.stub.Generate(generate_request(prompt, model=model, request_id=request_id, **sampling),
                                  **self._kw(timeout))
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()

    async def stream_text(self, prompt: str | Sequence[int], **kwargs) -> AsyncIterator[str]:
        async for response in self.stream(prompt, **kwargs):
            if response.text:
                yield response.text

    async def generate(self, prompt: str | Sequence[int], **kwargs) -> Completion:
        out = Completion()
        async for r in self.stream(prompt, **kwargs):
            out.add(r)
        return out

    async def tokenize(self, text: str, *, model: str = "", timeout: float | None = None) -> list[int]:
        reply = await self.stub.Tokenize(pb.TokenizeRequest(model=model, text=text), **self._kw(timeout))
        return list(reply.token_ids)

    async def embed(self, inputs: Sequence[str | Sequence[int]], *, model: str = "", truncate: bool = False,
                    timeout: float | None = None) -> pb.EmbedResponse:
        return await self.stub.Embed(embed_request(inputs, model=model, truncate=truncate), **self._kw(timeout))

    async def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        reply = await self.stub.ListModels(pb.ListModelsRequest(), **self._kw(timeout))
        return [typed(ModelInfo, m) for m in reply.models]

    async def abort(self, request_id: str, *, timeout: float | None = None) -> None:
        await self.stub.Abort(pb.AbortRequest(request_id=request_id), **self._kw(timeout))

    async def server_info(self, *, timeout: float | None = None) -> ServerInfo:
        return typed(ServerInfo, await self.stub.ServerInfo(pb.ServerInfoRequest(), **self._kw(timeout)))

    async def health(self, service: str = SERVICE, *, timeout: float = 5.0) -> str:
        health_pb2, health_pb2_grpc, request = _health_request(service)
        reply = await health_pb2_grpc.HealthStub(self.channel).Check(request, timeout=timeout,
                                                                      wait_for_ready=self.wait_for_ready)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


# -- `meshserve client` ----------------------------------------------------------------------------
