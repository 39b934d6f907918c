"""Host work of one KV hand-over, per phase, without the copy (CPU; issue 19).

    python bench/handover_host.py                          # 512, 2048, 8192 blocks, medians of 15
    python bench/handover_host.py --blocks 2048 --reps 31
    python bench/handover_host.py --compare OLD_ROOT       # alternate OLD_ROOT's code and this one

What a 32-layer request of N blocks (block 16) costs the hosts of both ends besides moving bytes,
phase by phase, as the pools run it (cluster/handover.py, cluster/executors/rank_host.py, the cuda_ipc puller):
  pin       the prefill driver forks the request's tables into a pin (HandoverBlocks)
  offer     HandoverBlocks to and from msgpack (driver -> rank, as the executor sends it)
  export    the rank describes the blocks: frame plan, frame views, header (the checksum's
            reduction is patched out: it reads every byte, which is device work on a GPU)
  encode    the header to msgpack (the exporter's answer)
  decode    the header from msgpack (the importer)
  reserve   the decode driver reserves blocks at the sent positions (allocate_for_import)
  check     the rank checks the header against its layout and starts the import session,
            computes the destinations and accepts every frame as written (no bytes move)
  commit    the driver adopts the sender's prefix hashes (pins.commit)
  rehash    the hashes from the token ids instead (when the pools' block sizes differ)
  release   the prefill driver releases its pin; the decode side frees the request at its end
The caches are tiny (1 KV head of 8, float32): frames are views, never read. Medians of --reps
runs after a warm-up run, in microseconds; `--compare OLD_ROOT` runs this same script under
OLD_ROOT's meshserve (e.g. `git archive <commit> meshserve | tar -x -C OLD_ROOT`) and under this
tree's, alternating process by process, and prints both with the spread (min-max of the
per-process medians).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PHASES = ("pin", "offer", "export", "encode", "decode", "reserve", "check", "commit", "rehash", "release")
LAYERS, BLOCK = 32, 16


def measure(num_blocks: int, reps: int) -> dict[str, float]:
    """Median microseconds per phase for a request of `num_blocks` blocks (imports the meshserve
    found first on sys.path: the tree under test)."""
    import msgpack
    import torch

    from meshserve.attention.spec import AttentionSpec
    from meshserve.kvstore.cache_tensors import allocate_caches
    from meshserve.kvstore.manager import KVCacheManager
    from meshserve.kvtransfer.pins import HandoverBlocks, KVPins
    from meshserve.kvtransfer.wire import KVHeader
    from tests.kv_connector import KVConnector

    torch.set_num_threads(1)
    # The export's checksum reads every byte (device work on a GPU, one kernel): not host work.
    from meshserve.kvtransfer.wire import FrameDigest

    FrameDigest.update_many = lambda self, frames, **kw: None
    specs = [AttentionSpec(num_heads=1, num_kv_heads=1, head_size=8)] * LAYERS
    tokens = num_blocks * BLOCK - 3  # a partial last block, as a prompt has
    token_ids = [(i * 7919) % 32000 for i in range(tokens)]

    def replica(num: int) -> tuple[KVCacheManager, KVConnector]:
        caches = allocate_caches(specs, num_blocks=num, block_size=BLOCK, dtype="float32", device="cpu")
        kv = KVCacheManager(num, BLOCK)
        return kv, KVConnector(kv, caches, model_id="host-bench")

    src_kv, src = replica(num_blocks + 8)
    dst_kv, dst = replica(num_blocks + 8)
    src_kv.allocate_slots("r", tokens, token_ids)
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    clock = time.perf_counter
    for rep in range(reps + 1):
        rid = f"in-{rep}"
        # untimed: a fresh receiving manager per pull (the rank's caches and KVRankIO stay, as a
        # decode rank's do), so every import gets one run of blocks and adopts hashes new to it,
        # a decode replica's usual case
        dst_kv = KVCacheManager(num_blocks + 8, BLOCK)
        dst_pins = KVPins(dst_kv)
        t0 = clock()
        pin = src.pins.pin("r")
        t1 = clock()
        sent = HandoverBlocks.from_wire(msgpack.unpackb(msgpack.packb(pin.blocks.to_wire()), raw=False))
        t2 = clock()
        export = src.io.export(sent, max_frame_bytes=1 << 40)  # one frame per layer, as on a GPU
        t3 = clock()
        header_bytes = export.header.pack()
        t4 = clock()
        header = KVHeader.unpack(header_bytes)
        t5 = clock()
        blocks = dst_pins.reserve(rid, sent.num_tokens, sent.block_positions, extra_keys=sent.extra_keys)
        t6 = clock()
        session = dst.io.begin_import(header, blocks)
        session.trust_frames()
        session.destinations()
        for i in range(session.num_frames):
            session.accept(i)
        session.finish()
        t7 = clock()
        dst_pins.commit(rid, sent.block_hashes)
        t8 = clock()
        dst_kv.hashes_of(token_ids, extra_keys=sent.extra_keys)
        t9 = clock()
        src.pins.release(pin.pin_id)
        dst_kv.free(rid)
        t10 = clock()
        if rep:
            for name, a, b in zip(PHASES, (t0, t1, t2, t3, t4, t5, t6, t7, t8, t9), (t1, t2, t3, t4, t5, t6, t7, t8,
                                                                                       t9, t10)):
                times[name].append((b - a) * 1e6)
        if rep == 0:
            src_kv.check_invariants()
            dst_kv.check_invariants()
    return {p: statistics.median(v) for p, v in times.items()}


def child(args) -> None:
    sys.path.insert(0, args.root)
    out = {n: measure(n, args.reps) for n in args.blocks}
    import meshserve

    print(json.dumps({"root": os.path.dirname(os.path.dirname(meshserve.__file__)), "results": out}))


def run_child(root: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--root", root, "--reps", str(args.reps),
           "--blocks", ",".join(map(str, args.blocks))]
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    res = json.loads(out.strip().splitlines()[-1])
    assert os.path.realpath(res["root"]) == os.path.realpath(root), (res["root"], root)
    return res["results"]


def table(label: str, runs: list[dict], blocks: list[int]) -> None:
    print(f"{label}: µs per pull, median over processes (min-max of the per-process medians)")
    print(f"{'blocks':>7} " + " ".join(f"{p:>15}" for p in (*PHASES, "total")))
    for n in blocks:
        cells = []
        for p in (*PHASES, "total"):
            vals = [sum(r[str(n)].values()) if p == "total" else r[str(n)][p] for r in runs]
            cells.append(f"{statistics.median(vals):>7.0f} ({min(vals):.0f}-{max(vals):.0f})")
        print(f"{n:>7} " + " ".join(f"{c:>15}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", default="512,2048,8192")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3, help="processes per tree (alternating with --compare)")
    parser.add_argument("--compare", default=None, help="another tree's root: run both, alternating")
    parser.add_argument("--root", default=ROOT, help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.blocks = [int(b) for b in args.blocks.split(",")]
    if args.child:
        return child(args)
    roots = [args.compare, ROOT] if args.compare else [ROOT]
    runs: dict[str, list[dict]] = {r: [] for r in roots}
    for _ in range(args.rounds):
        for root in roots:
            runs[root].append(run_child(root, args))
    print(f"host work per KV hand-over ({LAYERS} layers, block {BLOCK}; CPU, {os.cpu_count()} cores, "
          f"{args.rounds} processes x {args.reps} reps per tree)")
    for root in roots:
        table("before" if root == args.compare else "this tree", runs[root], args.blocks)
        print(f"  ({root})")


if __name__ == "__main__":
    main()
