"""`meshserve serve --engine-process`: the front-ends in serve's process, the engine in a child.

A live server as a user starts it: gRPC and HTTP give the tokens of the in-process engine (the
oracle: `LLM.generate`, greedy); a client that leaves mid-stream has its request aborted in the
engine (the engine's stats, read through ServerInfo, show nothing running and every KV block
free again); /metrics shows the engine's counters; and when the engine's process dies, the
open stream ends UNAVAILABLE, /health answers 503 and gRPC readiness NOT_SERVING (no hang),
while the front-end stays up to say so. SIGTERM stops both processes.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshserve.api.client import InferenceClient
from meshserve.demo_model import DEMO_MODEL_DIR
from tests.integration.api_harness import wait_for
from tests.serve_process import ROOT, start_serve

pytestmark = pytest.mark.timeout(300)
PROMPT = [5, 17, 42, 7, 99, 3]


def _children(pid: int) -> list[int]:
    return [int(k) for task in Path(f"/proc/{pid}/task").glob("*") for k in (task / "children").read_text().split()]


@pytest.fixture(scope="module")
def server():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc, grpc_address, url = start_serve([str(DEMO_MODEL_DIR), "--engine-process", "--port", "0", "--grpc-port",
                                           "0", "--dtype", "float32", "--drain-seconds", "5"], env)
    try:
        yield proc, grpc_address, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def _readiness(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service="meshserve.v1.Inference"), timeout=10).status


def _http(url: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_the_split_serves_cancels_reports_and_says_when_the_engine_is_gone(server):
    from meshserve.api.llm import LLM
    from meshserve.core.sampling_params import SamplingParams

    proc, address, url = server
    engines = _children(proc.pid)
    assert len(engines) == 1, engines  # the engine's own process
    llm = LLM(str(DEMO_MODEL_DIR), dtype="float32", progress=False)
    want = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    llm.shutdown()
    client = InferenceClient(address)
    info = client.server_info()
    free = info.stats.num_free_kv_blocks
    got = [t for r in client.stream(PROMPT, model=info.models[0].name, max_tokens=12, temperature=0,
                                    ignore_eos=True) for t in r.token_ids]
    assert got == want.token_ids
    status, body = _http(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                                  "ignore_eos": True})
    assert status == 200 and json.loads(body)["choices"][0]["text"] == want.text

    # a client that leaves: the engine aborts its request and frees its blocks
    longest = dict(model=info.models[0].name, max_tokens=info.models[0].max_model_len - len(PROMPT), temperature=0,
                   ignore_eos=True)
    stream = client.stream(PROMPT, **longest)
    next(stream)
    stream.close()  # cancels the call
    wait_for(lambda: (s := client.server_info().stats).num_running == 0 and s.num_free_kv_blocks == free,
             timeout=60, what="the engine to abort the left request and free its blocks")
    metrics = _http(url, "/metrics")[1].decode()
    generated = [line for line in metrics.splitlines() if line.startswith("meshserve_generation_tokens_total")]
    assert generated and float(generated[0].split()[-1]) >= 24  # the engine's counter, across the channel

    # the engine's process dies under an open stream
    open_stream = client.stream(PROMPT, **longest)
    next(open_stream)
    os.kill(engines[0], signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as failed:
        for _ in open_stream:
            pass
    assert failed.value.code() is grpc.StatusCode.UNAVAILABLE and "engine process" in failed.value.details()
    status, body = _http(url, "/health")
    assert status == 503 and b"engine process exited" in body
    wait_for(lambda: _readiness(address) == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=30,
             what="readiness NOT_SERVING (the health reporter polls the service)")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


def test_sigterm_stops_both_processes():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc, _, _ = start_serve([str(DEMO_MODEL_DIR), "--engine-process", "--port", "0", "--grpc-port", "0",
                              "--dtype", "float32"], env)
    engine = _children(proc.pid)[0]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    wait_for(lambda: not Path(f"/proc/{engine}").exists(), timeout=30,
             what="the engine process to exit with the front-ends")
