"""KV hand-over bandwidth per transport vs a copy of the same bytes, measured in the same run.

    python bench/kv_handover.py                    # CUDA when present (zmq, cuda_ipc, cuda_ipc-verify), else CPU
    python bench/kv_handover.py --device cpu --sizes 1024,8192
    python bench/kv_handover.py --exporter-gpu 1 --transports nixl,cuda_ipc,zmq   # two GPUs
    python bench/kv_handover.py --phases           # and each step of a warm pull, median us per step
    python bench/kv_handover.py --offer --device cpu --shape demo --sizes 1024,32768   # the prefill side

An exporter process (this script, --exporter) holds one request per size in a Llama-3-8B-shaped
cache (32 layers, 8 KV heads of 128, block 16, bf16: 128 KiB per token, contiguous blocks) and
offers it under a fresh capability per pull. This process pulls each offer into fresh blocks of
its own cache of the same shape, as a decode rank does (transport.puller_for: header, layout
check, reservation and commit included; the request is freed after each pull) and copies the
same number of bytes within its device (torch copy_, CUDA events on a GPU).

Two measurements, side by side:
  single     one pull at a time: medians over --reps pulls after one warm-up pull (the first
             pull's time, which opens the CUDA IPC mappings, is listed as cold_ms).
  pipelined  a burst of N requests handed over back to back, as a decode replica receiving a
             burst does it: one thread per pull started together (kvtransfer/transfers.py's
             BackgroundPulls), into blocks reserved beforehand (as the driver reserves them);
             wall time from the first start to the last finish, median of --burst-reps bursts
             after a warm-up burst. N = --burst, fewer where N requests would pass
             --burst-gib of receiving cache (the size is shown).
GB/s = KV bytes / time, ratio = that / the device copy's GB/s (target >= 0.5). Transports:
zmq, nixl (a NIXL READ of the exporter's registered cache, no checksum: its default), nixl-verify,
cuda_ipc (device to device, no checksum: its default), cuda_ipc-verify (the same with the
checksum over the copied bytes), cuda_ipc-memcpy (a memcpy per frame instead of one batched
launch for pulls up to cuda_ipc.BATCH_BYTES). --phases: each step of every warm single pull
(kvtransfer/pull_phases.py), medians in us, printed after the tables. --shape demo: the bundled
demo model's cache (3 KiB a token: a 1k-token hand-over is the transport's fixed cost per pull).
Prints both tables, writes a PNG and a JSON (bench/results/).

The exporter exports without the checksum, as a rank does unless the deployment verifies direct
pulls (kv_verify_checksum): a zmq pull's time includes the exporter computing it when it answers
(export_server.py), a -verify pull's offer had it computed first. --offer times the prefill
rank's side instead, in this process: `KVRankAgent.offer` (export, the checksum where the setting
computes it, the offer and its direct offer) per size, for kv_transport auto (NIXL) with
kv_verify_checksum off and on, and zmq; medians of --reps offers after a warm one.
"""

from __future__ import annotations

import argparse
import base64
import cProfile
import dataclasses
import json
import os
import pstats
import select
import statistics
import subprocess
import sys
import threading
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from meshserve.attention.spec import AttentionSpec  # noqa: E402
from meshserve.core.secret import ClusterSecret  # noqa: E402
from meshserve.kvstore.cache_tensors import allocate_caches  # noqa: E402
from meshserve.kvstore.manager import KVCacheManager  # noqa: E402
from meshserve.kvtransfer.rank_io import frame_bytes_for  # noqa: E402
from meshserve.kvtransfer.transport import Endpoint, puller_for  # noqa: E402
from tests.kv_connector import KVConnector  # noqa: E402

BLOCK = 16
# (layers, KV heads, head size) of the cache shapes: Llama-3-8B (128 KiB a token), the bundled
# demo model (meshserve/demo_model: 3 KiB a token, so a 1k-token hand-over is all fixed cost), and
# Llama-3-8B's blocks with one KV head (16 KiB a token): the same layers and blocks, so the same
# host work per pull, in an eighth of the memory (a 2-core CPU machine can hold 32k tokens of it).
SHAPES = {"llama3-8b": (32, 8, 128), "demo": (6, 2, 64), "llama3-8b-1kv": (32, 1, 128)}


def token_bytes(shape: str) -> int:
    layers, kv_heads, head = SHAPES[shape]
    return layers * 2 * kv_heads * head * 2  # bf16 K and V of every layer
SECRET = ClusterSecret(b"the kv hand-over bench's own secret")
_importer = None  # this process's NixlAgent (made at the first nixl pull)


def replica(num_tokens: int, device: str, *, seed: int, shape: str) -> tuple[KVCacheManager, KVConnector]:
    """A manager and a cache with room for `num_tokens` tokens, random bytes (never zeros)."""
    num_blocks = -(-num_tokens // BLOCK) + 4
    layers, kv_heads, head = SHAPES[shape]
    specs = [AttentionSpec(num_heads=4 * kv_heads, num_kv_heads=kv_heads, head_size=head)] * layers
    caches = allocate_caches(specs, num_blocks=num_blocks, block_size=BLOCK, dtype="bfloat16", device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for c in caches:
        raw = c.data.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8, device=device))
    kv = KVCacheManager(num_blocks, BLOCK)
    return kv, KVConnector(kv, caches, model_id="llama-3-8b-shape")


def capability(transport: str, size: int, i: int) -> str:
    return f"kv-bench-{transport}-{size}-{i:03d}"  # both processes are this script


def burst_sizes(args) -> dict[int, int]:
    """Requests per burst for each size: --burst, fewer where they would pass --burst-gib."""
    cap = int(args.burst_gib * 2**30)
    return {s: max(1, min(args.burst, cap // (s * token_bytes(args.shape)))) for s in args.sizes}


def exporter() -> None:
    """Offer one request per size, once per (transport, pull) and per (burst transport, burst,
    request of the burst), until stdin closes."""
    from meshserve.kvtransfer.export_server import KVExportServer
    from meshserve.kvtransfer.rank_io import KVExport

    cfg = json.loads(sys.stdin.readline())
    device, sizes = cfg["device"], cfg["sizes"]
    kv, conn = replica(sum(sizes), device, seed=1, shape=cfg["shape"])
    agent, nixl_error = None, ""
    if any(t.startswith("nixl") for t in cfg["transports"] + cfg["burst_transports"]):
        from meshserve.kvtransfer.nixl_agent import NixlAgent

        try:
            agent = NixlAgent("kv-bench-exporter")  # registers the cache once, as a rank does at start-up
            agent.register([c.data for c in conn.io.caches])
        except Exception as exc:  # not installed, or no UCX transport: the nixl rows say so
            agent, nixl_error = None, f"the exporter's NIXL agent: {exc}"
    server = KVExportServer(SECRET, nixl=agent)
    export_ms, direct_offers = {}, {}
    for size in sizes:
        kv.allocate_slots(f"r{size}", size, list(range(size, 2 * size)))  # no prefix shared between sizes
        t0 = time.perf_counter()
        frame_bytes = int(cfg["frame_mib"] * 2**20) if cfg.get("frame_mib") else frame_bytes_for(torch.device(device))
        export = conn.export(f"r{size}", max_frame_bytes=frame_bytes, checksum=False)
        export_ms[size] = (time.perf_counter() - t0) * 1e3  # pin + frame plan and views, no checksum
        caps = [capability(t, size, i) for t in cfg["transports"] for i in range(cfg["reps"] + 1)]
        caps += [capability(f"{t}-burst", size, i) for t in cfg["burst_transports"]
                 for i in range((cfg["burst_reps"] + 1) * cfg["burst"][str(size)])]
        for cap in caps:
            offered = KVExport(export.header, export.frames)
            if "-verify" in cap:  # a deployment that verifies direct pulls: the offer carries the checksum
                offered.ensure_checksum()
            server.offer(offered, capability=cap, ttl_s=3600)
            if cap.startswith(("kv-bench-nixl", "kv-bench-cuda_ipc")):  # what travels with a rank's offer
                direct_offers[cap] = base64.b64encode(server.describe_direct(offered, [cap])).decode()
    endpoint = Endpoint.local(server.address, torch.device(device), nixl=agent is not None)
    print(json.dumps({"endpoint": endpoint.to_wire(), "export_ms": export_ms, "direct_offers": direct_offers,
                      "nixl_error": nixl_error}), flush=True)
    while True:
        server.poll(1)  # as a rank's loop while an offer is pending (its NIXL agent progresses here)
        if select.select([sys.stdin], [], [], 0)[0] and not sys.stdin.readline():
            break
    server.close()


def offer_times(args) -> list[dict]:
    """--offer: milliseconds of KVRankAgent.offer per size and setting (module docstring), in this
    process; every offer of a size offers the same pinned blocks under a fresh capability. Runs on
    a tree whose KVRankAgent has no verify_checksum too (the checksum then always computed)."""
    import inspect

    from meshserve.kvtransfer.pins import KVPins
    from meshserve.kvtransfer.rank_agent import KVRankAgent, RankCaches

    kv_heads = SHAPES[args.shape][1]
    kv, conn = replica(sum(args.sizes), args.device, seed=1, shape=args.shape)
    pins, wires = KVPins(kv), {}
    for size in args.sizes:
        kv.allocate_slots(f"r{size}", size, list(range(size, 2 * size)))
        wires[size] = pins.pin(f"r{size}").blocks.to_wire()
    can_verify = "verify_checksum" in inspect.signature(KVRankAgent).parameters
    rows = []
    for transport, verify in (("auto", False), ("auto", True), ("zmq", False)):
        if not can_verify and verify:
            continue
        setting_kw = {"verify_checksum": verify} if can_verify else {}
        agent = KVRankAgent(RankCaches(conn.io.layer_caches, tuple(kv.retentions), 1, 1, kv_heads), rank=0,
                            kv_transport=transport, secret=SECRET, **setting_kw)
        agent.start_nixl()
        setting = f"{transport}, verify {'on' if verify else 'off'}" if can_verify else f"{transport} (checksum always)"
        for size in args.sizes:
            times = []
            for i in range(args.reps + 1):
                t0 = time.perf_counter()
                agent.offer(wires[size], f"kv-bench-offer-{transport}-{verify}-{size}-{i:04d}", BLOCK, 1,
                            "llama-3-8b-shape", 1)
                times.append((time.perf_counter() - t0) * 1e3)
                agent.poll(0)
            rows.append({"setting": setting, "tokens": size, "nixl": agent.nixl is not None,
                         "offer_ms": statistics.median(times[1:]), "min_ms": min(times[1:]), "cold_ms": times[0]})
            print(f"  {setting} {size} tokens: {rows[-1]['offer_ms']:.2f} ms", file=sys.stderr, flush=True)
        agent.close()
    return rows


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


def make_puller(transport: str, conn):
    """A transport's puller: "cuda_ipc" and "nixl" as the pools use them (no checksum over the
    transport's copy), "cuda_ipc-verify" and "nixl-verify" with the checksum ("cuda_ipc-noverify":
    the older name of cuda_ipc), "cuda_ipc-memcpy" with a memcpy per frame at every size (no
    batched launch: what cuda_ipc did before). A nixl puller's agent registers the receiving cache
    first, as a rank does at start-up."""
    from meshserve.kvtransfer.transport import CudaIpcPuller

    if transport in ("nixl", "nixl-verify"):
        from meshserve.kvtransfer.nixl_agent import NixlAgent
        from meshserve.kvtransfer.nixl_transport import NixlPuller

        global _importer
        if _importer is None:
            _importer = NixlAgent("kv-bench-importer")
            _importer.register([c.data for c in conn.io.caches])
        return NixlPuller(_importer, verify=transport == "nixl-verify")
    if transport in ("cuda_ipc", "cuda_ipc-noverify"):
        return CudaIpcPuller()
    if transport == "cuda_ipc-verify":
        return CudaIpcPuller(verify=True)
    if transport == "cuda_ipc-memcpy":
        puller = CudaIpcPuller()
        puller.importer.batch_bytes = 0
        return puller
    return puller_for(transport)


def missing(transport: str, args, info: dict) -> str:
    """Why `transport` cannot run here ("" when it can): its row is skipped with this reason."""
    if transport.startswith("nixl"):
        from meshserve.kvtransfer.nixl_agent import nixl_available

        if not nixl_available():
            return "NIXL is not installed (pip install nixl-cu13; bench/repack_nixl.py for a device call)"
        return info.get("nixl_error", "")
    if transport.startswith("cuda_ipc") and args.device != "cuda":
        return "CUDA IPC needs CUDA caches"
    return ""


def single_pulls(args, conn, kv, endpoint, size: int, transport: str, moved_by: set,
                 steps: list[dict[str, float]]) -> list[float]:  # fmt: skip
    """Seconds of each pull (the first one cold), one at a time; moved_by gets the transports that
    moved the bytes (a nixl pull falls back to zmq where the exporter could not describe them);
    with --phases, steps gets each warm pull's seconds per step (kvtransfer/pull_phases.py)."""
    from meshserve.kvtransfer.pull_phases import UNTIMED, PullPhases

    puller, times = make_puller(transport, conn), []
    for i in range(args.reps + 1):
        phases = PullPhases() if args.phases and i > 0 else UNTIMED
        profiled = args.profile and i == args.reps and size == min(args.sizes)
        profiler = cProfile.Profile() if profiled else None
        t0 = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        cap = capability(transport, size, i)
        moved_by.add(puller.pull(conn, offered(endpoint, cap), cap, secret=SECRET, timeout_s=600, phases=phases)
                     or transport)
        times.append(time.perf_counter() - t0)
        if phases is not UNTIMED:
            steps.append(phases.durations())
        if profiler is not None:
            profiler.disable()
            print(f"--- profile of one {size}-token pull over {transport} ---")
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(14)
        kv.free(f"r{size}", keep_cache=False)
    return times


def median_steps(steps: list[dict[str, float]]) -> dict[str, float]:
    """Median microseconds of each step over the timed pulls, in the order the steps ran ("total"
    last: the median pull's own start-to-last-mark time, not the sum of the medians)."""
    order = list(dict.fromkeys(name for s in steps for name in s if name != "total"))
    out = {name: statistics.median(s.get(name, 0.0) for s in steps) * 1e6 for name in order}
    if steps:
        out["total"] = statistics.median(s["total"] for s in steps) * 1e6
    return out


def burst_pulls(args, conn, endpoint, size: int, transport: str, n: int) -> list[float]:
    """Wall seconds of each burst of `n` concurrent pulls (the first one a warm-up)."""
    puller, times = make_puller(transport, conn), []
    positions = (tuple(range(-(-size // BLOCK))),)
    for b in range(args.burst_reps + 1):
        rids = [f"burst-{size}-{b}-{j}" for j in range(n)]
        targets = []
        for rid in rids:  # the driver reserves before the rank pulls (cluster/handover.py)
            blocks = conn.pins.reserve(rid, size, positions)
            assert blocks is not None, "the receiving cache is too small for the burst"
            targets.append(conn.io.into(blocks))
        errors: list[BaseException] = []

        def pull(target, cap, errors=errors):
            try:
                puller.pull(target, offered(endpoint, cap), cap, secret=SECRET, timeout_s=600)
            except BaseException as exc:  # reported below, after every thread is done
                errors.append(exc)

        threads = [threading.Thread(target=pull, args=(t, capability(f"{transport}-burst", size, b * n + j)))
                   for j, t in enumerate(targets)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        times.append(time.perf_counter() - t0)
        for rid in rids:
            conn.pins.abort(rid)
        if errors:
            raise errors[0]
    return times


_DIRECT_OFFERS: dict[str, bytes] = {}  # capability -> the direct offer the exporter made (kv_offer's endpoint)


def offered(endpoint: Endpoint, cap: str) -> Endpoint:
    """The endpoint as a rank's offer under `cap` comes: with its direct offer, if one was made."""
    return dataclasses.replace(endpoint, direct_offer=_DIRECT_OFFERS.get(cap, b""))


def run(args) -> tuple[list[dict], list[dict]]:
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--exporter"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                filter(None, [ROOT, os.environ.get("PYTHONPATH")]))})  # keep the caller's path
    where = f"cuda:{args.exporter_gpu}" if args.device == "cuda" else "cpu"
    bursts = burst_sizes(args)
    proc.stdin.write(json.dumps({"device": where, "sizes": args.sizes, "reps": args.reps, "shape": args.shape,
                                 "frame_mib": args.frame_mib,
                                 "transports": args.transports, "burst_transports": args.burst_transports,
                                 "burst_reps": args.burst_reps, "burst": bursts}) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    while line and not line.startswith("{"):  # NIXL logs its agent's start on stdout
        line = proc.stdout.readline()
    info = json.loads(line)
    endpoint = Endpoint.from_wire(info["endpoint"])
    _DIRECT_OFFERS.update({cap: base64.b64decode(blob) for cap, blob in info["direct_offers"].items()})
    rows, burst_rows = [], []
    try:
        room = max([max(args.sizes)] + [s * bursts[s] for s in args.sizes if args.burst_transports])
        kv, conn = replica(room, args.device, seed=2, shape=args.shape)
        for size in args.sizes:
            nbytes = size * token_bytes(args.shape)
            copy_s = copy_seconds(nbytes, args.device, args.reps)
            for transport in args.transports:
                why, moved_by, steps = missing(transport, args, info), set(), []
                try:
                    times = [] if why else single_pulls(args, conn, kv, endpoint, size, transport, moved_by, steps)
                except Exception as exc:  # a transport that fails here is reported, the others still run
                    why = f"failed: {type(exc).__name__}: {exc}"
                if why:
                    rows.append({"tokens": size, "mib": nbytes / 2**20, "transport": transport, "skipped": why})
                    continue
                pull_s = statistics.median(times[1:])
                rows.append({"tokens": size, "mib": nbytes / 2**20, "transport": transport, "cold_ms": times[0] * 1e3,
                             "pull_ms": pull_s * 1e3, "pull_gb_s": nbytes / pull_s / 1e9, "copy_ms": copy_s * 1e3,
                             "copy_gb_s": nbytes / copy_s / 1e9, "ratio": copy_s / pull_s,
                             "export_ms": info["export_ms"][str(size)], "moved_by": "+".join(sorted(moved_by)),
                             "phases_us": median_steps(steps)})
                print(f"  {size} tokens {transport}: {rows[-1]['pull_ms']:.2f} ms, {rows[-1]['ratio']:.2f}x copy",
                      file=sys.stderr, flush=True)  # progress, for a run its time limit cuts
            for transport in args.burst_transports:
                n = bursts[size]
                why = missing(transport, args, info)
                try:
                    wall = 0.0 if why else statistics.median(burst_pulls(args, conn, endpoint, size, transport, n)[1:])
                except Exception as exc:
                    why = f"failed: {type(exc).__name__}: {exc}"
                if why:
                    burst_rows.append({"tokens": size, "mib": nbytes / 2**20, "transport": transport, "skipped": why})
                    continue
                burst_rows.append({"tokens": size, "mib": nbytes / 2**20, "transport": transport, "requests": n,
                                   "burst_ms": wall * 1e3, "per_request_ms": wall / n * 1e3,
                                   "gb_s": n * nbytes / wall / 1e9, "copy_gb_s": nbytes / copy_s / 1e9,
                                   "ratio": n * copy_s / wall})
                print(f"  burst of {n} x {size} tokens {transport}: {wall * 1e3:.1f} ms", file=sys.stderr, flush=True)
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    return rows, burst_rows


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "skipped" not in r]
    if not rows:
        return
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
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b", help="the cache's shape "
                        "(llama3-8b: 128 KiB a token; demo: the bundled demo model, 3 KiB a token)")
    parser.add_argument("--sizes", default=None, help="request sizes in tokens (default: 1024,8192,32768 on CUDA, "
                        "1024,2048 on CPU: 2048 tokens of llama3-8b are 256 MiB)")
    parser.add_argument("--transports", default=None, help="single pulls; default: zmq,nixl,cuda_ipc,cuda_ipc-verify "
                        "on CUDA (-verify: with the checksum over the copied bytes), zmq,nixl,nixl-verify on CPU")
    parser.add_argument("--burst-transports", default=None, help="pipelined bursts; default: nixl,cuda_ipc on CUDA, "
                        "zmq,nixl on CPU; 'none' for no bursts")
    parser.add_argument("--frame-mib", type=float, default=None, help="the exporter's frame size (default: the "
                        "device's, rank_io.frame_bytes_for: 1 MiB on CPU, 256 MiB on CUDA; --frame-mib 256 on CPU "
                        "gives a pull the frames, hence the per-frame host work, of one on a GPU)")
    parser.add_argument("--burst", type=int, default=8, help="requests per burst (default 8)")
    parser.add_argument("--burst-gib", type=float, default=16.0, help="at most this much receiving cache per "
                        "burst: fewer requests per burst for large sizes (default 16)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--burst-reps", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="cProfile the last pull of the smallest size per "
                        "transport (the profiled pull is timed too: its row is slower)")
    parser.add_argument("--phases", action="store_true", help="time each step of every warm single pull "
                        "(kvtransfer/pull_phases.py) and print their medians per size and transport, in us")
    parser.add_argument("--exporter-gpu", type=int, default=0, help="the exporter's GPU (another one than this "
                        "process's cuda:0: GPU to GPU, e.g. --exporter-gpu 1 --transports nixl,cuda_ipc,zmq)")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument("--offer", action="store_true", help="time the prefill rank's KVRankAgent.offer instead "
                        "of pulls (module docstring)")
    parser.add_argument("--exporter", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.exporter:
        return exporter()
    cuda = args.device == "cuda"
    args.sizes = [int(s) for s in (args.sizes or ("1024,8192,32768" if cuda else "1024,2048")).split(",")]
    default = "zmq,nixl,cuda_ipc,cuda_ipc-verify" if cuda else "zmq,nixl,nixl-verify"
    args.transports = (args.transports or default).split(",")
    bursts = args.burst_transports or ("nixl,cuda_ipc" if cuda else "zmq,nixl")
    args.burst_transports = [] if bursts == "none" else bursts.split(",")
    if args.burst < 1 or args.burst_reps < 1 or args.reps < 1:
        parser.error("--burst, --burst-reps and --reps must be >= 1")
    where = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores)"
    os.makedirs(args.out, exist_ok=True)
    if args.offer:
        rows = offer_times(args)
        with open(os.path.join(args.out, f"kv_offer-{args.device}-{args.shape}.json"), "w") as f:
            json.dump({"device": where, "load": os.getloadavg(), "rows": rows}, f, indent=1)
        print(f"KVRankAgent.offer, {args.shape} shape, on {where}, load {os.getloadavg()[0]:.1f}; median of "
              f"{args.reps} offers after a warm one")
        print(f"{'setting':<26} {'tokens':>7} {'NIXL':>5} {'offer ms':>9} {'min ms':>8} {'first ms':>9}")
        for r in rows:
            print(f"{r['setting']:<26} {r['tokens']:>7} {'yes' if r['nixl'] else 'no':>5} {r['offer_ms']:>9.2f} "
                  f"{r['min_ms']:>8.2f} {r['cold_ms']:>9.2f}")
        return
    rows, burst_rows = run(args)
    stem = os.path.join(args.out, f"kv_handover-{args.device}-{args.shape}")
    with open(stem + ".json", "w") as f:
        json.dump({"device": where, "rows": rows, "pipelined": burst_rows}, f, indent=1)
    plot(rows, stem + ".png", f"KV hand-over vs device copy ({where})")
    print(f"wrote {stem}.json and {stem}.png")
    print_tables(args, rows, burst_rows, where)


def print_tables(args, rows: list[dict], burst_rows: list[dict], where: str) -> None:
    """The tables, last (a device call's output keeps its tail)."""
    layers, kv_heads, head = SHAPES[args.shape]
    print(f"KV hand-over, {args.shape} shape ({layers} layers, {kv_heads} KV heads x {head}, bf16, block 16) "
          f"on {where}")
    print("single pull (one request at a time; medians):")
    print(f"{'tokens':>7} {'MiB':>7} {'transport':>17} {'cold ms':>8} {'pull ms':>8} {'GB/s':>7} "
          f"{'copy GB/s':>9} {'ratio':>6} {'export ms':>9} moved by")
    for r in rows:
        if "skipped" in r:
            print(f"{r['tokens']:>7} {r['mib']:>7.0f} {r['transport']:>17}  skipped: {r['skipped']}")
            continue
        print(f"{r['tokens']:>7} {r['mib']:>7.0f} {r['transport']:>17} {r['cold_ms']:>8.1f} {r['pull_ms']:>8.2f} "
              f"{r['pull_gb_s']:>7.3g} {r['copy_gb_s']:>9.4g} {r['ratio']:>6.3f} {r['export_ms']:>9.1f} "
              f"{r['moved_by']}")
    if any(r.get("phases_us") for r in rows):
        print("steps of a warm single pull (--phases; median us per step, kvtransfer/pull_phases.py says what "
              "each covers):")
        for r in rows:
            if r.get("phases_us"):
                steps = "  ".join(f"{name} {us:.0f}" for name, us in r["phases_us"].items())
                print(f"{r['tokens']:>7} {r['transport']:>17}  {steps}")
    if burst_rows:
        print("pipelined (a burst of N requests pulled concurrently, one thread each, as a decode replica receives "
              "a burst; wall time of the whole burst, median):")
        print(f"{'tokens':>7} {'MiB':>7} {'transport':>17} {'N':>3} {'burst ms':>9} {'ms/req':>8} {'GB/s':>7} "
              f"{'copy GB/s':>9} {'ratio':>6}")
        for r in burst_rows:
            if "skipped" in r:
                print(f"{r['tokens']:>7} {r['mib']:>7.0f} {r['transport']:>17}  skipped: {r['skipped']}")
                continue
            print(f"{r['tokens']:>7} {r['mib']:>7.0f} {r['transport']:>17} {r['requests']:>3} {r['burst_ms']:>9.2f} "
                  f"{r['per_request_ms']:>8.2f} {r['gb_s']:>7.3g} {r['copy_gb_s']:>9.4g} {r['ratio']:>6.3f}")


if __name__ == "__main__":
    main()
