"""Host work of one warm NIXL or CUDA IPC pull at the decode rank, phase by phase, in one process,
without moving bytes (CPU; issue 37).

    python bench/pull_host.py                              # 1k, 8k, 32k tokens, medians of 40 pulls
    python bench/pull_host.py --compare OLD_ROOT           # alternate OLD_ROOT's meshserve and this one

A request of the Llama-3-8B cache's blocks (32 layers, block 16) with one KV head of 128 (the host
work depends on layers and blocks, not bytes), exported as a GPU exports it (frames of up to 256
MiB: one per layer), is pulled again and again into fresh blocks of a second cache in this
process, step by step as `direct_offer.pull_direct` and the pullers take them (pull_phases.py):
  offer     the direct offer opened (its MAC checked) and the capability spent
  header    the header decoded and checked, blocks reserved (the bench's KVConnector, as
            bench/kv_handover.py; in serving the decode driver reserves before the pull)
  indices   NIXL: the description's frames checked, our and the exporter's descriptor indices
  map       CUDA IPC: the byte ranges checked and the frames' views made (the exporter's
            allocations as they are kept after the first pull: plain tensors here)
  launch    CUDA IPC: the copies queued (the copy kernels themselves patched out: no bytes move)
  finish    the import finished (the bench's commit of the sender's hashes)
and, on the prefill side, before the pull (one table of its own):
  blocks out  the driver's HandoverBlocks.to_wire() packed by msgpack (kv_offer's message to its ranks)
  blocks in   a rank's msgpack unpack and HandoverBlocks.from_wire()
  export      the rank's export of them (`KVRankIO.export`: the frame plan, the header packed)
  offer out   the exporter's direct offer made (`pack_offer`: the description packed, its MAC)
Not here: NIXL's own calls (prep, post, wait, release), the CUDA IPC mapping itself, the done
notice, the step channel's own framing and MAC; bench/kv_handover.py --phases times a real pull
between two processes.
`--compare OLD_ROOT` runs this script under OLD_ROOT's meshserve (e.g. `git archive <commit> |
tar -x -C OLD_ROOT`) and this tree's, alternating process by process, and prints both with the
spread (min-max of the per-process medians).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("offer", "header", "indices", "map", "launch", "finish")
PREFILL = ("blocks out", "blocks in", "export", "offer out")
LAYERS, KV_HEADS, HEAD, BLOCK = 32, 1, 128, 16


def measure(tokens: int, reps: int) -> dict[str, float]:
    """Median µs per phase of `reps` warm pulls of a `tokens`-token request."""
    import msgpack
    import torch

    from meshserve.attention.spec import AttentionSpec
    from meshserve.core.secret import ClusterSecret
    from meshserve.kvstore.cache_tensors import allocate_caches
    from meshserve.kvstore.manager import KVCacheManager
    from meshserve.kvtransfer import cuda_ipc, nixl_transport
    from meshserve.kvtransfer.direct_offer import SpentCapabilities, open_offer, pack_offer
    from meshserve.kvtransfer.nixl_agent import LocalList, Peer, Region, _offsets
    from meshserve.kvtransfer.pins import HandoverBlocks
    from meshserve.kvtransfer.pull_phases import PullPhases
    from tests.kv_connector import KVConnector

    torch._foreach_copy_ = lambda *a, **k: None  # the host work of the copies, not the copies
    torch.Tensor.copy_ = lambda self, *a, **k: self
    secret = ClusterSecret(b"the pull host bench's own secret")

    def replica() -> tuple[KVCacheManager, KVConnector]:
        num_blocks = tokens // BLOCK + 8
        specs = [AttentionSpec(num_heads=4 * KV_HEADS, num_kv_heads=KV_HEADS, head_size=HEAD)] * LAYERS
        caches = allocate_caches(specs, num_blocks=num_blocks, block_size=BLOCK, dtype="bfloat16", device="cpu")
        kv = KVCacheManager(num_blocks, BLOCK)
        return kv, KVConnector(kv, caches, model_id="llama-3-8b-shape")

    (src_kv, src), (dst_kv, dst) = replica(), replica()
    src_kv.allocate_slots("filler", 3 * BLOCK, [0] * 3 * BLOCK)  # the sent blocks start past block 1
    src_kv.allocate_slots("r", tokens, list(range(tokens)))
    export = src.export("r", max_frame_bytes=256 << 20, checksum=False)
    regions = [Region.of(c.data) for c in src.io.caches]
    sent = list(filter(None, itertools.chain.from_iterable(src_kv.block_tables("r"))))
    frames = [[layer, sent[first], n] for layer, first, n in export.header.frames]
    nixl = {"agent": "exporter", "generation": 1, "metadata": b"m" * 2048, "mem": "DRAM",
            "regions": [[r.address, r.block_nbytes, r.num_blocks, r.device] for r in regions], "frames": frames}
    ipc_ranges = [[layer, sent[first] * regions[layer].block_nbytes, n * regions[layer].block_nbytes]
                  for layer, first, n in export.header.frames]
    blob = pack_offer(secret, ["capability"], export.header_bytes, {"nixl": nixl})
    peer = Peer("exporter", 1, tuple(regions), _offsets(regions), None, nixl["regions"])
    local = LocalList(None, dict(zip(dst.io.regions, _offsets(dst.io.regions))))
    sources = [c.data.view(torch.uint8).reshape(-1) for c in src.io.caches]
    if hasattr(cuda_ipc, "SharedSources"):  # kept per exporter by IpcImporter since it exists
        sources = cuda_ipc.SharedSources.of(sources)
    pinned = src.pins.pin("r").blocks
    times: dict[str, list[float]] = {p: [] for p in (*PHASES, *PREFILL)}
    clock = time.perf_counter
    for i in range(reps + 3):
        t0 = clock()
        message = msgpack.packb(pinned.to_wire(), use_bin_type=True)
        t1 = clock()
        received = HandoverBlocks.from_wire(msgpack.unpackb(message, raw=False))
        t2 = clock()
        exported = src.io.export(received, max_frame_bytes=256 << 20, checksum=False)
        t3 = clock()
        pack_offer(secret, ["capability"], exported.header_bytes, {"nixl": nixl})
        t4 = clock()
        phases = PullPhases()
        offer = open_offer(secret, "capability", blob)
        SpentCapabilities().spend("exporter", "capability")
        phases.mark("offer")
        with dst.begin_import(offer.header) as session:
            phases.mark("header")
            nixl_transport._indices(session, offer.descriptions["nixl"]["frames"],
                                    local.offsets_of(session.io.regions), peer)  # fmt: skip
            session.trust_frames()
            phases.mark("indices")
            cuda_ipc.copy_described(session, sources, ipc_ranges, phases=phases)
            phases.mark("launch")
            session.finish()
            phases.mark("finish")
        dst_kv.free("r", keep_cache=False)
        if i >= 3:
            for name, seconds in zip(PREFILL, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                times[name].append(seconds * 1e6)
            for name, seconds in phases.durations().items():
                if name in times:
                    times[name].append(seconds * 1e6)
    return {p: statistics.median(v) for p, v in times.items()}


def child(args) -> None:
    sys.path.insert(0, args.root)
    out = {n: measure(n, args.reps) for n in args.sizes}
    import meshserve

    print(json.dumps({"root": os.path.dirname(os.path.dirname(meshserve.__file__)), "results": out}))


def run_child(root: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--root", root, "--reps", str(args.reps),
           "--sizes", ",".join(map(str, args.sizes))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, ROOT])}  # tests.kv_connector from this tree
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    res = json.loads(out.strip().splitlines()[-1])
    assert os.path.realpath(res["root"]) == os.path.realpath(root), (res["root"], root)
    return {int(k): v for k, v in res["results"].items()}


def table(label: str, runs: list[dict], sizes: list[int]) -> None:
    print(f"{label}: µs per pull, median over processes (min-max of the per-process medians)")
    for names in (PHASES, PREFILL):
        _rows(runs, sizes, names)


def _rows(runs: list[dict], sizes: list[int], names: tuple[str, ...]) -> None:
    print(f"{'tokens':>7} " + " ".join(f"{p:>15}" for p in (*names, "total")))
    for n in sizes:
        cells = []
        for p in (*names, "total"):
            vals = [sum(r[n][q] for q in names) if p == "total" else r[n][p] for r in runs]
            cells.append(f"{statistics.median(vals):.0f} ({min(vals):.0f}-{max(vals):.0f})")
        print(f"{n:>7} " + " ".join(f"{c:>15}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1024,8192,32768", help="request sizes in tokens")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--processes", type=int, default=3, help="processes per tree (alternating with --compare)")
    parser.add_argument("--compare", default=None, help="another tree's root: run both, alternating")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    if args.child:
        return child(args)
    roots = [args.compare, ROOT] if args.compare else [ROOT]
    runs: dict[str, list[dict]] = {r: [] for r in roots}
    for i in range(args.processes):
        for root in roots if i % 2 == 0 else roots[::-1]:
            runs[root].append(run_child(root, args))
    print(f"host work of one warm pull, {LAYERS} layers, block {BLOCK}, a frame per layer; CPU ({os.cpu_count()} "
          f"cores), load {os.getloadavg()[0]:.1f}, {args.processes} processes x {args.reps} pulls per tree; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for root in roots:
        table("before" if root == args.compare else "this tree", runs[root], args.sizes)
        print(f"  ({root})")


if __name__ == "__main__":
    main()
