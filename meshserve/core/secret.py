"""The deployment secret that authenticates every internal socket, and the frame MAC built on it.

    secret = ClusterSecret.resolve()        # MESHSERVE_CLUSTER_SECRET, ..._FILE, or a fresh one
    tag = secret.sign(b"step", kind, seq, payload)     # HMAC-SHA256 over the length-prefixed parts
    secret.verify(tag, b"step", kind, seq, payload)    # constant-time compare

The coordinator resolves one secret per cluster at start and hands it to every rank with its
start-up config (a rank process's stdin, a Ray actor's constructor arguments, a thread's
arguments), never on a command line, in an environment variable it sets, or in a log: `repr`
and `str` hide the key. The step channel (cluster/executors/channel.py) and the KV export protocol
(kvtransfer/export_server.py) append a tag to every message; a message whose tag does not verify is
dropped and counted in `RejectedFrames`, never raised.

Each part is prefixed with its length, so no two different part lists sign the same bytes, and
the first part names the protocol and direction, so a tag cannot be replayed on another socket.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import struct
import threading
from collections.abc import Mapping

from meshserve.errors import ConfigError, check

log = logging.getLogger("meshserve.secret")

ENV_SECRET = "MESHSERVE_CLUSTER_SECRET"
ENV_SECRET_FILE = "MESHSERVE_CLUSTER_SECRET_FILE"
MIN_SECRET_BYTES = 16
TAG_BYTES = 32  # SHA-256
_LOG_EVERY = 1000  # a flood of forged frames logs one line per this many


class ClusterSecret:
    """A key of at least MIN_SECRET_BYTES bytes; signs and verifies lists of message parts."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        check(isinstance(key, bytes) and len(key) >= MIN_SECRET_BYTES, "cluster secret",
              f"<hidden, {len(key) if isinstance(key, bytes) else type(key).__name__} bytes>",
              f"at least {MIN_SECRET_BYTES} bytes")
        self._key = key

    @classmethod
    def generate(cls) -> ClusterSecret:
        return cls(secrets.token_bytes(32))

    @classmethod
    def resolve(cls, env: Mapping[str, str] | None = None) -> ClusterSecret:
        """The secret given by the operator (ENV_SECRET, else the file named by ENV_SECRET_FILE,
        surrounding whitespace stripped), or a fresh random one for this cluster."""
        env = os.environ if env is None else env
        if env.get(ENV_SECRET):
            return cls(env[ENV_SECRET].strip().encode())
        path = env.get(ENV_SECRET_FILE)
        if path:
            try:
                with open(path, "rb") as f:
                    key = f.read().strip()
            except OSError as exc:
                raise ConfigError(ENV_SECRET_FILE, path, f"a readable file with the secret ({exc.strerror})") from None
            return cls(key)
        return cls.generate()

    @property
    def key(self) -> bytes:
        """The raw key, to hand to a rank with its start-up config (never to a log)."""
        return self._key

    def sign(self, *parts: bytes | memoryview) -> bytes:
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in parts:
            view = memoryview(part).cast("B")
            mac.update(struct.pack("<Q", len(view)))
            mac.update(view)
        return mac.digest()

    def verify(self, tag: bytes | memoryview, *parts: bytes | memoryview) -> bool:
        return hmac.compare_digest(bytes(tag), self.sign(*parts))

    def __repr__(self) -> str:
        return "ClusterSecret(<hidden>)"

    __str__ = __repr__

    def __reduce__(self):  # never pickled: hand `key` over explicitly
        raise TypeError("ClusterSecret is not picklable; pass .key with the start-up config")


class RejectedFrames:
    """A thread-safe count of messages dropped because their tag did not verify (or they were
    malformed), for one socket; logs the first and then one in every _LOG_EVERY."""

    def __init__(self, where: str) -> None:
        self.where = where
        self._count = 0
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return self._count

    def add(self, why: str) -> None:
        with self._lock:
            self._count += 1
            n = self._count
        if n == 1 or n % _LOG_EVERY == 0:
            log.warning("%s: dropped a message that failed authentication (%s); %d so far", self.where, why, n)
