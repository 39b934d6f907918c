"""SIGTERM with streams open past --drain-seconds: each ends with an error, the server exits.

A `meshserve serve` process (demo model, in-process replica) with --drain-seconds 1 gets
SIGTERM while an SSE stream and a gRPC stream are mid-way through long completions: the SSE
stream ends with an OpenAI-shaped error event and then [DONE], the gRPC stream with UNAVAILABLE
and the reason; the server exits 0 and leaves no process behind.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import psutil
import pytest

from meshserve.api.client import InferenceClient

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def test_sigterm_ends_every_open_stream_with_an_error_after_the_drain_time():
    proc = subprocess.Popen([sys.executable, "-m", "meshserve.cli", "serve", "--grpc-port", "0", "--metrics-port", "0",
                             "--port", "0", "--dtype", "float32", "--max-model-len", "1024",
                             "--num-kv-blocks", "128", "--drain-seconds", "1"],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        grpc_address = re.match(r"meshserve: serving \S+ on (\S+),", lines.get(timeout=240))[1]
        http_port = int(re.search(r":(\d+)/v1$", lines.get(timeout=30).strip())[1])
        long = dict(max_tokens=1000, ignore_eos=True, temperature=0)
        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "Once upon a time", "stream": True, **long}),
                     {"Content-Type": "application/json"})
        sse = conn.getresponse()
        assert sse.status == 200
        with InferenceClient(grpc_address) as client:
            stream = client.stream("Python supports", **long)
            assert next(r for r in stream if r.token_ids)
            children = psutil.Process(proc.pid).children(recursive=True)
            proc.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.RpcError) as info:
                for _ in stream:
                    pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "drain time (--drain-seconds) is over" in info.value.details()
        events = [line[6:].strip() for line in sse.read().decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "service_unavailable_error" and error["code"] == 503
        assert "drain time (--drain-seconds) is over" in error["message"]
        assert all("choices" in json.loads(e) for e in events[:-2])  # tokens came before the error
        assert proc.wait(60) == 0
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, alive
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
