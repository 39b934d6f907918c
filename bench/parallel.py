"""Per-layer DCP merge cost (ag_rs vs a2a) by message size, and KV capacity per rank with DCP.

    python -m bench.parallel [--dcp 2,4] [--out DIR] [--write docs/performance.md]

The merge runs on real process groups: gloo on CPU (ranks are local processes), NCCL when
every rank has a GPU. Each timed call is one layer's `merge_outputs` for T tokens of the
DCP group's heads (GQA 32/8 heads, head 128: Llama-3-8B under tp = dcp). Capacity is computed
from the KV store's own block accounting for Llama-3-8B's layer specs at a fixed budget.
Prints a table and writes parallel.json and parallel.png under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from bench.report import pyplot, save_figure
from meshserve.attention.spec import AttentionSpec
from meshserve.config import DcpComm, ParallelConfig
from meshserve.kvstore.cache_tensors import block_bytes
from meshserve.parallel.dcp import merge_outputs
from meshserve.parallel.groups import init_parallel, local_rendezvous, shutdown_parallel

HEADS, KV_HEADS, HEAD, LAYERS = 32, 8, 128, 32
TOKENS = (1, 16, 64, 256, 1024)


def _rank(rank: int, world: int, init: str, device: str, repeats: int, out_file: str) -> None:
    torch.set_num_threads(1)
    ctx = init_parallel(ParallelConfig(tp=world, dcp=world), rank=rank, init_method=init, device=device)
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    rows = []
    for tokens in TOKENS:
        o = torch.randn(tokens, HEADS, HEAD, device=dev, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
        lse = torch.randn(tokens, HEADS, device=dev)
        for comm in DcpComm:
            times = []
            for i in range(repeats + 3):
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                merge_outputs(o, lse, ctx, comm)
                if device == "cuda":
                    torch.cuda.synchronize()
                if i >= 3:
                    times.append(time.perf_counter() - t0)
            rows.append({"dcp": world, "tokens": tokens, "comm": comm.value,
                         "bytes": o.numel() * o.element_size(), "us": statistics.median(times) * 1e6})
    if rank == 0:
        Path(out_file).write_text(json.dumps(rows))
    shutdown_parallel(ctx)


def capacity_rows(budget: int) -> list[dict]:
    """Tokens one replica can hold, at `budget` KV bytes per rank.

    Without DCP, ranks that share a KV head hold the same tokens (replicas); with DCP they hold
    different tokens, so capacity grows x dcp whenever KV heads would be replicated.
    """
    out = []
    for kv_heads in (KV_HEADS, 1):
        spec = AttentionSpec(num_heads=HEADS, num_kv_heads=kv_heads, head_size=HEAD)
        for tp, dcp in ((8, 1), (8, 2), (8, 8)):
            per_block = block_bytes([spec] * LAYERS, 16, "bfloat16", tp_size=tp // dcp)
            out.append({"kv_heads": kv_heads, "tp": tp, "dcp": dcp, "replica_tokens": budget // per_block * 16 * dcp})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dcp", default="2,4", help="DCP group sizes to time (comma separated)")
    ap.add_argument("--device", default="cuda" if torch.cuda.device_count() >= 2 else "cpu")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--budget-gib", type=float, default=40.0, help="KV budget per rank for the capacity table")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for dcp in (int(d) for d in args.dcp.split(",")):
        tmp = out / f"merge_{dcp}.json"
        mp.start_processes(_rank, args=(dcp, local_rendezvous(), args.device, args.repeats, str(tmp)), nprocs=dcp,
                           join=True, start_method="spawn")
        rows += json.loads(tmp.read_text())
        tmp.unlink()
    cap = capacity_rows(int(args.budget_gib * (1 << 30)))
    print(f"DCP merge per layer on {args.device} (median of {args.repeats}); heads {HEADS}, head size {HEAD}")
    print("| dcp | tokens | o bytes | ag_rs µs | a2a µs | a2a / ag_rs |")
    print("|---:|---:|---:|---:|---:|---:|")
    for dcp in sorted({r["dcp"] for r in rows}):
        for tokens in TOKENS:
            ag = next(r for r in rows if (r["dcp"], r["tokens"], r["comm"]) == (dcp, tokens, "ag_rs"))
            a2 = next(r for r in rows if (r["dcp"], r["tokens"], r["comm"]) == (dcp, tokens, "a2a"))
            print(f"| {dcp} | {tokens} | {ag['bytes']} | {ag['us']:.0f} | {a2['us']:.0f} | {a2['us'] / ag['us']:.2f} |")
    print(f"\nKV capacity per replica: {LAYERS} layers, {HEADS} q heads, head {HEAD}, bf16, block 16, "
          f"{args.budget_gib:g} GiB of KV per rank")
    print("| KV heads | tp | dcp | tokens per replica |")
    print("|---:|---:|---:|---:|")
    for c in cap:
        print(f"| {c['kv_heads']} | {c['tp']} | {c['dcp']} | {c['replica_tokens']} |")
    (out / "parallel.json").write_text(json.dumps({"merge": rows, "capacity": cap}, indent=1))
    _plot(rows, out / "parallel.png")
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for dcp in sorted({r["dcp"] for r in rows}):
        for comm, style in (("ag_rs", "-o"), ("a2a", "--s")):
            pts = [r for r in rows if r["dcp"] == dcp and r["comm"] == comm]
            ax.plot([r["bytes"] for r in pts], [r["us"] for r in pts], style, label=f"dcp={dcp} {comm}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("partial output bytes per rank")
    ax.set_ylabel("µs per layer (median)")
    ax.set_title("DCP LSE merge: ag_rs vs a2a")
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
