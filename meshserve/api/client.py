"""InferenceClient: a small synchronous client (the `meshserve client` command is api/client_cli.py).

    from meshserve.api.client import InferenceClient

    with InferenceClient("127.0.0.1:50051") as client:
        for text in client.stream_text("The for statement", max_tokens=32, temperature=0):
            print(text, end="", flush=True)
        reply = client.generate("Python supports", max_tokens=16)   # the whole response at once
        print(reply.text, reply.finish_reason, reply.usage.completion_tokens)

Sampling settings are the fields of meshserve.v1.SamplingParams as keywords. Errors are
grpc.RpcError with the server's status code and message. This module imports grpc and the
generated stubs only (no torch).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from meshserve.v1 import inference_pb2 as pb
from meshserve.v1 import inference_pb2_grpc as pb_grpc

FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


@dataclass
class Completion:
    """A whole Generate call: joined text and tokens, and the last response's fields."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finish_reason: str = ""
    stop_reason: str | int | None = None
    usage: pb.Usage = field(default_factory=pb.Usage)


class InferenceClient:
    """address: host:port. token: the bearer token when the server asks for one.
    root_certificates: PEM bytes of the CA that signed the server's certificate (turns TLS on;
    tls=True with None uses the system's roots). server_name: the name to check in the
    certificate when it differs from the host."""

    def __init__(self, address: str = "127.0.0.1:50051", *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, server_name: str | None = None,
                 max_message_bytes: int = 16 << 20) -> None:
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        if tls or root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self.channel = grpc.secure_channel(address, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    @staticmethod
    def request(prompt: str | Sequence[int], *, model: str = "", request_id: str = "",
                **sampling) -> pb.GenerateRequest:
        req = pb.GenerateRequest(model=model, request_id=request_id, sampling=pb.SamplingParams(**sampling))
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        return req

    def stream(self, prompt: str | Sequence[int], *, timeout: float | None = None, model: str = "",
               request_id: str = "", **sampling) -> Iterator[pb.GenerateResponse]:
        """The raw responses. Leaving the loop early cancels the call (the server aborts the request)."""
        call = self.stub.Generate(self.request(prompt, model=model, request_id=request_id, **sampling),
                                  timeout=timeout, metadata=self.metadata)
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
            out.request_id = r.request_id
            out.text += r.text
            out.token_ids += r.token_ids
            out.logprobs += r.logprobs
            if r.finish_reason:
                out.finish_reason = FINISH_NAMES[r.finish_reason]
                which = r.WhichOneof("stop_reason")
                out.stop_reason = getattr(r, which) if which else None
                out.usage = r.usage
        return out

    def tokenize(self, text: str, *, model: str = "") -> list[int]:
        return list(self.stub.Tokenize(pb.TokenizeRequest(model=model, text=text), metadata=self.metadata).token_ids)

    def embed(self, inputs: Sequence[str | Sequence[int]], *, model: str = "", truncate: bool = False,
              timeout: float | None = None) -> pb.EmbedResponse:
        """One float32 vector per input (text or token ids), in order: response.embeddings[i].values."""
        request = pb.EmbedRequest(model=model, truncate=truncate)
        for item in inputs:
            if isinstance(item, str):
                request.inputs.add(text=item)
            else:
                request.inputs.add().token_ids.ids.extend(item)
        return self.stub.Embed(request, timeout=timeout, metadata=self.metadata)

    def list_models(self) -> list[pb.Model]:
        return list(self.stub.ListModels(pb.ListModelsRequest(), metadata=self.metadata).models)

    def abort(self, request_id: str) -> None:
        self.stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self.metadata)

    def server_info(self) -> pb.ServerInfoResponse:
        return self.stub.ServerInfo(pb.ServerInfoRequest(), metadata=self.metadata)

    def health(self, service: str = "meshserve.v1.Inference", *, timeout: float = 5.0) -> str:
        """"SERVING", "NOT_SERVING", ... of grpc.health.v1 (needs no token)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        reply = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


# -- `meshserve client` ----------------------------------------------------------------------------
