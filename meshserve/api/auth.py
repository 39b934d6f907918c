"""Bearer-token authentication and TLS credentials for the gRPC server.

With a token file, every call must carry the metadata `authorization: Bearer <token>` with
one of its tokens; otherwise it ends with UNAUTHENTICATED before the handler runs.
grpc.health.v1 stays open so that load balancers and the kubelet can probe without the secret.
Tokens are compared in constant time. The token file holds one token per line (surrounding
whitespace is ignored; blank lines and lines starting with # are skipped; a file without a
token is refused). Each token is one caller: `scope_of` names the namespace of its request
ids, so that one caller can neither abort nor probe another's requests.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from pathlib import Path

import grpc

from meshserve.errors import check

OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})


# The request-id namespace of every caller of a server without tokens.
PUBLIC_SCOPE = "public"


def read_tokens(path: str | Path, *, field: str = "auth_token_file") -> tuple[str, ...]:
    """Every token of a token file (one per line), in order; errors name `field`."""
    lines = [line.strip() for line in Path(path).read_text().splitlines()]
    tokens = tuple(line for line in lines if line and not line.startswith("#"))
    check(tokens != (), field, str(path), "a file with a non-empty token on a line")
    for token in tokens:
        check(token.isprintable() and " " not in token, field, str(path),
              "tokens of printable characters without spaces, one per line")
    return tokens


def read_token(path: str | Path, *, field: str = "auth_token_file") -> str:
    """The token a client sends (or the metrics endpoint wants): the file's first."""
    return read_tokens(path, field=field)[0]


def bearer_of(metadata) -> bytes | None:
    """The token of exactly one `authorization: Bearer <token>` entry (scheme in any case), else None."""
    given = [v for k, v in (metadata or ()) if k == "authorization"]
    if len(given) != 1:
        return None
    value = given[0].encode() if isinstance(given[0], str) else given[0]
    scheme, _, token = value.partition(b" ")
    return token if scheme.lower() == b"bearer" else None


def scope_of(metadata, *, auth_required: bool) -> str:
    """The namespace of a caller's request ids: a digest of its (already checked) bearer token,
    or PUBLIC_SCOPE when the server has no tokens (then every caller shares one namespace)."""
    token = bearer_of(metadata) if auth_required else None
    return PUBLIC_SCOPE if token is None else hashlib.sha256(token).hexdigest()[:16]


def server_credentials(cert_file: str | Path, key_file: str | Path) -> grpc.ServerCredentials:
    """TLS with the PEM certificate chain and private key (no client certificates asked)."""
    return grpc.ssl_server_credentials([(Path(key_file).read_bytes(), Path(cert_file).read_bytes())])


def is_known(token: bytes | None, expected: Sequence[bytes]) -> bool:
    """`token` is one of `expected`, compared with each in constant time (no early exit)."""
    if token is None:
        return False
    return sum(hmac.compare_digest(token, e) for e in expected) > 0


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: Sequence[str], *, open_methods: frozenset[str] = OPEN_METHODS) -> None:
        check(len(tokens) > 0, "tokens", list(tokens), "at least one token")
        self._expected = tuple(t.encode() for t in tokens)
        self._open = open_methods

    def authorized(self, metadata) -> bool:
        """Exactly one `authorization` entry, scheme Bearer (any case), one of the tokens."""
        return is_known(bearer_of(metadata), self._expected)

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
