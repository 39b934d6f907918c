"""`meshserve bench` against an address where nothing listens: one line on stderr, status 1, at once."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _closed_port() -> int:
    with socket.socket() as s:  # bound and closed again: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("backend", ["openai", "grpc"])
def test_bench_without_a_server_fails_with_one_line(backend, tmp_path):
    port = _closed_port()
    target = (["--base-url", f"http://127.0.0.1:{port}"] if backend == "openai"
              else ["--address", f"127.0.0.1:{port}"])
    done = subprocess.run([sys.executable, "-m", "meshserve.cli", "bench", "--backend", backend, *target,
                           "--result-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshserve bench: error: no ") and f":{port}" in lines[0]
    assert "server answers" in lines[0] and done.stdout == ""
    assert list(tmp_path.iterdir()) == []  # nothing measured, nothing written
