"""How fast the host of a device call runs host-side work, so that host-bound timings (a KV pull's
steps, served latency hops, a step's launches) compare across calls only where the probe agrees.

On 2026-12-06 two calls a few hours apart got H100s whose hosts ran the same unchanged host code
1.4-2x apart (the KV pull's `offer` step: 64 against 127 us at 1k tokens); nothing in the
results said so. This probe times fixed pieces of the kinds of host work our benches measure,
each the median of several runs in this process, and reads the load average and the CPU model:

- python: a pure-Python loop (interpreter speed, the scheduler's and the front-end's kind of work)
- msgpack: pack + unpack of a 32k-token hand-over header's shape (2,048 blocks of hashes and ids)
- hmac: HMAC-SHA256 over 64 KiB (the step channel's and the KV offer's MACs)
- numpy: a few array passes over 2,048-element int64 arrays (the pull's index work)

    python -m bench.host_probe [--out FILE]          # prints one line, writes JSON if --out
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import statistics
import time
from pathlib import Path

import msgpack
import numpy as np

from bench.cpu_machine import cpu_identity

REPEATS = 7


def _median_us(fn, inner: int) -> float:
    runs = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        runs.append((time.perf_counter() - t) / inner * 1e6)
    return statistics.median(runs)


def _python_loop() -> int:
    total = 0
    for i in range(20_000):
        total += i & 7
    return total


def probe() -> dict[str, object]:
    """The probe's timings (us, medians) with the load average before and after and the CPU."""
    load_before = os.getloadavg()
    header = {"block_hashes": [[(i * 2654435761) & 0xFFFFFFFFFFFF, i] for i in range(2048)],
              "block_ids": list(range(2048)), "num_tokens": 32_768}
    key, blob = b"k" * 32, os.urandom(64 << 10)
    ids = np.arange(2048, dtype=np.int64)
    rng = np.random.default_rng(0)
    perm = rng.permutation(2048)

    def numpy_passes() -> None:
        runs = np.flatnonzero(np.diff(ids[perm]) != 1)
        np.cumsum(ids, out=np.empty_like(ids))
        np.take(ids, perm) * 16 + runs.size

    timings = {
        "python_us": _median_us(_python_loop, 20),
        "msgpack_us": _median_us(lambda: msgpack.unpackb(msgpack.packb(header)), 20),
        "hmac_us": _median_us(lambda: hmac.new(key, blob, hashlib.sha256).digest(), 50),
        "numpy_us": _median_us(numpy_passes, 200),
    }
    return {**{k: round(v, 1) for k, v in timings.items()}, "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(), "cpu": cpu_identity()}


def summary(result: dict[str, object]) -> str:
    return (f"host probe: python {result['python_us']} us, msgpack {result['msgpack_us']} us, "
            f"hmac {result['hmac_us']} us, numpy {result['numpy_us']} us; load {result['load_before']} -> "
            f"{result['load_after']}; {result['cpus']} CPUs, {result['cpu']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the probe's JSON here")
    args = ap.parse_args()
    result = probe()
    print(summary(result))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
