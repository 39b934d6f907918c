"""Which gRPC status code each outcome gets. One table, used by every RPC.

    ConfigError                      INVALID_ARGUMENT   the message names field, value, allowed range
    QueueFullError, CapacityError    RESOURCE_EXHAUSTED
    UnavailableError,
    ReplicaFailedError               UNAVAILABLE        retry: another replica, or this one rebuilt
    NotFoundError                    NOT_FOUND          unknown model or request id
    any other error                  INTERNAL           logged with its traceback; the client sees its type

DEADLINE_EXCEEDED and CANCELLED are not raised by the service: they are how a call ends when
the client's deadline passes or the client cancels (see servicer.py).
"""

from __future__ import annotations

import logging

import grpc

from meshserve.errors import (
    CapacityError,
    ConfigError,
    NotFoundError,
    QueueFullError,
    ReplicaFailedError,
    UnavailableError,
)

log = logging.getLogger("meshserve.api")

CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (ReplicaFailedError, grpc.StatusCode.UNAVAILABLE),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message for an error an RPC raised."""
    for kind, code in CODES:
        if isinstance(exc, kind):
            return code, str(exc)
    log.exception("internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
