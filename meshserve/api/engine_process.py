"""The engine's own process under `meshserve serve`, as the front-ends' side starts it (its main:
api/engine_main.py).

`meshserve serve` (api/serve.py) binds the front-ends' ports, then starts this process, which
loads the model, runs the Coordinator and serves it on a unix socket in a fresh 0700 directory
(cluster/service_endpoint.py); the front-ends reach it through api/engine_client.py. Its
settings (the parsed `serve` flags), the deployment secret and the channel's session id come on
its stdin as one msgpack map, never on a command line or in the environment.

The engine process ignores SIGINT (a Ctrl-C reaches the whole process group: the front-ends
drain first, then tell it to stop), stops on SIGTERM or SHUTDOWN, and stops by itself when its
parent is gone (checked twice a second). Its stdout goes to the parent's stderr: the
first stdout lines of `meshserve serve` stay the front-ends' announcements.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import msgpack

from meshserve.cluster import service_wire as wire
from meshserve.core.secret import ClusterSecret


class EngineProcess:
    """The engine's process, as the front-ends' side sees it: start(), exit_code(), wait(), kill()."""

    def __init__(self, args: argparse.Namespace, *, model_name: str | None, secret: ClusterSecret) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="meshserve-engine-"))  # 0700: only this user reaches the socket
        self.address = f"ipc://{self._dir / 'engine.sock'}"
        self.key = wire.ChannelKey(secret, secrets.token_bytes(16))
        settings = {k: v for k, v in vars(args).items() if k != "func"}
        self._config = msgpack.packb({"args": settings, "model_name": model_name, "address": self.address,
                                      "key": secret.key, "session": self.key.session, "parent": os.getpid()})
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "meshserve.api.engine_main"], stdin=subprocess.PIPE,
                                      stdout=sys.stderr.fileno())
        self._proc.stdin.write(self._config)
        self._proc.stdin.close()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def exit_code(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def wait(self, timeout: float) -> None:
        """Wait for the process to end (killed after `timeout` s), then remove its socket's folder."""
        if self._proc is not None:
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
