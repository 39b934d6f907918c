"""What one more front-end process of `meshserve serve --api-server-count N` costs: start-up and memory.

Starts the engine's process once (the demo model, as `serve --api-server-count 2` would), then
--rounds times starts one more front-end process exactly as serve's process 0 does
(api/api_servers.py's ApiServerGroup: settings, secret and session on its stdin) and measures:

- start-up: seconds from its spawn to its READY (its engine client connected, gRPC and HTTP
  bound; the engine already serves, so this is the front-end's own start);
- memory at READY: RSS, peak RSS (VmHWM) and PSS (proportional set size: shared pages, torch's
  libraries among them, divided among the processes mapping them) from /proc;
- whether torch is loaded in it (its libtorch mapped).

Then SIGTERM, and the next round. Prints a table (median and every round); JSON to --out.

    python -m bench.frontend_process --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import statistics
import time
from pathlib import Path

from meshserve.api.api_servers import ApiServerGroup, shared_metrics_dir
from meshserve.api.serve import default_model_name, engine_client
from meshserve.cli import build_parser
from meshserve.demo_model import DEMO_MODEL_DIR


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (from status) and Pss (from smaps_rollup) of `pid`, in KiB."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    out = {line.split(":")[0]: int(line.split()[1]) for line in status if line.startswith(("VmRSS", "VmHWM"))}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            out["Pss"] = int(line.split()[1])
    return out


def maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


async def measure(rounds: int, drain_s: float) -> list[dict]:
    args = build_parser("serve").parse_args(["serve", str(DEMO_MODEL_DIR), "--api-server-count", "2", "--port", "0",
                                             "--grpc-port", "0", "--dtype", "float32"])
    metrics_dir = shared_metrics_dir()
    model_name = default_model_name(args)
    client, _ = engine_client(args, model=str(DEMO_MODEL_DIR), model_name=model_name, metrics_dir=metrics_dir)
    settings = argparse.Namespace(**{**vars(args), "model": str(DEMO_MODEL_DIR), "model_tag": None, "revision": None})
    rows = []
    try:
        await client.start()
        for _ in range(rounds):
            group = ApiServerGroup(settings, count=2, engine=client.process, model_name=model_name,
                                   metrics_dir=metrics_dir)
            started = time.perf_counter()
            group.start(http_port=0, grpc_port=0)
            await group.wait_ready()
            ready_s = time.perf_counter() - started
            pid = group.pids[0]
            rows.append({"startup_s": ready_s, **memory_kib(pid), "torch_loaded": maps_torch(pid)})
            group.terminate()
            await group.wait(drain_s)
            for proc in group._procs:
                proc.stdout.close()
    finally:
        await client.shutdown()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="JSON with every round")
    opts = parser.parse_args()
    rows = asyncio.run(measure(opts.rounds, drain_s=5.0))
    med = {k: statistics.median(r[k] for r in rows) for k in ("startup_s", "VmRSS", "VmHWM", "Pss")}
    def spread(key: str, scale: float, digits: int) -> str:
        return " ".join(f"{r[key] / scale:.{digits}f}" for r in rows)

    print("| front-end process | median | rounds |")
    print("| --- | ---: | --- |")
    print(f"| start-up to serving, s | {med['startup_s']:.2f} | {spread('startup_s', 1, 2)} |")
    for key, name in (("VmRSS", "RSS at serving"), ("VmHWM", "peak RSS"), ("Pss", "PSS at serving")):
        print(f"| {name}, MiB | {med[key] / 1024:.0f} | {spread(key, 1024, 0)} |")
    print(f"torch loaded in the front-end process: {sorted({r['torch_loaded'] for r in rows})}")
    if opts.out:
        opts.out.write_text(json.dumps({"machine": platform.node(), "rounds": rows, "median": med}, indent=1))


if __name__ == "__main__":
    main()
