"""bench/trace_gaps.py on a hand-built Kineto trace whose gaps and causes are known by construction."""

import gzip
import json

from bench.trace_gaps import Gap, device_gaps, load, main, summarize


def _x(cat, name, ts, dur, tid=1, corr=None):
    event = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}
    if corr is not None:
        event["args"] = {"correlation": corr}
    return event


TRACE = {"traceEvents": [
    _x("python_function", "engine.step", 0, 200),
    _x("python_function", "scheduler.schedule", 10, 30),
    _x("cuda_runtime", "cudaGraphLaunch", 45, 5, corr=1),
    _x("kernel", "gemm", 52, 8, tid=7, corr=1),
    _x("kernel", "norm", 61, 9, tid=7, corr=1),  # 1 us after gemm: below the threshold
    _x("python_function", "scheduler.update", 65, 55),  # running when the device goes idle at 70
    _x("cpu_op", "aten::copy_", 100, 10),  # later, inside update: not what ran at 70
    _x("cuda_runtime", "cudaGraphLaunch", 125, 5, corr=2),  # ends after 70: a late launch
    _x("kernel", "attention", 132, 8, tid=7, corr=2),
    _x("cuda_runtime", "cudaMemcpyAsync", 135, 1, corr=3),  # ends before 140: queued
    _x("gpu_memcpy", "Memcpy HtoD", 150, 5, tid=8, corr=3),
    _x("kernel", "orphan", 170, 5, tid=7, corr=99),  # no runtime call recorded for it
    {"ph": "s", "cat": "ac2g", "name": "flow", "ts": 45, "id": 1, "pid": 1, "tid": 1},  # not a complete event
]}  # fmt: skip


def test_gaps_are_measured_and_attributed():
    assert device_gaps(TRACE, min_gap_us=5) == [
        Gap(70, 62, "late launch", "scheduler.update", "cudaGraphLaunch", "attention"),
        Gap(140, 10, "queued", "cudaMemcpyAsync", "cudaMemcpyAsync", "Memcpy HtoD"),
        Gap(155, 15, "queued", "?", "?", "orphan"),
    ]
    assert [g.length_us for g in device_gaps(TRACE, min_gap_us=12)] == [62, 15]


def test_summary_per_step_largest_first(tmp_path, capsys):
    text = summarize(device_gaps(TRACE), steps=2)
    rows = [line for line in text.splitlines() if line.startswith("| late") or line.startswith("| queued")]
    assert rows[0] == "| late launch | scheduler.update | 0.5 | 31.0 |"
    assert text.splitlines()[0] == "idle gaps: 1.5 per step, 43.5 us per step"
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(TRACE, f)
    assert load(path) == TRACE
    assert main([str(path), "--steps", "2"]) == 0
    assert capsys.readouterr().out.strip() == text
