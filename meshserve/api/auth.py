"""Bearer-token authentication and TLS credentials for the gRPC server.

With a token file, every call must carry the metadata `authorization: Bearer <token>`;
otherwise it ends with UNAUTHENTICATED before the handler runs. grpc.health.v1 stays open so
that load balancers and the kubelet can probe without the secret. Tokens are compared in
constant time. The token file holds the token on its first line (surrounding whitespace is
ignored; an empty token is refused).
"""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc

from meshserve.errors import check

OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})


def read_token(path: str | Path) -> str:
    lines = Path(path).read_text().strip().splitlines()
    token = lines[0].strip() if lines else ""
    check(token != "", "auth_token_file", str(path), "a file whose first line is a non-empty token")
    check(token.isprintable() and " " not in token, "auth_token_file", str(path),
          "a token of printable characters without spaces")
    return token


def server_credentials(cert_file: str | Path, key_file: str | Path) -> grpc.ServerCredentials:
    """TLS with the PEM certificate chain and private key (no client certificates asked)."""
    return grpc.ssl_server_credentials([(Path(key_file).read_bytes(), Path(cert_file).read_bytes())])


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str, *, open_methods: frozenset[str] = OPEN_METHODS) -> None:
        self._expected = token.encode()
        self._open = open_methods

    def authorized(self, metadata) -> bool:
        """Exactly one `authorization` entry, scheme Bearer (any case), the right token."""
        given = [v for k, v in (metadata or ()) if k == "authorization"]
        if len(given) != 1:
            return False
        value = given[0].encode() if isinstance(given[0], str) else given[0]
        scheme, _, token = value.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token, self._expected)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method in self._open or self.authorized(details.invocation_metadata):
            return handler
        return _refusing(handler)


async def _deny(_request, context: grpc.aio.ServicerContext):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "missing or wrong bearer token: send the metadata 'authorization: Bearer <token>'")


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind (and codecs) as `handler` that ends the call UNAUTHENTICATED."""
    codecs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_deny, **codecs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_deny, **codecs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_deny, **codecs)
    return grpc.unary_unary_rpc_method_handler(_deny, **codecs)
