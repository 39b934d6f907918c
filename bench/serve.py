"""Serving load: an open-loop load generator against a running `meshserve serve`.

Requests arrive as a Poisson process (--rate per second; inf sends them all at once) whatever
the server is doing; at most --concurrency are in flight, and a request that arrives while every
slot is taken waits for one (its clock starts when it is sent, as in vLLM's benchmark). Prompts
are windows of mixed lengths (--prompt-lens, drawn uniformly) cut at random places from the
Python documentation text the demo model was trained on (tokenized once by the server's
Tokenize), sent as token ids; each asks for a length from --output-lens with EOS ignored, so
every request produces exactly what it asked for. Measured at the client per request:
TTFT (send -> first token), TPOT ((last token - first token) / (tokens - 1)), end-to-end
latency; and output tokens per second of wall time over the whole run.

    python -m bench.serve --spawn                                  # start a demo server, 500 requests
    python -m bench.serve --address 127.0.0.1:50051 --rate 4       # against a running server
    python -m bench.serve --spawn --write docs/performance.md      # record the table
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from bench.report import write_section
from meshserve.api.client import InferenceClient
from meshserve.v1 import inference_pb2_grpc as pb_grpc

BEGIN, END = "<!-- bench/serve.py:begin -->", "<!-- bench/serve.py:end -->"


@dataclass
class Sample:
    prompt_tokens: int
    output_tokens: int
    ttft: float
    tpot: float | None
    e2e: float
    error: str = ""


def corpus_ids(client: InferenceClient, chars: int = 200_000) -> list[int]:
    """Token ids of the Python help topics (the demo model's training text), via the server."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))[:chars]
    return client.tokenize(text)[1:]  # without the leading BOS


def make_requests(ids: list[int], n: int, prompt_lens: list[int], output_lens: list[int], seed: int):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, o = rng.choice(prompt_lens), rng.choice(output_lens)
        start = rng.randrange(0, len(ids) - p)
        out.append(InferenceClient.request([0, *ids[start:start + p - 1]], max_tokens=o, ignore_eos=True,
                                           temperature=0.7, seed=seed * 100_003 + i))
    return out


async def _one(stub, request, slots: asyncio.Semaphore) -> Sample:
    async with slots:
        t0 = time.perf_counter()
        first = last = None
        n = 0
        try:
            async for r in stub.Generate(request):
                if r.token_ids:
                    last = time.perf_counter()
                    first = first or last
                    n += len(r.token_ids)
        except grpc.aio.AioRpcError as exc:
            return Sample(len(request.token_ids.ids), n, math.nan, None, math.nan, exc.code().name)
        tpot = (last - first) / (n - 1) if n > 1 else None
        return Sample(len(request.token_ids.ids), n, first - t0, tpot, last - t0)


async def run_load(address: str, requests, *, rate: float, concurrency: int, seed: int) -> tuple[list[Sample], float]:
    rng = random.Random(seed + 1)
    slots = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        await asyncio.gather(*(_one(stub, r, slots) for r in requests[:4]))  # warm-up, not counted
        t0 = time.perf_counter()
        tasks = []
        for request in requests:
            tasks.append(asyncio.create_task(_one(stub, request, slots)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        samples = await asyncio.gather(*tasks)
        return samples, time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return math.nan
    k = (len(values) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(samples: list[Sample], wall: float) -> dict:
    ok = [s for s in samples if not s.error]
    ttft = [s.ttft for s in ok]
    tpot = [s.tpot for s in ok if s.tpot is not None]
    e2e = [s.e2e for s in ok]
    out_tokens = sum(s.output_tokens for s in ok)
    return {
        "requests": len(samples), "ok": len(ok), "failed": len(samples) - len(ok), "wall_s": wall,
        "request_per_s": len(ok) / wall, "output_tokens_per_s": out_tokens / wall,
        "total_tokens_per_s": (out_tokens + sum(s.prompt_tokens for s in ok)) / wall,
        "ttft_ms": {q: 1e3 * pct(ttft, v) for q, v in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}
        | {"mean": 1e3 * statistics.fmean(ttft)},
        "tpot_ms": {q: 1e3 * pct(tpot, v) for q, v in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}
        | {"mean": 1e3 * statistics.fmean(tpot)},
        "e2e_s": {q: pct(e2e, v) for q, v in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
        "errors": sorted({s.error for s in samples if s.error}),
    }


def table(args, summary: dict, server_stats: dict) -> str:
    t, p = summary["ttft_ms"], summary["tpot_ms"]
    rows = [
        "| requests | concurrency | rate (req/s) | prompt tokens | output tokens | wall (s) | req/s | output tok/s | "
        "TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | e2e p50 / p99 (s) | failed |",
        "| " + " | ".join(["---"] * 12) + " |",
        f"| {summary['requests']} | {args.concurrency} | {args.rate:g} | {args.prompt_lens} | {args.output_lens} | "
        f"{summary['wall_s']:.1f} | {summary['request_per_s']:.2f} | {summary['output_tokens_per_s']:.0f} | "
        f"{t['p50']:.0f} / {t['p99']:.0f} | {p['p50']:.1f} / {p['p99']:.1f} | "
        f"{summary['e2e_s']['p50']:.2f} / {summary['e2e_s']['p99']:.2f} | {summary['failed']} |",
    ]
    note = (f"\n\nServer over the run: {server_stats['preemptions']} preemptions, prefix-cache hit rate "
            f"{server_stats['hit_rate']:.1%}, TTFT mean {t['mean']:.0f} ms, TPOT mean {p['mean']:.1f} ms.")
    return "\n".join(rows) + note


def spawn_server(flags: list[str]) -> tuple[subprocess.Popen, str]:
    # One intra-op thread unless told otherwise: on a small shared CPU a second torch thread
    # spin-waits against everything else (measured here: 20x slower steps at load 4 on 2 cores).
    env = {"OMP_NUM_THREADS": "1", **os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "meshserve.cli", "serve", "--grpc-port", "0", "--port", "0", *flags]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    match = re.match(r"meshserve: serving \S+ on (\S+),", line)
    if not match:
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return proc, match[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--spawn", action="store_true", help="start `meshserve serve` (demo model) for the run")
    p.add_argument("--server-flags", default="", help="extra `meshserve serve` flags with --spawn")
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rate", type=float, default=math.inf, help="Poisson arrival rate, requests/s (inf: at once)")
    p.add_argument("--prompt-lens", default="16,64,256", help="prompt lengths in tokens, drawn uniformly")
    p.add_argument("--output-lens", default="32,64,128", help="output lengths in tokens, drawn uniformly")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the samples and summary here")
    p.add_argument("--write", default=None, help="put the table into this markdown file between markers")
    args = p.parse_args(argv)
    prompt_lens = [int(x) for x in args.prompt_lens.split(",")]
    output_lens = [int(x) for x in args.output_lens.split(",")]

    proc = None
    if args.spawn:
        proc, args.address = spawn_server(args.server_flags.split())
    try:
        with InferenceClient(args.address) as client:
            requests = make_requests(corpus_ids(client), args.requests, prompt_lens, output_lens, args.seed)
            before = client.server_info().stats
            load_before = os.getloadavg()[0]
            samples, wall = asyncio.run(run_load(args.address, requests, rate=args.rate,
                                                 concurrency=args.concurrency, seed=args.seed))
            after = client.server_info().stats
            load_after = os.getloadavg()[0]
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    prompt = after.prompt_tokens - before.prompt_tokens
    server_stats = {"preemptions": after.num_preemptions - before.num_preemptions,
                    "hit_rate": (after.prefix_hit_tokens - before.prefix_hit_tokens) / max(1, prompt)}
    summary = summarize(samples, wall)
    text = table(args, summary, server_stats)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "server": server_stats,
                                               "samples": [asdict(s) for s in samples]}, indent=1))
    if args.write:
        cpu = platform.processor() or platform.machine()
        header = (f"Measured {time.strftime('%Y-%m-%d')} with `python -m bench.serve {' '.join(argv or sys.argv[1:])}`"
                  f" ({os.cpu_count()} CPU cores, {cpu}, Python {platform.python_version()}; load average "
                  f"{load_before:.1f} before and {load_after:.1f} after the run: the cores are shared).\n\n")
        write_section(Path(args.write), f"{BEGIN}\n{header + text}\n{END}", BEGIN, END)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
