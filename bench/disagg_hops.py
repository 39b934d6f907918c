"""Where a disaggregated request's first and second token go, hop by hop, read off a hop trace.

Serve with MESHSERVE_HOP_TRACE=FILE (core/hop_trace.py) and one request at a time, e.g.

    MESHSERVE_HOP_TRACE=/tmp/hops.txt python -m bench.disagg_ttft --shape tiny-llama --threads 1 \\
        --paths disaggregated --concurrency 1 --prompts-per-stream 16
    python -m bench.disagg_hops /tmp/hops.txt

Each request's window runs from its `grpc.handler` mark to the next request's. In it, the first
token is the first `grpc.write`, the second the next one; the prefill replica's step is the
first `step.start`/`step.end` pair, the decode replica's first step the first pair after
`handover.adopted`. The prefill rank is the process that marked `rank.offer_begin`, the decode
rank the one that marked `rank.pull_start`. Prints the p50 (and max) over requests of each
interval between consecutive hops that the trace has (a trace of an older tree lacks some marks:
those rows are left out), and the decode replica's steps split into the driver's and the rank's
parts. Warm-up requests are skipped (--skip).
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

# (label, from, to): hop_trace stages; rank.offer_* are the prefill rank's, rank.pull_* the decode rank's.
FIRST_TOKEN = [
    ("gRPC handler -> prefill step starts", "grpc.handler", "step.start"),
    ("prefill step (driver)", "step.start", "step.end"),
    ("prefill step ends -> offer sent", "step.end", "handover.offer_sent"),
    ("step ends -> first token delivered to its stream", "step.end", "replica.delivered"),
    ("delivered -> first token written (gRPC)", "replica.delivered", "grpc.write"),
]
HAND_OVER = [
    ("offer sent -> the rank starts it", "handover.offer_sent", "rank.offer_begin"),
    ("the rank's kv_offer", "rank.offer_begin", "rank.offer_end"),
    ("the rank answered -> offer read by the replica", "rank.offer_end", "handover.offered"),
    ("offer read -> kv_pull_start sent (decode replica)", "handover.offered", "handover.pull_start_sent"),
    ("kv_pull_start sent -> the rank takes the call", "handover.pull_start_sent", "rank.pull_start"),
    ("the rank takes it -> its pull thread begins", "rank.pull_start", "rank.pull_begin"),
    ("the pull", "rank.pull_begin", "rank.pull_end"),
    ("pull ended -> request adopted", "rank.pull_end", "handover.adopted"),
    ("adopted -> decode step starts", "handover.adopted", "step.start"),
    ("decode step (driver)", "step.start", "step.end"),
    ("decode step ends -> second token written", "step.end", "grpc.write"),
]
TOTALS = [  # computed in intervals()
    ("first token written -> second written", "", ""),
    ("gRPC handler -> first token written", "", ""),
    ("first token delivered -> offer read", "", ""),
]


def read(path: str) -> list[tuple[int, int, str]]:
    out = []
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3:  # (a mark's keys, core/hop_trace.py, follow its stage: one request at a time here)
                out.append((int(parts[0]), int(parts[1]), parts[2]))
    return sorted(out)


def windows(marks: list[tuple[int, int, str]]) -> list[list[tuple[int, int, str]]]:
    starts = [i for i, m in enumerate(marks) if m[2] == "grpc.handler"]
    return [marks[a:b] for a, b in zip(starts, starts[1:] + [len(marks)])]


def first_after(window, stage: str, t0: int, pid: int | None = None, nth: int = 1) -> int | None:
    seen = 0
    for t, p, s in window:
        if t >= t0 and s == stage and (pid is None or p == pid):
            seen += 1
            if seen == nth:
                return t
    return None


def pid_of(window, stage: str) -> int | None:
    return next((p for _, p, s in window if s == stage), None)


def intervals(window) -> dict[str, float]:
    """ms per labelled interval of one request (those its marks allow). Each row's `from` is the
    first such mark at or after the previous row's `from`, its `to` the first after that."""
    out: dict[str, float] = {}
    t_start = window[0][0]
    ranks = {"rank.offer": pid_of(window, "rank.offer_begin"), "rank.pull": pid_of(window, "rank.pull_start")}

    def at(stage: str, t0: int, nth: int = 1) -> int | None:
        pid = next((p for prefix, p in ranks.items() if stage.startswith(prefix)), None)
        return first_after(window, stage, t0, pid, nth)

    for rows, cursor in ((FIRST_TOKEN, t_start), (HAND_OVER, at("handover.offer_sent", t_start))):
        if cursor is None:  # a tree without the hand-over's marks
            continue
        for label, a, b in rows:
            ta = at(a, cursor)
            tb = None if ta is None else at(b, ta)
            if tb is not None:
                out[label] = (tb - ta) / 1e6
                cursor = ta
    w1, w2 = at("grpc.write", t_start), at("grpc.write", t_start, 2)
    delivered, offered = at("replica.delivered", t_start), at("handover.offered", t_start)
    if w1 and w2:
        out[TOTALS[0][0]] = (w2 - w1) / 1e6
    if w1:
        out[TOTALS[1][0]] = (w1 - t_start) / 1e6
    if delivered and offered:
        out[TOTALS[2][0]] = (offered - delivered) / 1e6
    return out


def decode_steps(window) -> list[tuple[float, float]]:
    """(driver's step ms, the decode rank's execute_step ms) of every decode step in the window."""
    decode_rank = pid_of(window, "rank.pull_start")
    t0 = first_after(window, "handover.adopted", window[0][0])
    if t0 is None:
        return []
    out, start = [], None
    for t, p, s in window:
        if t < t0:
            continue
        if s == "step.start":
            start, rank_a, rank_b = t, None, None
        elif s == "rank.step_begin" and p == decode_rank and start is not None:
            rank_a = t
        elif s == "rank.step_end" and p == decode_rank and start is not None:
            rank_b = t
        elif s == "step.end" and start is not None:
            if rank_a and rank_b:
                out.append(((t - start) / 1e6, (rank_b - rank_a) / 1e6))
            start = None
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--skip", type=int, default=1, help="first requests of each trace not counted (warm-up)")
    args = ap.parse_args(argv)
    per: dict[str, list[float]] = defaultdict(list)
    steps: list[tuple[float, float]] = []
    n = 0
    for path in args.traces:
        for w in windows(read(path))[args.skip:]:
            n += 1
            for k, v in intervals(w).items():
                per[k].append(v)
            steps += decode_steps(w)
    print(f"{n} requests; ms, p50 [max]")
    print("| interval | p50 | max | n |")
    print("| --- | ---: | ---: | ---: |")
    for label, _, _ in FIRST_TOKEN + HAND_OVER + TOTALS:
        v = per.get(label)
        if v:
            print(f"| {label} | {statistics.median(v):.2f} | {max(v):.2f} | {len(v)} |")
    if steps:
        driver, rank = zip(*steps)
        print(f"| decode steps: driver | {statistics.median(driver):.2f} | {max(driver):.2f} | {len(steps)} |")
        print(f"| decode steps: rank's execute_step | {statistics.median(rank):.2f} | {max(rank):.2f} | |")
        over = [d - r for d, r in steps]
        print(f"| decode steps: driver - rank (channel, plan, output) | {statistics.median(over):.2f} | "
              f"{max(over):.2f} | |")


if __name__ == "__main__":
    main()
