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


def test_background_streams_decode_from_a_child_process_beside_the_measured_requests(tmp_path):
    """--background: the streams run in a child process (bench/background_streams.py) whose
    reports of their token gaps come back; each measured request still gets its first token and
    its traced intervals add up to its TTFT, over both faces."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    settings = EngineSettings(model=str(DEMO_MODEL_DIR), device="cpu", dtype="float32", max_num_seqs=2,
                              max_model_len=64, kv_cache_memory_bytes=16 << 20)
    runs, traced = sl.run_all(settings, ["grpc", "http"], sl.DEFAULT_PROMPT, [1], repeats=REPEATS, warmup=1,
                              log_dir=tmp_path, trace=True, backgrounds=(1,), background_tokens=16)
    assert sorted(r.path for r in runs + traced) == ["grpc", "grpc", "http", "http"]
    for run in runs + traced:
        assert run.background == 1 and len(run.ttft_ms) == REPEATS
        assert run.step_ms and all(s > 0 for s in run.step_ms)  # the child's streams decoded, and said so
    for run in traced:
        for hop in FACE_HOPS[run.path][-1:] + ["frontend.delta_out", "client"]:
            assert len(run.hops.get(hop, [])) == REPEATS, (run.path, hop, run.hops)
        for k in range(REPEATS):
            assert sum(v[k] for v in run.hops.values()) == pytest.approx(run.ttft_ms[k], abs=1e-3)


def test_the_per_stream_hops_are_the_measured_requests_last_marks_of_the_pass():
    """Three streams handed and written in turn after one BATCH, the measured request's last:
    its delta_out / write are the last pair before its first token, so "client" is its own
    write -> read, and the other two streams' turns count in its wait in the front-end. A second
    BATCH inside the window (a later pass) is not taken."""
    ms = 1_000_000
    marks = [(0 * ms, "grpc.handler"), (1 * ms, "frontend.batch_received"),
             (2 * ms, "frontend.delta_out"), (3 * ms, "grpc.write"),   # stream A
             (4 * ms, "frontend.delta_out"), (5 * ms, "grpc.write"),   # stream B
             (6 * ms, "frontend.delta_out"), (7 * ms, "grpc.write"),   # the measured request
             (8 * ms, "frontend.batch_received"),                      # the next pass, read after
             (9 * ms, "frontend.delta_out"), (10 * ms, "grpc.write")]
    run = sl.PathRun("grpc", 1)
    sl.attribute(run, marks, [(0, int(7.5 * ms))])
    assert run.hops["frontend.batch_received"] == [1.0]
    assert run.hops["frontend.delta_out"] == [5.0] and run.hops["grpc.write"] == [1.0]
    assert run.hops["client"] == [0.5]
    run = sl.PathRun("grpc", 1)  # read after the next pass's marks: still the first pass's last pair
    sl.attribute(run, marks, [(0, int(10.5 * ms))])
    assert run.hops["frontend.delta_out"] == [5.0] and run.hops["client"] == [3.5]
