"""Errors to status codes; the bearer token file and check."""

from __future__ import annotations

import hashlib

import grpc
import pytest

from meshserve.api.auth import PUBLIC_SCOPE, BearerTokenInterceptor, read_token, read_tokens, scope_of
from meshserve.api.status import status_of
from meshserve.errors import (
    CapacityError,
    ConfigError,
    MeshserveError,
    NotFoundError,
    QueueFullError,
    ReplicaFailedError,
    UnavailableError,
)


@pytest.mark.parametrize("exc, code", [
    (ConfigError("top_p", 2.0, "a number in (0, 1]"), grpc.StatusCode.INVALID_ARGUMENT),
    (QueueFullError("queue full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (CapacityError("too big"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnavailableError("none"), grpc.StatusCode.UNAVAILABLE),
    (ReplicaFailedError("died"), grpc.StatusCode.UNAVAILABLE),
    (NotFoundError("model='x'"), grpc.StatusCode.NOT_FOUND),
])
def test_each_error_has_its_code_and_keeps_its_message(exc, code):
    assert status_of(exc) == (code, str(exc))


def test_anything_else_is_internal_and_named():
    code, message = status_of(ZeroDivisionError("boom"))
    assert code == grpc.StatusCode.INTERNAL and message == "internal error: ZeroDivisionError: boom"
    assert status_of(MeshserveError("odd"))[0] == grpc.StatusCode.INTERNAL


def test_token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text("  abc123  \n")
    assert read_token(path) == "abc123" and read_tokens(path) == ("abc123",)
    path.write_text("# callers\n abc123\n\n  second-caller \n")  # one token a line; blank and # lines skipped
    assert read_tokens(path) == ("abc123", "second-caller") and read_token(path) == "abc123"
    for bad in ("", "   \n", "# only a comment\n", "two words\n", "ok\nsecond line with spaces\n"):
        path.write_text(bad)
        with pytest.raises(ConfigError, match="^auth_token_file="):
            read_tokens(path)
    with pytest.raises(ConfigError, match="^metrics_token_file="):
        read_token(path, field="metrics_token_file")


def test_bearer_check():
    check = BearerTokenInterceptor(("abc",)).authorized
    assert check((("authorization", "Bearer abc"),))
    assert check((("x-other", "1"), ("authorization", b"Bearer abc")))
    assert check((("authorization", "bearer abc"),))  # the scheme is case-insensitive (RFC 7235)
    for metadata in ((), None, (("authorization", "Bearer abd"),), (("authorization", "abc"),),
                     (("authorization", "Bearer abc"), ("authorization", "Bearer abc")),
                     (("authorization", "Basic abc"),), (("authorization", "Bearer  abc"),)):
        assert not check(metadata), metadata


def test_every_token_is_accepted_and_is_its_own_scope():
    check = BearerTokenInterceptor(("abc", "xyz")).authorized
    assert check((("authorization", "Bearer abc"),)) and check((("authorization", "Bearer xyz"),))
    assert not check((("authorization", "Bearer abcxyz"),)) and not check((("authorization", "Bearer ab"),))
    with pytest.raises(ConfigError, match="^tokens="):
        BearerTokenInterceptor(())

    def scope(token, auth=True):
        return scope_of((("authorization", f"Bearer {token}"),), auth_required=auth)

    assert scope("abc") == scope("abc") != scope("xyz")
    assert scope("abc") == hashlib.sha256(b"abc").hexdigest()[:16]  # a digest: the token is not in the ids
    assert scope("abc", auth=False) == scope("xyz", auth=False) == scope_of((), auth_required=False) == PUBLIC_SCOPE
