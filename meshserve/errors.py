"""Errors shared by every layer. Each names what was wrong and what is allowed."""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar

E = TypeVar("E", bound=StrEnum)


class MeshserveError(Exception):
    """Base class of every error meshserve raises on purpose."""


class ConfigError(MeshserveError, ValueError):
    """A setting has a value outside what is allowed.

    The message always names the field, the value given and the allowed values or range.
    """

    def __init__(self, field: str, value: object, allowed: str):
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{field}={quote(value)} is not allowed: {allowed}")


# Error messages quote at most this many characters of a value: a client's 100 KB model name
# must not come back as a 100 KB message (which a default gRPC client cannot even receive).
MAX_QUOTED_CHARS = 200


def quote(value: object, limit: int = MAX_QUOTED_CHARS) -> str:
    """repr(value), cut to about `limit` characters (saying how long the whole was)."""
    if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > limit:
        shown = repr(value[:limit] if not isinstance(value, dict) else dict(list(value.items())[:8]))
        return f"{shown[:limit]}... ({len(value)} {'characters' if isinstance(value, str) else 'items'})"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters of repr)"


class NoBackendError(MeshserveError):
    """No attention backend can serve a configuration; the message lists every reason."""


def check(condition: bool, field: str, value: object, allowed: str) -> None:
    """Raise ConfigError(field, value, allowed) unless `condition` holds."""
    if not condition:
        raise ConfigError(field, value, allowed)


def as_enum(enum: type[E], field: str, value: object) -> E:
    """`value` as a member of `enum`, or ConfigError listing the allowed values."""
    if isinstance(value, enum):
        return value
    try:
        return enum(str(value).lower())
    except ValueError:
        raise ConfigError(field, value, f"one of {[m.value for m in enum]}") from None


class QueueFullError(MeshserveError):
    """Admission control refused a request: the pool's waiting queue is full (RESOURCE_EXHAUSTED)."""


class CapacityError(MeshserveError):
    """A request can never fit: its prompt plus max_tokens exceeds the KV capacity (RESOURCE_EXHAUSTED)."""


class UnavailableError(MeshserveError):
    """No healthy replica can take the request right now (UNAVAILABLE)."""


class ReplicaFailedError(MeshserveError):
    """The replica serving a request died; the message names the cause (UNAVAILABLE)."""


class NotFoundError(MeshserveError):
    """An unknown model name or request id (NOT_FOUND)."""
