"""Where a decode step's device idle time comes from, read off a torch-profiler (Kineto) trace.

The device's work (kernels, copies, memsets) is merged into busy intervals; every idle gap of at
least --min-gap-us between two of them is attributed through the CUDA runtime call that launched
the work after it (matched by CUPTI's correlation id; a CUDA graph's kernels carry the id of their
`cudaGraphLaunch`):
- late launch: that call ended after the device had gone idle, so the device waited for the
  host; the gap is charged to what the host was doing when the device went idle (the innermost
  Python function or operator running then on the launching thread);
- queued: the work was launched before the gap began, so the device itself waited (an event, a
  copy from pageable memory, another stream); charged to the launching call's name.

    python -m bench.trace_gaps timeline_bs256.json.gz --steps 5

`bench/e2e.py --timeline --out DIR` writes such traces (CPU and CUDA activity with Python stacks,
over the profiled decode steps of every batch size) and prints this summary beside them.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("python_function", "cpu_op", "user_annotation")


@dataclass(frozen=True)
class Gap:
    start_us: float
    length_us: float
    kind: str  # "late launch" or "queued"
    cause: str  # the host function running when the device went idle, or the launching call
    launch: str  # the runtime call that launched the work after the gap
    after: str  # the work after the gap


def load(path: str | Path) -> dict:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def _complete(events: list[dict], cats: tuple[str, ...]) -> list[dict]:
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in cats and "ts" in e]


def _innermost(host: list[dict], starts: list[float], t: float) -> str:
    """The shortest of one thread's host events (sorted by start) that spans time t, or "?"."""
    best, best_dur = "?", float("inf")
    for k in range(bisect.bisect_right(starts, t)):
        e = host[k]
        dur = float(e.get("dur", 0))
        if t <= float(e["ts"]) + dur and dur < best_dur:
            best, best_dur = e["name"], dur
    return best


def device_gaps(trace: dict, min_gap_us: float = 5.0) -> list[Gap]:
    """Every idle gap of at least min_gap_us between the device's busy intervals, attributed."""
    events = trace.get("traceEvents", [])
    device = sorted(_complete(events, DEVICE_CATS), key=lambda e: float(e["ts"]))
    runtime = {e.get("args", {}).get("correlation"): e for e in _complete(events, ("cuda_runtime", "cuda_driver"))}
    by_thread: dict[object, list[dict]] = defaultdict(list)  # host events per thread, by start
    for e in sorted(_complete(events, HOST_CATS), key=lambda e: float(e["ts"])):
        by_thread[e.get("tid")].append(e)
    starts = {tid: [float(e["ts"]) for e in evs] for tid, evs in by_thread.items()}
    gaps: list[Gap] = []
    busy_until = None
    for e in device:
        ts, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
        if busy_until is not None and ts - busy_until >= min_gap_us:
            call = runtime.get(e.get("args", {}).get("correlation"))
            if call is None:
                gaps.append(Gap(busy_until, ts - busy_until, "queued", "?", "?", e["name"]))
            elif float(call["ts"]) + float(call.get("dur", 0)) > busy_until:
                tid = call.get("tid")
                cause = _innermost(by_thread.get(tid, []), starts.get(tid, []), busy_until)
                gaps.append(Gap(busy_until, ts - busy_until, "late launch", cause, call["name"], e["name"]))
            else:
                gaps.append(Gap(busy_until, ts - busy_until, "queued", call["name"], call["name"], e["name"]))
        busy_until = end if busy_until is None else max(busy_until, end)
    return gaps


def summarize(gaps: list[Gap], steps: int, top: int = 12) -> str:
    """A markdown table: idle microseconds per step by (kind, cause), largest first."""
    total: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for g in gaps:
        row = total[(g.kind, g.cause)]
        row[0] += 1
        row[1] += g.length_us
    lines = [f"idle gaps: {len(gaps) / steps:.1f} per step, {sum(g.length_us for g in gaps) / steps:.1f} us per step",
             "| kind | host was in / launched by | gaps per step | idle us per step |", "|---|---|---:|---:|"]
    for (kind, cause), (n, us) in sorted(total.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"| {kind} | {cause[:80]} | {n / steps:.1f} | {us / steps:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a chrome trace from torch.profiler (.json or .json.gz)")
    ap.add_argument("--steps", type=int, default=1, help="decode steps in the trace (the table is per step)")
    ap.add_argument("--min-gap-us", type=float, default=5.0)
    args = ap.parse_args(argv)
    print(summarize(device_gaps(load(args.trace), args.min_gap_us), args.steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
