"""bench/serve_latency.py against a live `meshserve serve` (the engine in its own process, as serve
defaults): every request of the traced server leaves a mark at every hop of its way, from the
gRPC handler or the HTTP front-end through the channel, the coordinator, the replica's loop and
step thread and back, each inside that request's window on the client's clock; the untraced
and the offline runs time every request."""

from __future__ import annotations

import os

import pytest

from bench import serve_latency as sl
from bench.served import EngineSettings
from meshserve.demo_model import DEMO_MODEL_DIR

pytestmark = pytest.mark.timeout(300)
REPEATS = 3
SPLIT_HOPS = ["frontend.open", "engine.open_received", "coordinator.submitted", "engine.admitted",
              "replica.added", "step.start",
              "step.end", "replica.delivered", "engine.batch", "frontend.batch_received",
              "frontend.delta_out", "client"]
FACE_HOPS = {"grpc": ["grpc.handler", "grpc.write"],
             "http": ["http.asgi", "http.route", "http.body_parsed", "http.tokenized", "http.write"]}


def test_every_hop_is_marked_once_per_request_on_the_clients_clock(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the server inherits it: two processes share two cores
    settings = EngineSettings(model=str(DEMO_MODEL_DIR), device="cpu", dtype="float32", max_num_seqs=2,
                              max_model_len=64, kv_cache_memory_bytes=16 << 20)
    runs, traced = sl.run_all(settings, ["offline", "grpc", "http"], sl.DEFAULT_PROMPT, [1], repeats=REPEATS,
                              warmup=1, log_dir=tmp_path, trace=True)
    assert sorted(r.path for r in runs) == ["grpc", "http", "offline"]
    for run in runs:
        assert len(run.ttft_ms) == REPEATS and all(0 < t <= w for t, w in zip(run.ttft_ms, run.total_ms))
    for run in traced:
        assert len(run.ttft_ms) == REPEATS
        for hop in FACE_HOPS[run.path] + SPLIT_HOPS:
            assert len(run.hops.get(hop, [])) == REPEATS, (run.path, hop, run.hops)
        for k in range(REPEATS):  # the intervals add up to the request's TTFT: every mark lay in its window
            total = sum(v[k] for v in run.hops.values())
            assert total == pytest.approx(run.ttft_ms[k], abs=1e-3)
        assert all(n >= 1 for n in run.num_steps) and all(s > 0 for s in run.steps_ms)
    text = sl.hop_table(traced)
    assert "engine.open_received" in text and "grpc mt=1" in text and "http mt=1" in text
