"""Start-up of `meshserve serve` (what `make run` runs): from launching the process to gRPC health
SERVING, for one or more checkouts side by side (the same interpreter, alternating runs).

Also the CPU seconds the server process used by then (less sensitive than wall time to other
jobs on a shared machine). Prints a table and writes a PNG (one bar per checkout, min to median).

    python -m bench.serve_startup                                   # this checkout, 5 runs
    python -m bench.serve_startup --roots . ../main --runs 5 --png /tmp/startup.png
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICE = "meshserve.v1.Inference"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_once(root: str, *, timeout_s: float = 120.0) -> tuple[float, float]:
    """(wall seconds to SERVING, CPU seconds of the server by then) for the checkout at `root`."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.path.abspath(root))
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as an installed package: bytecode cached
    t0 = time.monotonic()
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "meshserve.cli", "serve", "--grpc-port", str(port),
                             "--port", "0"], cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=log)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        while time.monotonic() - t0 < timeout_s:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=0.5)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return time.monotonic() - t0, _cpu_seconds(proc.pid)
            except grpc.RpcError:
                pass
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"meshserve serve in {root} exited with {proc.returncode} before serving: "
                                   f"{log.read()[-2000:].decode(errors='replace')}")
            time.sleep(0.02)
        raise RuntimeError(f"not SERVING within {timeout_s} s")
    finally:
        channel.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--roots", nargs="+", default=["."], help="checkouts to compare")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--png", default="serve_startup.png")
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float]]] = {root: [] for root in args.roots}
    for _ in range(args.runs):
        for root in args.roots:  # alternate, so that load from other jobs falls on every checkout alike
            results[root].append(start_once(root))
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print("| checkout | wall median (s) | wall min (s) | server CPU median (s) |\n| --- | --- | --- | --- |")
    for root, rows in results.items():
        walls, cpus = [w for w, _ in rows], [c for _, c in rows]
        print(f"| {root} | {statistics.median(walls):.2f} | {min(walls):.2f} | {statistics.median(cpus):.2f} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    names = list(results)
    medians = [statistics.median(w for w, _ in results[r]) for r in names]
    mins = [min(w for w, _ in results[r]) for r in names]
    ax.bar(names, medians, color="#4c72b0", label="median")
    ax.scatter(names, mins, color="black", zorder=3, label="min")
    ax.axhline(5.0, color="red", linestyle="--", label="target 5 s")
    ax.set_ylabel("seconds to SERVING")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
