"""`meshserve serve --api-server-count 2`: two front-end processes on the same ports, one engine.

A live server as a user starts it. Connections reach both processes (each process's own counter in
/metrics says so), every answer has the tokens of the in-process engine (the oracle:
`LLM.generate`, greedy) over gRPC and HTTP, /metrics sums the processes' request counters, both
processes listen on the two ports and nothing listens off loopback, and neither front-end process
has torch loaded (only the engine's process runs the model). SIGTERM lets streams open in
both processes finish, then every process exits. A front-end process that dies stops the whole
server with an error naming it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
from pathlib import Path

import psutil
import pytest

from meshserve.api.client import InferenceClient
from meshserve.cluster.executors.executor import free_port
from meshserve.demo_model import DEMO_MODEL_DIR
from tests.integration.api_harness import wait_for
from tests.integration.test_listen_loopback import listeners, non_loopback_listeners
from tests.serve_process import ROOT, start_serve

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="--api-server-count 2 needs 2 cores")]
PROMPT = [5, 17, 42, 7, 99, 3]
MAX_TRIES = 24  # new connections until both processes have served some (each lands on either: 2^-23 to miss)


def _serve(*flags: str):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return start_serve([str(DEMO_MODEL_DIR), "--api-server-count", "2", "--port", "0", "--grpc-port", "0",
                        "--dtype", "float32", "--drain-seconds", "20", *flags], env)


def _frontends(proc) -> list[int]:
    """Process 0 and the other front-end process (the engine's process is the other child)."""
    children = psutil.Process(proc.pid).children()
    others = [c.pid for c in children if "meshserve.api.api_server_main" in " ".join(c.cmdline())]
    assert len(children) == 2 and len(others) == 1, [c.cmdline() for c in children]
    return [proc.pid, others[0]]


def _maps_torch(pid: int) -> bool:
    """Whether process `pid` has torch's library mapped (it imported torch)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def _metric(url: str, name: str) -> dict[str, float]:
    """{labels text: value} of one metric from /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M)}


def _per_process(url: str) -> dict[str, float]:
    counts = _metric(url, "meshserve_api_server_requests_total")
    return {re.search(r'api_server="(\d+)"', k)[1]: v for k, v in counts.items()}


def _completion(url: str, body: dict) -> dict:
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:  # a new connection each time
        return json.load(r)


@pytest.fixture(scope="module")
def want():
    from meshserve.api.llm import LLM
    from meshserve.core.sampling_params import SamplingParams

    llm = LLM(str(DEMO_MODEL_DIR), dtype="float32", progress=False)
    try:
        return llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    finally:
        llm.shutdown()


def test_two_front_end_processes_share_the_ports_serve_engine_tokens_and_sum_metrics(want):
    metrics_port = free_port()
    proc, address, url = _serve("--metrics-port", str(metrics_port))
    try:
        pids = _frontends(proc)
        model = InferenceClient(address).list_models()[0].name
        calls = 0
        for _ in range(MAX_TRIES):  # gRPC: a fresh channel, so a fresh connection, per call
            with InferenceClient(address) as client:
                got = [t for r in client.stream(PROMPT, model=model, max_tokens=8, temperature=0, ignore_eos=True)
                       for t in r.token_ids]
            assert got == want.token_ids
            calls += 1
            if len(seen := _per_process(url)) == 2 and min(seen.values()) >= 1:
                break
        assert min(_per_process(url).values()) >= 1, _per_process(url)
        before = _per_process(url)
        for _ in range(MAX_TRIES):  # HTTP
            body = _completion(url, {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                     "ignore_eos": True})
            assert body["choices"][0]["text"] == want.text
            calls += 1
            now = _per_process(url)
            if all(now[k] > before[k] for k in before):
                break
        now = _per_process(url)
        assert set(now) == {"0", "1"} and all(now[k] > before[k] for k in before), (before, now)
        # the API's counters are the whole server's, whichever process answers the scrape
        assert sum(now.values()) == calls
        assert sum(_metric(url, "meshserve_requests_total").values()) == calls
        assert sum(_metric(url, "meshserve_time_to_first_token_seconds_count").values()) == calls
        # the engine's counters once: each call generated 8 tokens
        assert sum(_metric(url, "meshserve_generation_tokens_total").values()) == 8 * calls
        # the metrics port (process 0's alone) says the same
        assert _per_process(f"http://127.0.0.1:{metrics_port}") == now
        grpc_port, http_port = int(address.rsplit(":", 1)[1]), int(url.rsplit(":", 1)[1])
        seen = listeners([psutil.Process(pid) for pid in pids])
        for pid in pids:
            assert {grpc_port, http_port} <= {x.port for x in seen if x.pid == pid}, [str(x) for x in seen]
        assert metrics_port in {x.port for x in seen if x.pid == pids[0]}
        assert non_loopback_listeners() == []
        # after serving gRPC and HTTP: the front-ends never loaded torch, the engine's process did
        engine = next(c.pid for c in psutil.Process(proc.pid).children() if c.pid not in pids)
        assert [_maps_torch(pid) for pid in [*pids, engine]] == [False, False, True]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def _open_stream(url: str, model: str, max_tokens: int):
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    response = urllib.request.urlopen(urllib.request.Request(f"{url}/v1/completions", body,
                                                             {"Content-Type": "application/json"}), timeout=120)
    assert response.readline().startswith(b"data: ")  # its first token: the stream runs
    return response


def _served_by(pid: int, port: int) -> int:
    return sum(1 for c in psutil.Process(pid).net_connections(kind="tcp")
               if c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def test_sigterm_drains_the_streams_of_every_process_then_all_exit():
    proc, _, url = _serve()
    pids = _frontends(proc)
    engine = next(c.pid for c in psutil.Process(proc.pid).children() if c.pid not in pids)
    port = int(url.rsplit(":", 1)[1])
    streams = []
    try:
        for _ in range(MAX_TRIES):  # until both processes hold an open stream
            streams.append(_open_stream(url, "meshserve-demo", 96))
            if all(_served_by(pid, port) >= 1 for pid in pids):
                break
        assert all(_served_by(pid, port) >= 1 for pid in pids)
        proc.send_signal(signal.SIGTERM)
        for response in streams:
            events = [line for line in response.read().decode().splitlines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            chunks = [json.loads(e[6:]) for e in events[:-1]]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(60) == 0
        for pid in [pids[1], engine]:
            wait_for(lambda pid=pid: not Path(f"/proc/{pid}").exists() or psutil.Process(pid).status() ==
                     psutil.STATUS_ZOMBIE, timeout=30, what=f"process {pid} to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_front_end_process_that_dies_stops_the_whole_server_loudly():
    proc, _, _ = _serve()
    try:
        pids = _frontends(proc)
        os.kill(pids[1], signal.SIGKILL)
        assert proc.wait(60) != 0
        assert re.search(rf"front-end process 1 \(pid {pids[1]}\) exited with code -9", proc.stderr.read())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
