"""The CPU thread matrix: `bench/e2e.py --device cpu` (meshserve against HF transformers) under
several OpenMP settings, one subprocess per run, configurations alternating, medians per cell.

Each configuration is a set of environment variables given to a fresh process (OpenMP reads
OMP_WAIT_POLICY / GOMP_SPINCOUNT when torch is imported, so they cannot change inside a process).
The HF reference of the ratios is HF as a plain `pip install transformers` user runs it (`default`:
torch's own thread count and wait policy). The load average before and after each run is kept
beside its numbers.

    python -m bench.cpu_threads --repeats 3 --out bench/results
    python -m bench.cpu_threads --configs t1,t2 --batch-sizes 1,16 --repeats 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# name -> (what it is, the environment it adds). "default" sets nothing: meshserve's LLM picks its
# thread count (meshserve/core/cpu_threads.py), HF runs at torch's own, both with libgomp's default
# wait policy; the others pin both engines with OMP_NUM_THREADS.
CONFIGS = {
    "default": ("no variable set: meshserve's choice, HF at torch's", {}),
    "t1": ("1 thread", {"OMP_NUM_THREADS": "1"}),
    "t2": ("2 threads, libgomp's default wait policy", {"OMP_NUM_THREADS": "2"}),
    "t2-passive": ("2 threads, OMP_WAIT_POLICY=PASSIVE", {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}),
    "t2-spin10k": ("2 threads, GOMP_SPINCOUNT=10000", {"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "10000"}),
}
OMP_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS", "MESHSERVE_CPU_THREADS")


def one_run(name: str, args: argparse.Namespace) -> dict:
    """One bench/e2e.py --device cpu process (one round) under configuration `name`."""
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARS}
    env.update(CONFIGS[name][1], HF_HUB_OFFLINE="1")
    with tempfile.TemporaryDirectory(prefix="meshserve-cpu-threads-") as out:
        load = os.getloadavg()[0]
        cmd = [sys.executable, "-m", "bench.e2e", "--device", "cpu", "--rounds", "1", "--batch-sizes",
               args.batch_sizes, "--out", out]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        res = json.loads(Path(out, "e2e-cpu.json").read_text())
    rd = res["rounds"][0]
    run = {"config": name, "threads": res["threads"], "env": res.get("omp_env", {}), "load": [load, os.getloadavg()[0]],
           "meshserve": {int(b): v for b, v in rd["meshserve"].items()},
           "hf": {int(b): v for b, v in rd["hf"].items()}}
    threads = f"{run['threads']['meshserve']}/{run['threads']['hf']}"
    print(f"{name:<11} threads {threads} load {load:.1f}->{run['load'][1]:.1f}  "
          + "  ".join(f"bs{b}: {run['meshserve'][b]:.0f}/{run['hf'][b]:.0f}" for b in run["meshserve"]), flush=True)
    return run


def table(runs: list[dict], configs: list[str], batch_sizes: list[int]) -> str:
    def med(name: str, engine: str, bs: int) -> float:
        return statistics.median(r[engine][bs] for r in runs if r["config"] == name)

    ref = "default" if "default" in configs else configs[0]
    loads = [x for r in runs for x in r["load"]]
    lines = [f"Median of {len(runs) // len(configs)} runs per configuration, alternating; load average "
             f"{min(loads):.1f} to {max(loads):.1f}; ratios against HF under `{ref}`.", "",
             "| configuration | " + " | ".join(f"bs {b}: meshserve / HF (/ HF {ref})" for b in batch_sizes) + " |",
             "| --- |" + " ---: |" * len(batch_sizes)]
    for name in configs:
        cells = [f"{med(name, 'meshserve', b):.0f} / {med(name, 'hf', b):.0f} "
                 f"({med(name, 'meshserve', b) / med(ref, 'hf', b):.2f}x)" for b in batch_sizes]
        lines.append(f"| {name}: {CONFIGS[name][0]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="default,t2,t2-passive", help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--repeats", type=int, default=3, help="runs per configuration")
    ap.add_argument("--out", default=None, help="folder for cpu-threads.json")
    args = ap.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            ap.error(f"--configs: unknown configuration {c!r}; choose from {', '.join(CONFIGS)}")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    runs = [one_run(name, args) for _ in range(args.repeats) for name in configs]
    text = table(runs, configs, batch_sizes)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "cpu-threads.json").write_text(json.dumps(
            {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
             "command": "python -m bench.cpu_threads " + " ".join(sys.argv[1:]), "runs": runs, "table": text},
            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
