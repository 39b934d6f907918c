"""`meshserve serve` and `meshserve client` as a user runs them: separate processes on loopback.

The server starts on free ports (port 0) and announces them on its first line; the README's
client command streams readable text back; /metrics answers over HTTP; SIGTERM drains (a stream
in flight runs to its end) and the process exits 0.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from meshserve.api.client import InferenceClient

# A hung server or stream fails the test in minutes, not at the suite's 10-minute limit.
pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def meshserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "meshserve.cli", *args]


@pytest.fixture(scope="module")
def server():
    proc = subprocess.Popen(meshserve("serve", "--grpc-port", "0", "--metrics-port", "0", "--no-http",
                                      "--dtype", "float32",
                                      "--max-model-len", "256", "--num-kv-blocks", "64", "--drain-seconds", "60"),
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True)
    reader.start()
    try:
        first = lines.get(timeout=120)
    except queue.Empty:
        proc.kill()
        pytest.fail(f"the server did not start: {proc.stderr.read()[-2000:]}")
    match = re.match(r"meshserve: serving (\S+) on (\S+), metrics on (\S+)$", first.strip())
    assert match, first
    yield {"proc": proc, "model": match[1], "address": match[2], "metrics": match[3], "lines": lines,
           "reader": reader}
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


def test_client_command_streams_readable_text(server):
    prompt = "The for statement is used to"
    done = subprocess.run(meshserve("client", "--address", server["address"], prompt, "--max-tokens", "24"),
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(prompt)
    continuation = done.stdout[len(prompt):].strip()
    assert len(continuation) >= 24 and all(c.isprintable() or c.isspace() for c in continuation)
    assert sum(c.isalpha() for c in continuation) > len(continuation) / 2  # words, not noise
    assert "[finished: length; 7 prompt + 24 completion tokens]" in done.stderr
    assert server["model"] == "meshserve-demo"


def test_client_command_reports_refusals(server):
    done = subprocess.run(meshserve("client", "--address", server["address"], "Hi", "--temperature", "-1"),
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "INVALID_ARGUMENT: temperature=-1.0 is not allowed" in done.stderr


def test_metrics_answer_over_http(server):
    body = urllib.request.urlopen(server["metrics"], timeout=10).read().decode()
    name = re.escape(server["model"])
    assert re.search(rf'^meshserve_generation_tokens_total{{model_name="{name}"}} \d', body, re.M)
    assert re.search(rf'^meshserve_kv_cache_free_blocks{{model_name="{name}"}} 63\.0$', body, re.M)


def test_sigterm_drains_streams_then_exits(server):
    proc = server["proc"]
    with InferenceClient(server["address"]) as client:
        stream = client.stream("Python supports", max_tokens=60, ignore_eos=True, temperature=0)
        first = next(r for r in stream if r.token_ids)
        proc.send_signal(signal.SIGTERM)
        rest = list(stream)
    assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) == 60
    assert rest[-1].finish_reason == 2  # FINISH_REASON_LENGTH: the stream ran to its end
    assert proc.wait(120) == 0
    server["reader"].join(30)  # every line the server printed is in the queue
    said = []
    while not server["lines"].empty():
        said.append(server["lines"].get().strip())
    assert said[:1] == ["meshserve: draining (up to 60 s)"] and said[-1] == "meshserve: stopped"
