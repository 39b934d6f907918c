"""The cluster secret: where it comes from, what it refuses, that it never shows, and the MAC
against an independent HMAC-SHA256 over the length-prefixed parts."""

import hashlib
import hmac
import pickle
import struct

import pytest

from meshserve.core.secret import ENV_SECRET, ENV_SECRET_FILE, ClusterSecret, RejectedFrames
from meshserve.errors import ConfigError


def test_resolve_takes_the_operators_secret_else_a_fresh_one(tmp_path):
    assert ClusterSecret.resolve({ENV_SECRET: " s3cret-of-the-operator \n"}).key == b"s3cret-of-the-operator"
    path = tmp_path / "secret"
    path.write_bytes(b"a-secret-kept-in-a-file\n")
    assert ClusterSecret.resolve({ENV_SECRET_FILE: str(path)}).key == b"a-secret-kept-in-a-file"
    a, b = ClusterSecret.resolve({}), ClusterSecret.resolve({})
    assert len(a.key) == 32 and a.key != b.key  # one per cluster


def test_bad_secrets_are_refused_without_showing_them(tmp_path):
    with pytest.raises(ConfigError, match="cluster secret.*at least 16 bytes") as info:
        ClusterSecret.resolve({ENV_SECRET: "short-secret"})
    assert "short-secret" not in str(info.value)
    with pytest.raises(ConfigError, match=ENV_SECRET_FILE):
        ClusterSecret.resolve({ENV_SECRET_FILE: str(tmp_path / "missing")})
    secret = ClusterSecret(b"never-to-be-printed-key")
    assert "never" not in repr(secret) and "never" not in str(secret) and "never" not in f"{secret}"
    with pytest.raises(TypeError, match="not picklable"):
        pickle.dumps(secret)


def test_sign_is_hmac_sha256_over_length_prefixed_parts():
    key = b"k" * 32
    secret = ClusterSecret(key)
    parts = (b"step>", b"", b"rank-0", memoryview(b"payload"))
    oracle = hmac.new(key, b"".join(struct.pack("<Q", len(p)) + bytes(p) for p in parts), hashlib.sha256).digest()
    assert secret.sign(*parts) == oracle
    assert secret.verify(oracle, *parts)
    assert not secret.verify(oracle, b"step>", b"", b"rank-", b"0payload")  # the same bytes, split elsewhere
    assert not secret.verify(oracle[:-1] + bytes([oracle[-1] ^ 1]), *parts)
    assert not secret.verify(b"", *parts)
    assert not ClusterSecret(b"j" * 32).verify(oracle, *parts)


def test_rejected_frames_count():
    rejected = RejectedFrames("test socket")
    for _ in range(3):
        rejected.add("bad tag")
    assert rejected.count == 3
