"""KV store benchmarks (CPU): block bookkeeping per scheduler step, prefix lookup, zmq hand-over.

    python bench/kvstore.py                 # all three, prints tables
    python bench/kvstore.py --only handover --handover-mib 256

bookkeeping: 256 running requests decode one token per step (allocate_slots), requests finish
  after a random output length and are freed; a new request is admitted in their place (prefix
  lookup + allocate the prompt). Reported: µs per step for the manager calls, decode-only steps
  and steps with admissions separately. The hybrid rows run the same requests through a
  KVCacheManager of two layer groups (window 512 and full attention) over a pool twice the size
  (what a hybrid model's shared cache tensors give).
lookup: lookup_prefix on a 4k-token prompt, all cached and none cached.
handover: a sender process offers one request whose blocks hold N MiB (4 layers, bf16, 8 KV
  heads of 128, block 16); this process pulls it over tcp loopback zmq into fresh blocks
  (checksum and allocation included) and copies the same bytes with memcpy, side by side.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


from meshserve.attention.spec import AttentionSpec  # noqa: E402
from meshserve.kvstore.cache_tensors import allocate_caches  # noqa: E402
from meshserve.kvstore.manager import KVCacheManager  # noqa: E402
from meshserve.kvstore.retention import RetentionPolicy  # noqa: E402
from meshserve.kvtransfer.connector import KVConnector  # noqa: E402

SPEC = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128)
LAYERS = 4
BLOCK = 16
BLOCK_BYTES = 2 * BLOCK * 8 * 128 * 2  # per layer, bf16


# ---- block bookkeeping -------------------------------------------------------------------
def bench_bookkeeping(
    steps: int, *, hybrid: bool = False, running: int = 256, prompt: int = 512, seed: int = 0
) -> dict:
    """Timed: the manager calls of each step (free the finished, one slot per running request,
    admit new requests). Not timed: sampling and the scheduler's own lists."""
    rng = random.Random(seed)
    num_blocks = running * (prompt + 1200) // BLOCK + 64
    if hybrid:
        kv = KVCacheManager(2 * num_blocks, BLOCK, retentions=[RetentionPolicy(512, 0), RetentionPolicy()])
    else:
        kv = KVCacheManager(num_blocks, BLOCK)
    system = [rng.randrange(32000) for _ in range(256)]  # a shared system prompt: prefix hits

    def new_request(i: int) -> tuple[str, list[int], int]:
        tokens = system + [rng.randrange(32000) for _ in range(prompt - len(system))]
        return f"r{i}", tokens, rng.randint(64, 1024)

    reqs = [new_request(i) for i in range(running)]
    for rid, tokens, _ in reqs:
        hit = kv.lookup_prefix(tokens)
        assert kv.allocate_slots(rid, len(tokens) - hit.num_tokens, tokens, prefix=hit)
    next_id = running
    decode_steps: list[float] = []  # steps where nobody finished: pure decode
    all_steps: list[float] = []
    admit_each: list[float] = []
    clock = time.perf_counter
    for _ in range(steps):
        for _, tokens, _ in reqs:  # the sampler
            tokens.append(rng.randrange(32000))
        finished = [i for i, (_, tokens, budget) in enumerate(reqs) if len(tokens) - prompt >= budget]
        done = set(finished)
        ids = [r[0] for i, r in enumerate(reqs) if i not in done]
        token_lists = [r[1] for i, r in enumerate(reqs) if i not in done]
        fresh = [(i, new_request(next_id + k)) for k, i in enumerate(finished)]
        next_id += len(finished)
        t0 = clock()
        for i in finished:
            kv.free(reqs[i][0])
        ok = 0  # the scheduler's decode step: allocate_slots per running request
        for rid, tokens in zip(ids, token_lists):
            if not kv.allocate_slots(rid, 1, tokens):
                break
            ok += 1
        t1 = clock()
        for i, (rid, tokens, budget) in fresh:
            hit = kv.lookup_prefix(tokens)
            assert kv.allocate_slots(rid, len(tokens) - hit.num_tokens, tokens, prefix=hit)
            reqs[i] = (rid, tokens, budget)
        t2 = clock()
        assert ok == len(ids), "the pool is sized so that decode never preempts"
        if not finished:
            decode_steps.append((t1 - t0) * 1e6)
        else:
            admit_each.append((t2 - t1) * 1e6 / len(finished))
        all_steps.append((t2 - t0) * 1e6)
    kv.check_invariants()
    return {
        "api": "allocate_slots per request" + (", hybrid: 2 layer groups" if hybrid else ""),
        "running": running,
        "steps": steps,
        "decode_step_us_median": statistics.median(decode_steps),
        "decode_step_us_p90": statistics.quantiles(decode_steps, n=10)[-1],
        "all_steps_us_mean": statistics.fmean(all_steps),
        "admission_us_per_request_median": statistics.median(admit_each),
        "admitted_per_step": len(admit_each) / steps,
        "prefix_hit_rate": kv.stats.prefix_hit_rate,
    }


# ---- prefix lookup -----------------------------------------------------------------------
def bench_lookup(tokens: int = 4096, repeat: int = 50) -> dict:
    kv = KVCacheManager(tokens // BLOCK + 8, BLOCK)
    prompt = list(range(tokens))
    assert kv.allocate_slots("a", tokens, prompt, prefix=kv.lookup_prefix(prompt))
    other = [t + 1 for t in prompt]

    def timed(seq: list[int]) -> float:
        samples = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            kv.lookup_prefix(seq)
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples) * 1e6

    hit_us = timed(prompt + [0])
    miss_us = timed(other)
    assert kv.lookup_prefix(prompt + [0]).num_tokens == tokens
    return {"prompt_tokens": tokens, "all_cached_us": hit_us, "none_cached_us": miss_us}


# ---- hand-over -----------------------------------------------------------------------------
def _replica(num_blocks: int) -> tuple[KVCacheManager, list, KVConnector]:
    kv = KVCacheManager(num_blocks, BLOCK)
    caches = allocate_caches([SPEC] * LAYERS, num_blocks=num_blocks, block_size=BLOCK, dtype="bfloat16")
    for c in caches:
        c.data.fill_(1.0)  # fault the pages in: a serving replica's cache is long since touched
    return kv, caches, KVConnector(kv, caches, model_id="bench")


def serve(mib: int, copies: int, address: str, frame_bytes: int) -> None:
    """The sender process: one request of `mib` MiB, forked into `copies` offers."""
    from meshserve.core.secret import ClusterSecret
    from meshserve.kvtransfer.zmq_transport import KVExportServer

    blocks = mib * (1 << 20) // (LAYERS * BLOCK_BYTES)
    kv, caches, conn = _replica(blocks + 1)
    for c in caches:
        raw = c.data.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))  # random, never zeros
    tokens = list(range(blocks * BLOCK))
    assert kv.allocate_slots("r", len(tokens), tokens)
    export_s = time.perf_counter()
    server = KVExportServer(ClusterSecret(BENCH_SECRET), address=address)
    for i in range(copies):
        kv.fork("r", f"r{i}")
        server.offer(conn.export(f"r{i}", max_frame_bytes=frame_bytes), capability=_capability(i), ttl_s=600,
                     release=conn.release)
    export_s = (time.perf_counter() - export_s) / copies  # pin + checksum, before any pull
    print(json.dumps({"address": server.address, "blocks": blocks, "export_s": export_s}), flush=True)
    while server.num_pending:  # until every offer was pulled and zmq let go of its frames
        server.poll(20)
    server.close()


BENCH_SECRET = b"the bench's own cluster secret"  # both processes are this script


def _capability(i: int) -> str:
    return f"bench-capability-{i:04d}"  # the bench's processes agree on it; a server would use new_capability()


def raw_serve(mib: int, copies: int, address: str, frame_bytes: int) -> None:
    """The transport's ceiling: the same messages as a hand-over, without any KV logic."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 0)
    port = sock.bind_to_random_port(address) if address.startswith("tcp") else None
    if port is None:
        sock.bind(address)
    data = torch.randint(0, 256, (mib << 20,), dtype=torch.uint8).numpy()
    print(json.dumps({"address": sock.getsockopt_string(zmq.LAST_ENDPOINT)}), flush=True)
    for _ in range(copies):
        ident, _ = sock.recv_multipart()
        for off in range(0, len(data), frame_bytes):
            sock.send_multipart([ident, b"F", zmq.Frame(data[off : off + frame_bytes], copy=False)], copy=False)
    sock.close(linger=-1)
    zmq.Context.instance().term()  # returns once every queued frame has left


def _spawn(mode: str, mib: int, repeat: int, address: str, frame_bytes: int) -> tuple[subprocess.Popen, dict]:
    args = [mode, str(mib), "--copies", str(repeat), "--address", address, "--frame-kib", str(frame_bytes >> 10)]
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], stdout=subprocess.PIPE, text=True)
    return proc, json.loads(proc.stdout.readline())


def bench_handover(mib: int, repeat: int, address: str, frame_bytes: int) -> dict:
    """Per round, side by side: memcpy, the raw zmq stream, and pull_kv of the same bytes."""
    import zmq

    from meshserve.core.secret import ClusterSecret
    from meshserve.kvtransfer.zmq_transport import pull_kv

    kv_proc, info = _spawn("--serve", mib, repeat, address, frame_bytes)
    raw_proc, raw_info = _spawn("--raw-serve", mib, repeat, address, frame_bytes)
    try:
        kv, caches, conn = _replica(info["blocks"] + 1)
        nbytes = info["blocks"] * LAYERS * BLOCK_BYTES
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        dst = torch.ones(nbytes, dtype=torch.uint8)  # pages faulted in, as a serving cache's are
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.connect(raw_info["address"])
        view = dst.numpy()
        times: dict[str, list[float]] = {"memcpy": [], "raw_zmq": [], "pull_kv": []}
        for i in range(repeat):
            t0 = time.perf_counter()
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
            times["memcpy"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            raw.send(b"go")
            for off in range(0, mib << 20, frame_bytes):
                raw.recv()
                raw.recv_into(view[off : off + frame_bytes])
            times["raw_zmq"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            pull_kv(conn, info["address"], _capability(i), secret=ClusterSecret(BENCH_SECRET), timeout_s=120)
            times["pull_kv"].append(time.perf_counter() - t0)
            kv.free(f"r{i}")
        raw.close(linger=0)
        kv_proc.wait(timeout=60)
        raw_proc.wait(timeout=60)
    finally:
        for proc in (kv_proc, raw_proc):
            if proc.poll() is None:
                proc.kill()
    gbs = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    return {
        "mib": nbytes / (1 << 20),
        "address": info["address"],
        "frame_kib": frame_bytes >> 10,
        "rounds": repeat,
        "sender_export_ms": info["export_s"] * 1e3,
        "memcpy_gb_s_median": gbs["memcpy"],
        "raw_zmq_gb_s_median": gbs["raw_zmq"],
        "pull_kv_gb_s_median": gbs["pull_kv"],
        "pull_kv_gb_s_best": nbytes / min(times["pull_kv"]) / 1e9,
        "pull_kv_vs_memcpy": gbs["pull_kv"] / gbs["memcpy"],
        "raw_zmq_vs_memcpy": gbs["raw_zmq"] / gbs["memcpy"],
        "pull_kv_vs_raw_zmq": gbs["pull_kv"] / gbs["raw_zmq"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["bookkeeping", "lookup", "handover"])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--handover-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--address", default="tcp://127.0.0.1", help="zmq endpoint of the sender")
    parser.add_argument("--frame-kib", type=int, default=1024, help="hand-over frame size")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--raw-serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--copies", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.serve:
        serve(args.serve, args.copies, args.address, args.frame_kib << 10)
        return
    if args.raw_serve:
        raw_serve(args.raw_serve, args.copies, args.address, args.frame_kib << 10)
        return
    out = {}
    if args.only in (None, "bookkeeping"):
        out["bookkeeping"] = bench_bookkeeping(args.steps)
        out["bookkeeping_hybrid"] = bench_bookkeeping(args.steps, hybrid=True)
    if args.only in (None, "lookup"):
        out["lookup"] = bench_lookup()
    if args.only in (None, "handover"):
        out["handover"] = bench_handover(args.handover_mib, args.repeat, args.address, args.frame_kib << 10)
    if args.json:
        print(json.dumps(out))
        return
    for section, values in out.items():
        print(f"[{section}]")
        for key, value in values.items():
            print(f"  {key:28s} {value:.2f}" if isinstance(value, float) else f"  {key:28s} {value}")


if __name__ == "__main__":
    main()
