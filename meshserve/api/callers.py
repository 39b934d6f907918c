"""Who sent a request, for fair queueing and per-caller limits (cluster/fair_queue.py).

With tokens, a caller is its bearer token (the digest auth.scope_of names its request ids by);
without, the connection's peer address without its port: one host's many connections are one
caller, so opening more connections buys no larger share.
"""

from __future__ import annotations

import re

from meshserve.api.auth import PUBLIC_SCOPE, scope_of

# gRPC's peer strings: "ipv4:127.0.0.1:5555", "ipv6:[::1]:5555", "unix:/path" (no port).
_PORT = re.compile(r":\d+$")


def _host_of_grpc_peer(peer: str) -> str:
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        address = _PORT.sub("", address)
    return address.strip("[]") or peer


def grpc_caller(context, *, auth_required: bool, scope: str | None = None) -> str:
    """scope: the call's auth.scope_of, when the caller has it already (Generate: for its request id)."""
    if scope is None:
        scope = scope_of(context.invocation_metadata(), auth_required=auth_required)
    if scope != PUBLIC_SCOPE:
        return f"token:{scope}"
    return f"peer:{_host_of_grpc_peer(context.peer() or '')}"


def http_caller(headers, client, *, auth_required: bool) -> str:
    """headers: (name, value) byte pairs of the ASGI scope; client: its (host, port) or None."""
    metadata = [(k.decode("latin-1"), v) for k, v in headers if k == b"authorization"]
    scope = scope_of(metadata, auth_required=auth_required)
    if scope != PUBLIC_SCOPE:
        return f"token:{scope}"
    return f"peer:{client[0] if client else 'unknown'}"
