"""Paced overlap on a simulated device: a new request's time to first token beside decoding streams,
and those streams' time per token, with SchedulerConfig.paced_overlap off and on.

With overlap scheduling a replica plans step N+1 as soon as step N-1's results are back, while the
device runs step N: a request that arrives after that planning waits for step N and for step N+1
before its prefill runs in N+2. Paced, a replica in a steady decode first waits for arrivals for
most of the time its last step waited for the device (cluster/replica.py `_pace`), so an arrival
in that window goes into N+1. What it should cost: nothing, as long as the device never waits
for the late plan (the streams' time per token shows it).

A tp=1 replica on a thread over tests/simulated_device.py's worker (a step takes --device-ms of
"device" time after the one before; no model work), --background streams decoding, and
--arrivals single-token requests sent one at a time at random moments; rounds alternate off/on.
On the GPU the same comparison is `serve --paced-overlap` against `serve` in bench/serve_latency.py.

    PYTHONPATH=. python -m bench.paced_overlap [--device-ms 7] [--out bench/results]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.report import pyplot  # noqa: E402
from tests.simulated_device import DEVICE_ENV, WORKER  # noqa: E402


@dataclasses.dataclass
class Run:
    paced: bool
    ttft_ms: list[float] = dataclasses.field(default_factory=list)
    tpot_ms: list[float] = dataclasses.field(default_factory=list)  # the background streams', per round


async def _round(coord, run: Run, args, rng: random.Random) -> None:
    from meshserve.core.sampling_params import SamplingParams

    background = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)  # (the worker's context: 256)
    arrival = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    counts = [0] * args.background
    stop = asyncio.Event()

    async def stream(i: int) -> None:  # one stream after the other in this slot until the round ends
        for n in range(1_000_000):
            if stop.is_set():
                return
            async for d in coord.generate([3 + i, 4, 5, 6], background, request_id=f"bg-{i}-{n}"):
                counts[i] += len(d.token_ids)
                if stop.is_set():
                    return

    tasks = [asyncio.ensure_future(stream(i)) for i in range(args.background)]
    await asyncio.sleep(20 * args.device_ms / 1e3)  # every stream decoding
    start_counts, started = sum(counts), time.perf_counter()
    for k in range(args.arrivals):
        await asyncio.sleep(rng.uniform(0, 2 * args.device_ms / 1e3))  # a random phase of the step
        sent = time.perf_counter()
        async for d in coord.generate([7, 8, 9, k % 50 + 10], arrival, request_id=f"a-{run.paced}-{k}"):
            if d.token_ids:
                run.ttft_ms.append((time.perf_counter() - sent) * 1e3)
    per_stream = (sum(counts) - start_counts) / args.background
    run.tpot_ms.append((time.perf_counter() - started) * 1e3 / per_stream)
    stop.set()
    for task in tasks:  # leaving a stream's iterator cancels its request
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def measure(args) -> list[Run]:
    from meshserve.cluster.coordinator import ClusterConfig, Coordinator
    from meshserve.config import CacheConfig, ModelConfig, PoolConfig, SchedulerConfig
    from meshserve.engine.engine_config import EngineConfig

    os.environ[DEVICE_ENV] = str(args.device_ms)
    model_dir = tempfile.mkdtemp(prefix="msbench-paced-")  # NullWorker reads nothing from it
    runs = {False: Run(False), True: Run(True)}
    rng = random.Random(0)

    async def main() -> None:
        for _ in range(args.rounds):
            for paced in (False, True):
                engine = EngineConfig(model=ModelConfig(model=model_dir), cache=CacheConfig(num_kv_blocks=4096),
                                      scheduler=SchedulerConfig(async_scheduling=True, paced_overlap=paced))
                coord = await Coordinator(ClusterConfig(engine=engine, pools=PoolConfig(), runtime="threads",
                                                        worker_class=WORKER)).start()
                try:
                    await _round(coord, runs[paced], args, rng)
                finally:
                    await coord.shutdown(drain=False)
    asyncio.run(main())
    return [runs[False], runs[True]]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def table(runs: list[Run], args) -> str:
    off, on = runs
    lines = [f"simulated device {args.device_ms:g} ms a step, {args.background} streams decoding, "
             f"{args.arrivals} arrivals a round x {args.rounds} rounds (alternating)",
             "| paced overlap | TTFT p50 ms | TTFT p90 ms | TTFT mean ms | background TPOT ms (median of rounds) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for r in runs:
        lines.append(f"| {'on' if r.paced else 'off'} | {pct(r.ttft_ms, 0.5):.2f} | {pct(r.ttft_ms, 0.9):.2f} | "
                     f"{statistics.mean(r.ttft_ms):.2f} | {statistics.median(r.tpot_ms):.2f} |")
    lines.append(f"TTFT mean, on - off: {statistics.mean(on.ttft_ms) - statistics.mean(off.ttft_ms):+.2f} ms; "
                 f"TPOT on / off: {statistics.median(on.tpot_ms) / statistics.median(off.tpot_ms):.3f}")
    return "\n".join(lines)


def plot(runs: list[Run], path: Path, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        xs = sorted(r.ttft_ms)
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=f"paced overlap {'on' if r.paced else 'off'}")
    ax.set(xlabel="time to first token (ms)", ylabel="fraction of arrivals", title=title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device-ms", type=float, default=7.0, help="simulated device time of a step (8B shape: ~7)")
    ap.add_argument("--background", type=int, default=15, help="streams decoding beside the arrivals")
    ap.add_argument("--arrivals", type=int, default=40, help="measured requests a round, one at a time")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="write paced-overlap.json and .png here")
    args = ap.parse_args(argv)
    runs = measure(args)
    title = f"paced overlap, simulated {args.device_ms:g} ms steps, {args.background} streams"
    print(table(runs, args))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "paced-overlap.json").write_text(json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "runs": [dataclasses.asdict(r) for r in runs]},
            indent=1) + "\n")
        plot(runs, args.out / "paced-overlap.png", title)
        print(f"wrote {args.out}/paced-overlap.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
