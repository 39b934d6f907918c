"""`meshserve serve` in a subprocess for integration tests: started, and its two announce lines read."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def start_serve(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, str, str]:
    """(process, gRPC address, HTTP base URL without /v1) once the server has announced both."""
    proc = subprocess.Popen([sys.executable, "-m", "meshserve.cli", "serve", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        first, second = lines.get(timeout=120), lines.get(timeout=30)
    except queue.Empty:
        proc.kill()
        pytest.fail(f"the server did not start: {proc.stderr.read()[-3000:]}")
    grpc_address = re.match(r"meshserve: serving (\S+) on (\S+),", first)[2]
    url = re.match(r"meshserve: OpenAI-compatible API on (\S+)/v1$", second.strip())[1]
    return proc, grpc_address, url
