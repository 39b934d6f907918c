"""KV hand-over bandwidth per transport vs a copy of the same bytes, measured in the same run.

    python bench/kv_handover.py                    # CUDA when present (zmq, cuda_ipc), else CPU (zmq, nccl/gloo)
    python bench/kv_handover.py --device cpu --sizes 1024,8192
    python bench/kv_handover.py --exporter-gpu 1 --transports nccl,cuda_ipc,zmq   # two GPUs

An exporter process (this script, --exporter) holds one request per size in a Llama-3-8B-shaped
cache (32 layers, 8 KV heads of 128, block 16, bf16: 128 KiB per token, contiguous blocks) and
offers it under a fresh capability per pull. This process pulls each offer into fresh blocks of
its own cache of the same shape, as a decode rank does (transport.puller_for: header, checksum
over every frame, reservation and commit included; the request is freed after each pull) and
copies the same number of bytes within its device (torch copy_, CUDA events on a GPU). Reported:
medians over --reps pulls after one warm-up pull (the first pull's time, which opens the CUDA IPC
mappings, is listed as cold_ms), GB/s = KV bytes / time, and the ratio to the copy (target >= 0.5).
Prints a table, writes a PNG and a JSON (bench/results/).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import select
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from meshserve.attention.spec import AttentionSpec  # noqa: E402
from meshserve.core.secret import ClusterSecret  # noqa: E402
from meshserve.kvstore.cache_tensors import allocate_caches  # noqa: E402
from meshserve.kvstore.connector import KVConnector  # noqa: E402
from meshserve.kvstore.manager import KVCacheManager  # noqa: E402
from meshserve.kvstore.rank_io import frame_bytes_for  # noqa: E402
from meshserve.kvstore.transport import Endpoint, puller_for  # noqa: E402

LAYERS, KV_HEADS, HEAD, BLOCK = 32, 8, 128, 16
TOKEN_BYTES = LAYERS * 2 * KV_HEADS * HEAD * 2  # bf16 K and V of every layer
SECRET = ClusterSecret(b"the kv hand-over bench's own secret")


def replica(num_tokens: int, device: str, *, seed: int) -> tuple[KVCacheManager, KVConnector]:
    """A manager and a cache with room for `num_tokens` tokens, random bytes (never zeros)."""
    num_blocks = -(-num_tokens // BLOCK) + 4
    specs = [AttentionSpec(num_heads=32, num_kv_heads=KV_HEADS, head_size=HEAD)] * LAYERS
    caches = allocate_caches(specs, num_blocks=num_blocks, block_size=BLOCK, dtype="bfloat16", device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for c in caches:
        raw = c.data.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8, device=device))
    kv = KVCacheManager(num_blocks, BLOCK)
    return kv, KVConnector(kv, caches, model_id="llama-3-8b-shape")


def capability(transport: str, size: int, i: int) -> str:
    return f"kv-bench-{transport}-{size}-{i:03d}"  # both processes are this script


def exporter() -> None:
    """Offer one request per size, once per (transport, pull), until stdin closes."""
    from meshserve.kvstore.rank_io import KVExport
    from meshserve.kvstore.zmq_transport import KVExportServer

    cfg = json.loads(sys.stdin.readline())
    device, sizes = cfg["device"], cfg["sizes"]
    kv, conn = replica(sum(sizes), device, seed=1)
    server = KVExportServer(SECRET)
    export_ms = {}
    for size in sizes:
        kv.allocate_slots(f"r{size}", size, list(range(size, 2 * size)))  # no prefix shared between sizes
        t0 = time.perf_counter()
        export = conn.export(f"r{size}", max_frame_bytes=frame_bytes_for(torch.device(device)))
        export_ms[size] = (time.perf_counter() - t0) * 1e3  # pin + checksum: the prefill side's cost
        for transport in cfg["transports"]:
            for i in range(cfg["reps"] + 1):
                server.offer(KVExport(export.header, export.frames), capability=capability(transport, size, i),
                             ttl_s=3600)
    print(json.dumps({"endpoint": Endpoint.local(server.address, torch.device(device)).to_wire(),
                      "export_ms": export_ms}), flush=True)
    while True:
        server.poll(20)
        if select.select([sys.stdin], [], [], 0)[0] and not sys.stdin.readline():
            break
    server.close()


def copy_seconds(nbytes: int, device: str, reps: int) -> float:
    """Median seconds of copying `nbytes` within the device (the ceiling a transport is held to)."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 1):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def make_puller(transport: str):
    """A transport's puller; "cuda_ipc-noverify": cuda_ipc without the importer's checksum."""
    if transport != "cuda_ipc-noverify":
        return puller_for(transport)
    from meshserve.kvstore.cuda_ipc import IpcImporter
    from meshserve.kvstore.transport import CudaIpcPuller

    puller = CudaIpcPuller()
    puller.importer = IpcImporter(verify=False)
    return puller


def run(args) -> list[dict]:
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--exporter"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                filter(None, [ROOT, os.environ.get("PYTHONPATH")]))})  # keep the caller's path
    where = f"cuda:{args.exporter_gpu}" if args.device == "cuda" else "cpu"
    proc.stdin.write(json.dumps({"device": where, "sizes": args.sizes, "reps": args.reps,
                                 "transports": args.transports}) + "\n")
    proc.stdin.flush()
    info = json.loads(proc.stdout.readline())
    endpoint = Endpoint.from_wire(info["endpoint"])
    rows = []
    try:
        kv, conn = replica(max(args.sizes), args.device, seed=2)
        for size in args.sizes:
            nbytes = size * TOKEN_BYTES
            copy_s = copy_seconds(nbytes, args.device, args.reps)
            for transport in args.transports:
                puller, times = make_puller(transport), []
                for i in range(args.reps + 1):
                    profiled = args.profile and i == args.reps and size == min(args.sizes)
                    profiler = cProfile.Profile() if profiled else None
                    t0 = time.perf_counter()
                    if profiler is not None:
                        profiler.enable()
                    puller.pull(conn, endpoint, capability(transport, size, i), secret=SECRET, timeout_s=600)
                    times.append(time.perf_counter() - t0)
                    if profiler is not None:
                        profiler.disable()
                        print(f"--- profile of one {size}-token pull over {transport} ---")
                        pstats.Stats(profiler).sort_stats("cumulative").print_stats(14)
                    kv.free(f"r{size}", keep_cache=False)
                pull_s = statistics.median(times[1:])
                rows.append({"tokens": size, "mib": nbytes / 2**20, "transport": transport, "cold_ms": times[0] * 1e3,
                             "pull_ms": pull_s * 1e3, "pull_gb_s": nbytes / pull_s / 1e9, "copy_ms": copy_s * 1e3,
                             "copy_gb_s": nbytes / copy_s / 1e9, "ratio": copy_s / pull_s,
                             "export_ms": info["export_ms"][str(size)]})
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    return rows


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["tokens"] for r in rows})
    transports = sorted({r["transport"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / (len(transports) + 1)
    for k, name in enumerate([*transports, "device copy"]):
        vals = [next(r["copy_gb_s"] if name == "device copy" else r["pull_gb_s"] for r in rows
                     if r["tokens"] == s and (name == "device copy" or r["transport"] == name)) for s in sizes]
        ax.bar([i + k * width for i in range(len(sizes))], vals, width, label=name)
    ax.set_xticks([i + width * len(transports) / 2 for i in range(len(sizes))], [_tokens(s) for s in sizes])
    ax.set_ylabel("GB/s (KV bytes / time)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _tokens(n: int) -> str:
    return f"{n // 1024}k tokens" if n % 1024 == 0 else f"{n} tokens"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", default=None, help="request sizes in tokens (default: 1024,8192,32768 on CUDA, "
                        "1024,8192 on CPU)")
    parser.add_argument("--transports", default=None, help="default: zmq,cuda_ipc,cuda_ipc-noverify on CUDA (the "
                        "last without the importer's checksum), zmq,nccl on CPU (nccl runs over gloo there)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="cProfile the last pull of the smallest size per "
                        "transport (the profiled pull is timed too: its row is slower)")
    parser.add_argument("--exporter-gpu", type=int, default=0, help="the exporter's GPU (nccl needs another one "
                        "than this process's cuda:0: --exporter-gpu 1 --transports nccl,cuda_ipc,zmq)")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument("--exporter", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.exporter:
        return exporter()
    cuda = args.device == "cuda"
    args.sizes = [int(s) for s in (args.sizes or ("1024,8192,32768" if cuda else "1024,8192")).split(",")]
    args.transports = (args.transports or ("zmq,cuda_ipc,cuda_ipc-noverify" if cuda else "zmq,nccl")).split(",")
    rows = run(args)
    where = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores)"
    print(f"KV hand-over, Llama-3-8B shape (32 layers, 8 KV heads x 128, bf16, block 16) on {where}")
    print(f"{'tokens':>7} {'MiB':>7} {'transport':>17} {'cold ms':>8} {'pull ms':>8} {'GB/s':>7} "
          f"{'copy GB/s':>9} {'ratio':>6} {'export ms':>9}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['mib']:>7.0f} {r['transport']:>17} {r['cold_ms']:>8.1f} {r['pull_ms']:>8.2f} "
              f"{r['pull_gb_s']:>7.3g} {r['copy_gb_s']:>9.4g} {r['ratio']:>6.3f} {r['export_ms']:>9.1f}")
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"kv_handover-{args.device}")
    with open(stem + ".json", "w") as f:
        json.dump({"device": where, "rows": rows}, f, indent=1)
    plot(rows, stem + ".png", f"KV hand-over vs device copy ({where})")
    print(f"wrote {stem}.json and {stem}.png")


if __name__ == "__main__":
    main()
