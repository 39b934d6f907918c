"""Overlap scheduling through the step channel, on CPU: decode TPOT with the driver's host work and the
channel round trip serial with the step, and hidden behind it.

A replica of tp=1 whose rank runs a worker that does no model work but holds a simulated device:
a submitted step is "on the device" for --device-ms after the step before it ends (the rank's host
is free meanwhile, as with CUDA kernels queued), and `collect` waits for it. Without overlap a step
costs device + channel round trip + the driver's schedule and outputs; with overlap (the
scheduler's async_scheduling=True, what a CUDA rank gets by default) the driver plans step N+1 while
step N "runs", so a step costs max(device, host + channel). Ranks on a thread and in a subprocess;
a batch of --seqs requests decoding --tokens tokens each; TPOT = wall time / decode steps.

    PYTHONPATH=. python -m bench.channel_overlap                  # prints a table
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.simulated_device import DEVICE_ENV, WORKER  # noqa: E402


def decode_tpot(runtime: str, overlap: bool, args, model_dir: str) -> float:
    """Seconds per decode step of a batch of args.seqs requests."""
    from meshserve.cluster.executors.channel_executor import ChannelExecutor, ThreadRanks
    from meshserve.cluster.executors.executor import WorkerSpec
    from meshserve.cluster.executors.multiproc import MultiprocExecutor
    from meshserve.config import CacheConfig, ModelConfig, SchedulerConfig
    from meshserve.core.sampling_params import SamplingParams
    from meshserve.engine.engine_config import EngineConfig
    from meshserve.engine.engine_core import EngineCore

    cfg = EngineConfig(model=ModelConfig(model=model_dir), cache=CacheConfig(num_kv_blocks=1024),
                       scheduler=SchedulerConfig(async_scheduling=overlap))
    if runtime == "thread":
        executor = ChannelExecutor(ThreadRanks(WorkerSpec(cfg.model, cfg.cache, cfg.attention, cfg.parallel,
                                                          "cpu", WORKER)))
    else:
        executor = MultiprocExecutor(cfg, worker_class=WORKER, device="cpu")
    core = EngineCore(cfg, executor=executor)
    try:
        assert core.overlap == overlap
        params = SamplingParams(temperature=0, max_tokens=args.tokens)
        for i in range(args.seqs):
            core.add_request([1 + i, 2, 3, 4], params, request_id=f"r{i}")
        first: float | None = None
        steps = 0
        while core.has_unfinished():
            deltas = core.step()
            if deltas and first is None:
                first = time.perf_counter()  # every request's first token: decoding from here on
            elif first is not None:
                steps += 1
        return (time.perf_counter() - first) / steps
    finally:
        core.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device-ms", type=float, default=5.0, help="simulated device time of one step")
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=200, help="tokens each request decodes")
    ap.add_argument("--repeats", type=int, default=3, help="runs per row (median)")
    args = ap.parse_args(argv)
    os.environ[DEVICE_ENV] = str(args.device_ms)
    model_dir = tempfile.mkdtemp(prefix="msbench-overlap-")  # NullWorker reads nothing from it
    rows = []
    for runtime in ("thread", "subprocess"):
        times = {False: [], True: []}
        for _ in range(args.repeats):  # interleaved: background load hits both alike
            for overlap in (False, True):
                times[overlap].append(decode_tpot(runtime, overlap, args, model_dir))
        off, on = statistics.median(times[False]), statistics.median(times[True])
        rows.append(f"| {runtime} rank | {args.device_ms:g} | {off * 1e3:.2f} | {on * 1e3:.2f} | "
                    f"{(off - args.device_ms / 1e3) * 1e3:.2f} | {(on - args.device_ms / 1e3) * 1e3:.2f} |")
    print(f"decode of {args.seqs} requests x {args.tokens} tokens, tp=1, median of {args.repeats} runs")
    print("| rank | device ms / step | TPOT, no overlap, ms | TPOT, overlap, ms | "
          "not hidden, no overlap, ms | not hidden, overlap, ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
