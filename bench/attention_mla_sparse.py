"""Sparse MLA decode on the GPU (DeepSeek-V3.2): indexer + top-2048 attention vs dense MLA, side by side.

Per shape (batch x context), all in one run on the same random bf16 latent cache:
  dense   TRITON MLA decode over every cached token (the meshserve dense path)
  sparse  TRITON sparse MLA over 2048 chosen rows per token (the attention part of sparse MLA)
  index   the lightning indexer's scoring and top-k (64 heads x 128, torch path: index_candidates)
DeepSeek-V3.2 shapes: 128 heads, latent 512 + rope 64, pages of 64. Timed with CUDA events
(triton.testing.do_bench, median) after warm-up; W_UK/W_UV matmuls (identical for both) left out.

    python bench/attention_mla_sparse.py [--shapes 32x8192,8x32768] [--out DIR]
    TRITON_INTERPRET=1 python bench/attention_mla_sparse.py --dry-run   # CPU: the logic, tiny shapes

Prints a markdown table and writes mla_sparse.json, mla_sparse.md and mla_sparse.png under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench.attention_mla as dense_bench  # noqa: E402
from meshserve.attention.backend import AttentionProblem  # noqa: E402
from meshserve.attention.mla.backends.triton_decode import TritonMLADecodeBackend  # noqa: E402
from meshserve.attention.mla.backends.triton_sparse import TritonSparseMLABackend  # noqa: E402
from meshserve.attention.mla.cache import LatentCache  # noqa: E402
from meshserve.attention.mla.indexer import index_candidates  # noqa: E402
from meshserve.attention.mla.spec import mla_spec  # noqa: E402
from meshserve.attention.spec import IndexerDims, KVCacheDtype, MLADims  # noqa: E402

HEADS, PAGE, TOPK = 128, 64, 2048
V32 = MLADims(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
              indexer=IndexerDims(num_heads=64, head_dim=128, topk=TOPK))  # fmt: skip
SHAPES = ((64, 4096), (32, 8192), (16, 16384), (8, 32768), (4, 65536))
DEVICE, DTYPE = "cuda", torch.bfloat16  # --dry-run: cpu, float32


def problem(sparse: bool) -> AttentionProblem:
    cc = torch.cuda.get_device_capability() if DEVICE == "cuda" else None
    dims = V32 if sparse else replace(V32, indexer=None)
    return AttentionProblem(spec=mla_spec(HEADS, dims), dtype=str(DTYPE).removeprefix("torch."), block_size=PAGE,
                            max_model_len=1 << 17, device=DEVICE, compute_capability=cc)  # fmt: skip


def make_inputs(batch: int, seq_len: int, seed: int = 0) -> dict:
    """The dense bench's inputs (bench/attention_mla.py: random latent cache, shuffled pages, one
    decode query per sequence) plus random index keys, index queries and 2048 chosen rows each."""
    inp = dense_bench.make_inputs(batch, seq_len, seed)
    cache = LatentCache.over(inp["cache"].data, V32, kv_cache_dtype=KVCacheDtype.AUTO, scale=inp["cache"].scale)
    gen = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    cache.index_keys.copy_(torch.randn(cache.index_keys.shape, generator=gen, device=DEVICE, dtype=DTYPE))
    k = min(TOPK, seq_len)
    rows = torch.stack([torch.randperm(seq_len, generator=gen, device=DEVICE)[:k] for _ in range(batch)]).int()
    return dict(inp, cache=cache, rows=rows,
                q_idx=torch.randn(batch, 64, 128, generator=gen, device=DEVICE, dtype=DTYPE),
                w_idx=torch.randn(batch, 64, generator=gen, device=DEVICE))  # fmt: skip


def time_us(fn) -> float:
    if DEVICE != "cuda":  # dry run: one call, wall clock
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median") * 1e3


def reference(inp: dict, b: int = 0) -> torch.Tensor:
    """float32 latent-space attention of sequence b over its chosen rows: o_lat [H, 512]."""
    cache, r = inp["cache"], V32.kv_lora_rank
    rows = inp["rows"][b].long()
    slots = inp["meta"].block_table[b, rows // PAGE].long() * PAGE + rows % PAGE
    kv = cache.data.view(-1, cache.data.shape[2])[slots].float()
    s = (inp["q_lat"][b].float() @ kv[:, :r].T + inp["q_pe"][b].float() @ kv[:, r:].T) * V32.qk_head_dim**-0.5
    return torch.softmax(s, dim=-1) @ kv[:, :r]


def run_shape(batch: int, seq_len: int) -> dict:
    inp = make_inputs(batch, seq_len)
    dense = TritonMLADecodeBackend(problem(False))
    dense_plan = dense.plan(inp["meta"])
    sparse = TritonSparseMLABackend(problem(True))
    sparse_plan = sparse.plan(inp["meta"])
    q_lat, q_pe, cache = inp["q_lat"], inp["q_pe"], inp["cache"]

    def run_sparse() -> torch.Tensor:  # the latent-space kernel alone, as for dense
        return sparse.attend_latent(q_lat, q_pe, cache, sparse_plan, inp["rows"])[0]

    err = ((run_sparse()[0].float() - reference(inp)).norm() / reference(inp).norm()).item()
    row = dict(
        dense_us=time_us(lambda: dense.attend_latent(q_lat, q_pe, cache, dense_plan)),
        sparse_us=time_us(run_sparse),
        index_us=time_us(lambda: index_candidates(inp["q_idx"], inp["w_idx"], cache, inp["meta"], TOPK)),
        sparse_rel_err=err,
    )
    row["sparse_total_us"] = row["sparse_us"] + row["index_us"]
    return row


def format_table(results: dict) -> str:
    lines = [f"Sparse MLA decode, {results['device']}: {HEADS} heads, latent 512 + rope 64, top-{TOPK}, page "
             f"{PAGE}, {str(DTYPE).removeprefix('torch.')}",
             "| batch x kv len | dense MLA (us) | sparse attention (us) | indexer (us) | sparse total (us) "
             "| attention speed-up | total speed-up | rel err |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for shape, r in results["shapes"].items():
        lines.append(f"| {shape} | {r['dense_us']:.1f} | {r['sparse_us']:.1f} | {r['index_us']:.1f} | "
                     f"{r['sparse_total_us']:.1f} | {r['dense_us'] / r['sparse_us']:.2f}x | "
                     f"{r['dense_us'] / r['sparse_total_us']:.2f}x | {r['sparse_rel_err']:.1e} |")  # fmt: skip
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(results["shapes"])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, label in (("dense_us", "dense MLA (TRITON)"), ("sparse_us", f"sparse top-{TOPK} attention"),
                       ("index_us", "indexer (torch)"), ("sparse_total_us", "sparse total")):  # fmt: skip
        ax.plot(shapes, [results["shapes"][s][key] for s in shapes], marker="o", label=label)
    ax.set_yscale("log")
    ax.set_xlabel("batch x context")
    ax.set_ylabel("time per layer (us, median)")
    ax.set_title(f"Sparse MLA decode vs dense, {results['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    global DEVICE, DTYPE, HEADS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(f"{b}x{n}" for b, n in SHAPES))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--dry-run", action="store_true", help="CPU interpreter, float32, tiny shapes")
    args = parser.parse_args()
    if args.dry_run:
        DEVICE, DTYPE, HEADS = "cpu", torch.float32, 16
        args.shapes = "2x200"
    dense_bench.DEVICE, dense_bench.DTYPE, dense_bench.HEADS = DEVICE, DTYPE, HEADS  # the inputs are built there
    results: dict = dict(device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", shapes={})
    for shape in args.shapes.split(","):
        batch, seq_len = (int(v) for v in shape.split("x"))
        results["shapes"][shape] = run_shape(batch, seq_len)
        print(shape, json.dumps(results["shapes"][shape]), flush=True)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    table = format_table(results)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mla_sparse.json").write_text(json.dumps(results, indent=1))
    (args.out / "mla_sparse.md").write_text(table + "\n")
    plot(results, args.out / "mla_sparse.png")


if __name__ == "__main__":
    main()
