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


def _own_marks(marks: list[sl.Mark], request_id: str, face: str) -> tuple[int, int]:
    """(the request's first face mark, its first write) in the trace, found by the id its client
    sent: gRPC's write carries it; HTTP's carries the service's id, which http.tokenized links."""
    first, write = ("grpc.handler", "grpc.write") if face == "grpc" else ("http.asgi", "http.write")
    ids = {request_id}
    if face == "http":
        ids |= next(m.keys for m in marks if m.stage == "http.tokenized" and request_id in m.keys)
    start = next(m.ns for m in marks if m.stage == first and request_id in m.keys)
    return start, next(m.ns for m in marks if m.stage == write and ids & m.keys)


def test_background_streams_decode_from_a_child_process_beside_the_measured_requests(tmp_path):
    """--background: the streams run in a child process (bench/background_streams.py) whose
    reports of their token gaps come back; each measured request still gets its first token and
    its traced intervals add up to its TTFT, over both faces. The intervals from its own first
    face mark to "client" end at its own write (the trace's mark with its id), whatever the
    background stream wrote in its window: "client" is its write -> its read."""
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
        marks = sl.read_trace(tmp_path / "hops.txt")
        first_hop = FACE_HOPS[run.path][0]
        for k in range(REPEATS):
            assert sum(v[k] for v in run.hops.values()) == pytest.approx(run.ttft_ms[k], abs=1e-3)
            start, write = _own_marks(marks, sl.measured_request_id(run.path, 1, 1, 1 + k), run.path)  # (1 warm-up)
            between = sum(v[k] for hop, v in run.hops.items() if hop not in (first_hop, "client"))
            assert between == pytest.approx((write - start) / 1e6, abs=1e-3), (run.path, k, run.hops)
        assert all(n >= 1 for n in run.num_steps)


def _trace(tmp_path, lines: list[tuple[float, int, str]]) -> list[sl.Mark]:
    """A trace file as the server writes it (ms -> ns), read back by the bench."""
    path = tmp_path / "hops.txt"
    path.write_text("".join(f"{int(t * MS)} {pid} {rest}\n" for t, pid, rest in lines))
    return sl.read_trace(path)


MS = 1_000_000
FRONT, ENGINE = 100, 200  # pids


@pytest.mark.parametrize("read_at", [7.5, 10.5])
def test_the_per_stream_hops_are_the_measured_requests_own_marks(tmp_path, read_at):
    """Three streams handed and written in turn after one BATCH, the measured request's last: its
    delta_out / write are the ones its ids name, so "client" is its own write -> read, and the
    other two streams' turns count in its wait in the front-end. Read after the next pass's
    marks (a second BATCH inside the window), still its first pass's: a hop is the request's
    first mark of that name."""
    marks = _trace(tmp_path, [
        (0, FRONT, "grpc.handler m"), (1, FRONT, "frontend.batch_received pub:m"),
        (2, FRONT, "frontend.delta_out pub:a"), (3, FRONT, "grpc.write a pub:a"),  # stream A
        (4, FRONT, "frontend.delta_out pub:b"), (5, FRONT, "grpc.write b pub:b"),  # stream B
        (6, FRONT, "frontend.delta_out pub:m"), (7, FRONT, "grpc.write m pub:m"),  # the measured request
        (8, FRONT, "frontend.batch_received"),                                     # the next pass
        (9, FRONT, "frontend.delta_out pub:m"), (10, FRONT, "grpc.write m pub:m")])
    run = sl.PathRun("grpc", 1)
    sl.attribute(run, marks, [sl.Window("m", 0, int(read_at * MS))])
    assert run.hops["frontend.batch_received"] == [1.0]
    assert run.hops["frontend.delta_out"] == [5.0] and run.hops["grpc.write"] == [1.0]
    assert run.hops["client"] == [pytest.approx(read_at - 7)]


def _overlap_trace(face: str) -> list[tuple[float, int, str]]:
    """Overlap scheduling beside a decoding stream b: the measured request m is added while a
    step runs; the next step returns b's token only (m's prefill is the step it submitted),
    and its deltas go out first in m's window; m's first token comes a step later."""
    if face == "grpc":  # the client's id m, the service's pub:m (grpc.write links them)
        head, mine = [(0.5, FRONT, "grpc.handler m")], "pub:m"
        own_write, other_write = "grpc.write m pub:m", "grpc.write b pub:b"
    else:  # x-request-id m; the service's id cmpl-m, linked on http.tokenized
        head = [(0.2, FRONT, "http.asgi m"), (0.3, FRONT, "http.route m"), (0.4, FRONT, "http.body_parsed m"),
                (0.5, FRONT, "http.tokenized m cmpl-m")]
        mine = "cmpl-m"
        own_write, other_write = "http.write cmpl-m", "http.write cmpl-b"
    other = "pub:b" if face == "grpc" else "cmpl-b"
    return [*head, (1.0, FRONT, f"frontend.open {mine}"), (1.3, ENGINE, f"engine.open_received {mine}"),
            (1.5, ENGINE, f"coordinator.submitted {mine}"), (1.6, ENGINE, f"engine.admitted {mine}"),
            (2.0, ENGINE, f"replica.added {mine}"),
            (2.2, ENGINE, "step.start"), (4.0, ENGINE, "step.end"),  # b's token (not its first: no key)
            (4.1, ENGINE, f"replica.delivered {other}"), (4.2, ENGINE, "engine.batch"),
            (4.5, FRONT, "frontend.batch_received"), (4.7, FRONT, f"frontend.delta_out {other}"),
            (4.8, FRONT, other_write),
            (5.0, ENGINE, "step.start"), (7.0, ENGINE, f"step.end {mine}"),  # m's first token
            (7.1, ENGINE, f"replica.delivered {other}"), (7.15, ENGINE, f"replica.delivered {mine}"),
            (7.3, ENGINE, f"engine.batch {mine}"), (7.6, FRONT, f"frontend.batch_received {mine}"),
            (7.8, FRONT, f"frontend.delta_out {mine}"), (7.9, FRONT, own_write),  # first tokens first
            (8.0, FRONT, f"frontend.delta_out {other}"), (8.1, FRONT, other_write),
            (8.3, ENGINE, "step.start")]  # the next step, under way when m's token is read at 8.5


@pytest.mark.parametrize("face", ["grpc", "http"])
def test_the_step_that_gave_the_token_is_taken_not_the_first_with_deltas(tmp_path, face):
    """The first step returning deltas in the window is b's; m's token is the next step's. The
    hops are m's: step.end at the step its key names (two steps counted, their time inside
    `core.step()` summed), delivery, BATCH and writes of that pass, "client" from m's own
    write. (By names and order, the bench took the first step, b's pass, and b's write: "client"
    was 3.7 ms of an 8.5 ms TTFT.)"""
    run = sl.PathRun(face, 1)
    sl.attribute(run, _trace(tmp_path, _overlap_trace(face)), [sl.Window("m", 0, int(8.5 * MS))])
    got = {hop: v[0] for hop, v in run.hops.items()}
    want = {"replica.added": 0.4, "step.start": 0.2, "step.end": 4.8, "replica.delivered": 0.15,
            "engine.batch": 0.15, "frontend.batch_received": 0.3, "frontend.delta_out": 0.2,
            f"{face}.write": 0.1, "client": 0.6}
    assert {hop: got[hop] for hop in want} == {hop: pytest.approx(v) for hop, v in want.items()}
    assert sum(got.values()) == pytest.approx(8.5)  # every interval is m's: they add up to its TTFT
    assert run.num_steps == [2] and run.steps_ms == [pytest.approx(1.8 + 2.0)]
