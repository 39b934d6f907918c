"""What a run measured: latency percentiles, throughputs, and the table, JSON and PNG that show them.

Per request (client side, as `vllm bench serve` defines them):
    TTFT  sent -> first piece of output
    TPOT  (last piece - first piece) / (output tokens - 1), requests with 2+ tokens
    ITL   the gaps between consecutive pieces of output (one gRPC response or SSE chunk each)
    E2E   sent -> last piece
Throughputs divide by the wall time of the measured part (warm-up excluded): requests/s,
output tokens/s, and prompt + output tokens/s. The PNG shows the CDF of each latency and the
output token rate and finished requests per second over the run.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

from meshserve.api.bench.loadgen import LoadSpec, Sample

QUANTILES = (("p50", 50), ("p90", 90), ("p99", 99))


def latencies(samples: list[Sample]) -> dict[str, list[float]]:
    """Seconds: ttft, tpot, itl, e2e over the requests that succeeded."""
    ok = [s for s in samples if not s.error and s.arrivals]
    return {
        "ttft": [s.arrivals[0] - s.sent for s in ok],
        "tpot": [(s.arrivals[-1] - s.arrivals[0]) / (s.output_tokens - 1) for s in ok if s.output_tokens > 1],
        "itl": [b - a for s in ok for a, b in zip(s.arrivals, s.arrivals[1:])],
        "e2e": [s.arrivals[-1] - s.sent for s in ok],
    }


def _stats_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{name: None for name, _ in QUANTILES}}
    ms = np.asarray(values) * 1e3
    return {"mean": float(ms.mean()), **{name: float(np.percentile(ms, q)) for name, q in QUANTILES}}


def summarize(samples: list[Sample], wall: float) -> dict:
    ok = [s for s in samples if not s.error and s.arrivals]
    output = sum(s.output_tokens for s in ok)
    prompt = sum(s.prompt_tokens for s in ok)
    return {
        "completed": len(ok), "failed": len(samples) - len(ok), "duration_s": wall,
        "prompt_tokens": prompt, "output_tokens": output,
        "request_throughput": len(ok) / wall, "output_throughput": output / wall,
        "total_token_throughput": (prompt + output) / wall,
        **{f"{name}_ms": _stats_ms(values) for name, values in latencies(samples).items()},
        "errors": sorted({s.error for s in samples if s.error})[:10],
    }


def table(summary: dict, *, backend: str, model: str, spec: LoadSpec) -> str:
    def ms(v):
        return "-" if v is None else f"{v:.1f}"

    head = (f"meshserve bench: {backend}, model {model}, {summary['completed']} ok / {summary['failed']} failed, "
            f"input {spec.input_len} output {spec.output_len} (range ratio {spec.range_ratio:g}), "
            f"rate {spec.request_rate:g}/s, max concurrency {spec.max_concurrency or 'none'}")
    lines = [head, "",
             f"duration {summary['duration_s']:.2f} s | {summary['request_throughput']:.2f} req/s | "
             f"{summary['output_throughput']:.1f} output tok/s | {summary['total_token_throughput']:.1f} total tok/s",
             "", "| latency (ms) | mean | p50 | p90 | p99 |", "| --- | --- | --- | --- | --- |"]
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = summary[f"{name}_ms"]
        lines.append(f"| {name.upper()} | {ms(s['mean'])} | {ms(s['p50'])} | {ms(s['p90'])} | {ms(s['p99'])} |")
    if summary["errors"]:
        lines += ["", "errors: " + "; ".join(summary["errors"])]
    return "\n".join(lines)


def write_json(path: str | Path, *, summary: dict, spec: LoadSpec, backend: str, model: str,
               samples: list[Sample]) -> None:
    body = {"backend": backend, "model": model, "spec": asdict(spec), "summary": summary,
            "samples": [asdict(s) for s in samples]}
    Path(path).write_text(json.dumps(body, indent=1, default=str) + "\n")


def plot(path: str | Path, samples: list[Sample], wall: float, *, title: str) -> None:
    """Latency CDFs (log time axis) and output tokens/s and finished requests/s over the run."""
    import matplotlib  # ImportError without the bench extra: the caller says so

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, values in latencies(samples).items():
        if values:
            ms = np.sort(np.asarray(values) * 1e3)
            left.plot(ms, np.arange(1, len(ms) + 1) / len(ms), label=name.upper())
    left.set(xscale="log", xlabel="latency (ms)", ylabel="fraction of requests (ITL: of gaps)", title="latency CDF")
    left.grid(True, which="both", alpha=0.3)
    left.legend()
    width = max(wall / 40, 0.05)
    edges = np.arange(0, wall + width, width)
    ok = [s for s in samples if not s.error and s.arrivals]
    times = [t for s in ok for t in s.arrivals]
    weights = [s.output_tokens / len(s.arrivals) for s in ok for _ in s.arrivals]
    tokens, _ = np.histogram(times, bins=edges, weights=weights)
    done, _ = np.histogram([s.arrivals[-1] for s in ok], bins=edges)
    right.step(edges[:-1], tokens / width, where="post", label="output tokens/s")
    right.set(xlabel="time since start (s)", ylabel="output tokens/s", title="throughput over time")
    twin = right.twinx()
    twin.step(edges[:-1], done / width, where="post", color="tab:orange", label="finished requests/s")
    twin.set_ylabel("finished requests/s")
    right.legend(loc="upper left")
    twin.legend(loc="upper right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
