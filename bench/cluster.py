"""Cluster runtime on CPU: per-step executor overhead, and TTFT / TPOT of unified vs disaggregated pools.

Part 1, step overhead. A decode-shaped StepPlan (32 sequences, 8-block tables) goes through
each executor to a worker that does no model work (NullWorker without its agreement check),
so the per-step time is all executor: msgpack, transport, wake-ups. Executors: in-process (a
method call), ranks on a thread over the zmq channel, subprocess ranks over the channel, Ray
actors over the channel, and (for contrast) one Ray remote call per rank per step, the design
the channel replaces. All run side by side, timed in interleaved rounds (background load on a
shared machine hits them alike); medians after a warm-up; overhead = median - in-process.

Part 2, serving. The bundled demo model on Ray: two actors either way, unified (2 replicas) or
disaggregated (1 prefill + 1 decode). A mixed load, long prompts among short ones arriving
at a fixed interval; per request TTFT (submit -> first token) and TPOT ((last - first token) /
(tokens - 1)); means and p90 per class.

    python -m bench.cluster                          # both parts, prints tables
    python -m bench.cluster --write docs/performance.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # no token written under ~/.ray by a bench run

from bench.report import write_section  # noqa: E402
from tests.null_worker import NullWorker  # noqa: E402

BEGIN, END = "<!-- bench/cluster.py:begin -->", "<!-- bench/cluster.py:end -->"
SILENT = "bench.cluster:SilentNullWorker"


class SilentNullWorker(NullWorker):
    """NullWorker without its per-step all-reduce: at tp=2 only the executor's work remains."""

    def _agree(self, tokens: list[int]) -> None:
        return None


# -- part 1: step overhead --------------------------------------------------------------------------

def decode_plans(num_seqs: int):
    """A prefill plan announcing `num_seqs` requests, then an endless stream of decode plans.

    Every decode plan has the same shape (one token per sequence at a fixed position), so the
    worker's own cost is the same every step and only the executor's cost varies.
    """
    from meshserve.workers.step import NewRequest, ScheduledSeq, StepPlan

    ids = [f"req-{i}" for i in range(num_seqs)]
    table = list(range(1, 9))
    yield StepPlan.from_seqs(0, [ScheduledSeq(r, [1, 2, 3, 4], 0, [table]) for r in ids],
                   [NewRequest(r, [1, 2, 3, 4], {"temperature": 0.0, "max_tokens": 10_000}) for r in ids])
    step = 1
    while True:
        yield StepPlan.from_seqs(step, [ScheduledSeq(r, [5], 20, [table]) for r in ids])
        step += 1


class Timed:
    """One executor under test: its step function, its plan stream and the step times so far."""

    def __init__(self, name: str, tp: int, execute, num_seqs: int, close=None) -> None:
        self.name, self.tp, self.execute, self.close = name, tp, execute, close
        self.plans = decode_plans(num_seqs)
        self.times: list[float] = []
        execute(next(self.plans))

    def run(self, steps: int, *, record: bool = True) -> None:
        for _ in range(steps):
            plan = next(self.plans)
            t0 = time.perf_counter()
            self.execute(plan)
            if record:
                self.times.append(time.perf_counter() - t0)


def engine_config(tp: int, model_dir: str):
    from meshserve.config import CacheConfig, ModelConfig, ParallelConfig
    from meshserve.engine.engine_config import EngineConfig

    return EngineConfig(model=ModelConfig(model=model_dir), cache=CacheConfig(num_kv_blocks=64),
                        parallel=ParallelConfig(tp=tp))


def measure_overhead(args) -> list[tuple[str, int, float]]:
    """Median step time per executor. All executors run side by side, in interleaved blocks of
    steps, so that background load on a shared machine falls on all of them alike."""
    from meshserve.cluster.executors.channel_executor import ChannelExecutor, ThreadRanks
    from meshserve.cluster.executors.executor import WorkerSpec
    from meshserve.cluster.executors.multiproc import MultiprocExecutor
    from meshserve.cluster.executors.ray_executor import RayExecutor
    from meshserve.workers.step import StepOutput

    model_dir = tempfile.mkdtemp(prefix="bench-null-")
    cfg1 = engine_config(1, model_dir)
    worker = SilentNullWorker(cfg1.model, cfg1.cache)
    worker.start()
    runs = [Timed("in-process", 1, lambda p: StepOutput.from_msgpack(worker.execute_step(p.to_msgpack())),
                  args.seqs)]
    executors = [("thread rank, channel", 1,
                  ChannelExecutor(ThreadRanks(WorkerSpec(cfg1.model, cfg1.cache, worker_class=SILENT))))]
    executors += [("subprocess ranks, channel", tp,
                   MultiprocExecutor(engine_config(tp, model_dir), worker_class=SILENT)) for tp in (1, 2)]
    executors += [("Ray actors, channel", tp, RayExecutor(engine_config(tp, model_dir), worker_class=SILENT))
                  for tp in (1, 2)]
    try:
        for name, tp, executor in executors:
            executor.start()
            runs.append(Timed(name, tp, executor.execute_step, args.seqs, close=executor.shutdown))
        for tp in (1, 2):
            execute, close = ray_call_per_rank(engine_config(tp, model_dir))
            runs.append(Timed("Ray actors, call per rank", tp, execute, args.seqs, close=close))
        for run in runs:
            run.run(args.warmup, record=False)
        for _ in range(args.rounds):
            for run in runs:
                run.run(args.steps // args.rounds)
    finally:
        for run in runs:
            if run.close is not None:
                run.close()
        shutil.rmtree(model_dir, ignore_errors=True)
    rows = [(run.name, run.tp, statistics.median(run.times)) for run in runs]
    for name, tp, median in rows:
        print(f"{name:<28} tp={tp}  {median * 1e6:8.1f} µs/step", flush=True)
    return rows


def ray_call_per_rank(cfg):
    """The design the channel replaces: ray.get of one execute_step call per rank per step."""
    import ray

    @ray.remote(num_cpus=0)
    class Rank:
        def __init__(self, rank: int) -> None:
            # Independent tp=1 workers: only the call pattern is measured, not a collective.
            self.worker = SilentNullWorker(cfg.model, cfg.cache, rank=rank)
            self.worker.start()

        def execute_step(self, plan: bytes) -> bytes:
            return self.worker.execute_step(plan)

    actors = [Rank.remote(r) for r in range(cfg.parallel.tp)]

    def execute(plan) -> None:
        data = plan.to_msgpack()
        ray.get([a.execute_step.remote(data) for a in actors])

    def close() -> None:
        for a in actors:
            ray.kill(a)

    return execute, close


# -- part 2: serving ---------------------------------------------------------------------------------

def workload(args):
    """(arrival offset s, class, prompt ids) in arrival order; long prompts spread among short ones."""
    import random

    rng = random.Random(0)
    items = [("long", [rng.randrange(5, 4000) for _ in range(args.long_len)]) for _ in range(args.num_long)]
    items += [("short", [rng.randrange(5, 4000) for _ in range(args.short_len)]) for _ in range(args.num_short)]
    rng.shuffle(items)
    return [(i * args.interval, cls, prompt) for i, (cls, prompt) in enumerate(items)]


async def serve_load(mode: str, args) -> dict[str, list[tuple[float, float]]]:
    from meshserve.cluster.coordinator import ClusterConfig, Coordinator
    from meshserve.config import CacheConfig, ModelConfig, PoolConfig
    from meshserve.core.sampling_params import SamplingParams
    from meshserve.demo_model import DEMO_MODEL_DIR
    from meshserve.engine.engine_config import EngineConfig

    engine = EngineConfig(model=ModelConfig(model=str(DEMO_MODEL_DIR), dtype="float32"),
                          cache=CacheConfig(num_kv_blocks=512))
    pools = PoolConfig(mode=mode, replicas=2)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    async with Coordinator(ClusterConfig(engine=engine, pools=pools)) as c:
        async def one(i, offset, prompt):
            await asyncio.sleep(offset)
            t0 = time.perf_counter()
            stamps = []
            async for d in c.generate(prompt, params, request_id=f"{mode}-{i}"):
                stamps += [time.perf_counter()] * len(d.token_ids)
            return stamps[0] - t0, (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)

        load = workload(args)
        await asyncio.gather(*(one(i, 0.0, p) for i, (_, _, p) in enumerate(load[:2])))  # warm-up
        results = await asyncio.gather(*(one(i + 2, off, p) for i, (off, _, p) in enumerate(load)))
    return {cls: [r for r, (_, k, _) in zip(results, load) if k == cls] for cls in ("short", "long")}


def summarize(samples: dict[str, list[tuple[float, float]]], mode: str) -> dict[str, dict[str, float]]:
    """Mean and p90 of TTFT and TPOT per request class."""
    out = {}
    for cls, rows in samples.items():
        ttft, tpot = sorted(r[0] for r in rows), sorted(r[1] for r in rows)
        out[cls] = {"ttft_mean": statistics.mean(ttft), "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))],
                    "tpot_mean": statistics.mean(tpot), "tpot_p90": tpot[int(0.9 * (len(tpot) - 1))]}
        print(f"{mode:<14} {cls:<5} TTFT mean {out[cls]['ttft_mean'] * 1e3:7.1f} ms p90 "
              f"{out[cls]['ttft_p90'] * 1e3:7.1f} ms | TPOT mean {out[cls]['tpot_mean'] * 1e3:6.1f} ms p90 "
              f"{out[cls]['tpot_p90'] * 1e3:6.1f} ms", flush=True)
    return out


# -- report ------------------------------------------------------------------------------------------

def report(args, overhead, serving) -> str:
    base = next(m for name, _, m in overhead if name == "in-process")
    lines = [BEGIN, "## Cluster (CPU)", "",
             f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()} with {os.cpu_count()} cores "
             "(shared with other work: absolute times are loose), Ray "
             f"{__import__('ray').__version__}, with `python -m bench.cluster`.", "",
             f"Per-step executor cost: a decode step of {args.seqs} sequences (8-block tables) through each "
             f"executor to a worker that does no model work; median of {args.steps} steps, all executors "
             f"running side by side in {args.rounds} interleaved rounds.", "",
             "| executor | tp | µs / step | overhead over in-process, µs |", "| --- | ---: | ---: | ---: |"]
    for name, tp, median in overhead:
        lines.append(f"| {name} | {tp} | {median * 1e6:.0f} | {(median - base) * 1e6:.0f} |")
    lines += ["", f"Serving the demo model on Ray, two actors either way: {args.num_long} prompts of "
              f"{args.long_len} tokens among {args.num_short} of {args.short_len}, one every "
              f"{args.interval * 1e3:.0f} ms, {args.output_len} tokens each (greedy); {args.serving_rounds} "
              "rounds, the modes alternating.", "",
              "| pools | class | TTFT mean ms | TTFT p90 ms | TPOT mean ms | TPOT p90 ms |",
              "| --- | --- | ---: | ---: | ---: | ---: |"]
    for mode, by_class in serving.items():
        for cls, s in by_class.items():
            lines.append(f"| {mode} | {cls} | {s['ttft_mean'] * 1e3:.1f} | {s['ttft_p90'] * 1e3:.1f} | "
                         f"{s['tpot_mean'] * 1e3:.1f} | {s['tpot_p90'] * 1e3:.1f} |")
    lines.append(END)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000, help="timed steps per executor")
    ap.add_argument("--rounds", type=int, default=20, help="interleaved blocks the steps are split into")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--num-long", type=int, default=6)
    ap.add_argument("--num-short", type=int, default=18)
    ap.add_argument("--long-len", type=int, default=768)
    ap.add_argument("--short-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--interval", type=float, default=0.1, help="seconds between arrivals")
    ap.add_argument("--serving-rounds", type=int, default=2)
    ap.add_argument("--skip-serving", action="store_true")
    ap.add_argument("--write", type=Path, default=None, help="replace this bench's section of a markdown file")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from meshserve.cluster.executors.ray_executor import ray_init

    temp = tempfile.mkdtemp(prefix="msbench-", dir="/tmp")
    ray_init(num_cpus=2, temp_dir=temp)
    try:
        overhead = measure_overhead(args)
        samples: dict[str, dict[str, list]] = {}
        if not args.skip_serving:
            for _ in range(args.serving_rounds):  # alternate the modes: background load hits both
                for mode in ("unified", "disaggregated"):
                    for cls, rows in asyncio.run(serve_load(mode, args)).items():
                        samples.setdefault(mode, {}).setdefault(cls, []).extend(rows)
        serving = {mode: summarize(by_class, mode) for mode, by_class in samples.items()}
    finally:
        import ray

        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    section = report(args, overhead, serving)
    print(section)
    if args.write:
        write_section(args.write, section, BEGIN, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
