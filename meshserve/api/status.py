"""Which gRPC status code and which HTTP status each outcome gets. One table, used by every RPC
and every HTTP route.

    ConfigError                      INVALID_ARGUMENT    400  the message names field, value, allowed range
    CapacityError                    RESOURCE_EXHAUSTED  400  the request can never fit (retrying cannot help)
    QueueFullError                   RESOURCE_EXHAUSTED  429  retry later
    UnavailableError,
    ReplicaFailedError               UNAVAILABLE         503  retry: another replica, or this one rebuilt
    NotFoundError                    NOT_FOUND           404  unknown model or request id
    any other error                  INTERNAL            500  logged with its traceback; the client sees its type

DEADLINE_EXCEEDED and CANCELLED are not raised by the service: they are how a call ends when
the client's deadline passes or the client cancels (see servicer.py). Over HTTP, 401 (no or a
wrong bearer token) and 413 (a body over --max-message-bytes) are answered before a route runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from meshserve.errors import (
    MAX_QUOTED_CHARS,
    CapacityError,
    ConfigError,
    NotFoundError,
    QueueFullError,
    ReplicaFailedError,
    UnavailableError,
)

log = logging.getLogger("meshserve.api")


@dataclass(frozen=True)
class Outcome:
    """How one kind of error is reported: gRPC code, HTTP status and OpenAI's error type."""

    grpc_code: grpc.StatusCode
    http_status: int
    error_type: str


CODES: tuple[tuple[type[BaseException], Outcome], ...] = (
    (ConfigError, Outcome(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error")),
    (QueueFullError, Outcome(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error")),
    (CapacityError, Outcome(grpc.StatusCode.RESOURCE_EXHAUSTED, 400, "invalid_request_error")),
    (UnavailableError, Outcome(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error")),
    (ReplicaFailedError, Outcome(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error")),
    (NotFoundError, Outcome(grpc.StatusCode.NOT_FOUND, 404, "not_found_error")),
)
INTERNAL = Outcome(grpc.StatusCode.INTERNAL, 500, "internal_error")


def outcome_of(exc: BaseException) -> tuple[Outcome, str]:
    """The outcome and the client's message for an error a call raised (unexpected ones are logged)."""
    for kind, outcome in CODES:
        if isinstance(exc, kind):
            return outcome, str(exc)
    log.exception("internal error", exc_info=exc)
    detail = str(exc)  # may hold caller input: quoted at most MAX_QUOTED_CHARS characters
    if len(detail) > MAX_QUOTED_CHARS:
        detail = f"{detail[:MAX_QUOTED_CHARS]}... ({len(detail)} characters)"
    return INTERNAL, f"internal error: {type(exc).__name__}: {detail}"


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message for an error an RPC raised."""
    outcome, message = outcome_of(exc)
    return outcome.grpc_code, message
