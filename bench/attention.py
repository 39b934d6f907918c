"""Attention kernels on one GPU, side by side: TRITON vs FLASHINFER (and torch SDPA for prefill).

    python -m bench.attention [--sweep] [--out DIR]

Cases (GQA 32 query / 8 KV heads, head 128, page 16, bf16, block tables shuffled):
  decode bs64 x 4096, bs256 x 2048, bs8 x 32768, with a bf16 and with an FP8 (e4m3) KV cache;
  causal prefill 4 x 4096 and 1 x 16384 from the paged cache.
Timing: CUDA events around each call, L2 flushed before each, median of the timed calls after
warm-up, random data. Decode throughput counts the KV bytes read (TB/s); prefill counts
4 * H * D * L^2 / 2 FLOPs per causal sequence (TFLOP/s). FlashInfer runs as the FLASHINFER
backend runs it (its decode both with and without tensor cores; the faster one is its figure).
--sweep also times Triton tile configurations and split sizes, to choose kernels/config.py.
Prints a table and writes attention.json and attention.png (matplotlib) under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.common import rel_err, shuffled_tables, time_us_l2_flushed
from meshserve.attention.backend import AttentionProblem, KVCache
from meshserve.attention.kernels.config import DecodeConfig, PrefillConfig
from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.spec import AttentionSpec, KVCacheDtype

HEADS, KV_HEADS, HEAD, PAGE = 32, 8, 128, 16
DECODE_SHAPES = ((64, 4096), (256, 2048), (8, 32768))
PREFILL_SHAPES = ((4, 4096), (1, 16384))


@dataclass
class Row:
    case: str
    backend: str
    us: float
    rate: float  # TB/s (decode) or TFLOP/s (prefill)
    unit: str
    note: str = ""
    ratio: float | None = None  # throughput relative to FlashInfer's
    extra: dict = field(default_factory=dict)


def problem(spec: AttentionSpec, max_len: int) -> AttentionProblem:
    cc = torch.cuda.get_device_capability()
    return AttentionProblem(spec, dtype="bfloat16", block_size=PAGE, max_model_len=max_len, device="cuda",
                            compute_capability=cc)  # fmt: skip


def paged_cache(num_blocks: int, fp8: bool, gen: torch.Generator) -> KVCache:
    data = torch.randn(num_blocks, 2, PAGE, KV_HEADS, HEAD, device="cuda", dtype=torch.bfloat16, generator=gen)
    if not fp8:
        return KVCache(data, torch.tensor(1.0, device="cuda"), torch.tensor(1.0, device="cuda"))
    scale = torch.tensor(0.25, device="cuda")
    return KVCache((data / scale).to(torch.float8_e4m3fn), scale, scale.clone())


# ------------------------------------------------------------------------------------ decode
def decode_case(batch: int, seq: int, fp8: bool, sweep: bool) -> list[Row]:
    from meshserve.attention.backends.flashinfer import FlashInferBackend
    from meshserve.attention.backends.triton_paged import TritonBackend

    gen = torch.Generator(device="cuda").manual_seed(batch * seq)
    kv_dtype = KVCacheDtype.FP8_E4M3 if fp8 else KVCacheDtype.AUTO
    spec = AttentionSpec(HEADS, KV_HEADS, HEAD, kv_cache_dtype=kv_dtype)
    per_seq = seq // PAGE
    cache = paged_cache(batch * per_seq, fp8, gen)
    meta = AttentionMetadata.build(query_lens=[1] * batch, seq_lens=[seq] * batch,
                                   block_tables=shuffled_tables(batch, per_seq, torch.Generator().manual_seed(1)),
                                   block_size=PAGE, device="cuda", write_kv=False)  # fmt: skip
    q = torch.randn(batch, HEADS, HEAD, device="cuda", dtype=torch.bfloat16, generator=gen)
    kv_bytes = batch * seq * KV_HEADS * HEAD * 2 * cache.data.element_size()
    name = f"decode bs{batch}x{seq}" + (" fp8" if fp8 else "")
    prob = problem(spec, max(seq, 2 * PAGE) * 2)
    rows, outs = [], {}

    def add(backend_name, backend, note="", extra=None):
        plan = backend.plan(meta)
        outs[backend_name] = backend.forward(q, None, None, cache, plan)
        us = time_us_l2_flushed(lambda: backend.forward(q, None, None, cache, plan))
        rows.append(Row(name, backend_name, us, kv_bytes / us / 1e6, "TB/s", note, extra=extra or {}))
        return us

    tri = TritonBackend(prob)
    tri_plan = tri.plan(meta)
    add("TRITON", tri, f"{tri_plan.num_splits} splits of {tri_plan.partition}")
    for tc in (False, True):
        try:
            add(f"FLASHINFER{' tc' if tc else ''}", FlashInferBackend(prob, decode_tensor_cores=tc),
                "tensor-core decode" if tc else "cuda-core decode")  # fmt: skip
        except Exception as exc:  # report, keep measuring the rest
            print(f"  {name}: FlashInfer (tensor cores={tc}) failed: {exc!r}", flush=True)
    for k, v in outs.items():
        if k != "TRITON":
            print(f"  {name}: max rel diff TRITON vs {k}: {rel_err(outs['TRITON'], v):.2e}", flush=True)
    if sweep and fp8:  # the bf16 decode sweep is in docs/performance.md; FP8 tiles are re-checked here
        shapes = ((64, 4, 2), (64, 4, 3), (128, 4, 3), (128, 8, 3), (256, 4, 2))  # (block_n, warps, stages)
        for cfg in (DecodeConfig(*shape, 512) for shape in shapes):
            try:
                b = TritonBackend(prob, decode_config=cfg)
                p = b.plan(meta)
                add("TRITON sweep", b, f"bn{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} pps{cfg.programs_per_sm} "
                    f"-> {p.num_splits}x{p.partition}", extra=dict(cfg=cfg.__dict__))  # fmt: skip
            except Exception as exc:
                print(f"  sweep {cfg}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    return rows


# ----------------------------------------------------------------------------------- prefill
def prefill_case(batch: int, seq: int, sweep: bool) -> list[Row]:
    from meshserve.attention.backends.flashinfer import FlashInferBackend
    from meshserve.attention.backends.triton_paged import TritonBackend

    gen = torch.Generator(device="cuda").manual_seed(seq)
    spec = AttentionSpec(HEADS, KV_HEADS, HEAD)
    per_seq = seq // PAGE
    cache = paged_cache(batch * per_seq, False, gen)
    meta = AttentionMetadata.build(query_lens=[seq] * batch, seq_lens=[seq] * batch,
                                   block_tables=shuffled_tables(batch, per_seq, torch.Generator().manual_seed(2)),
                                   block_size=PAGE, device="cuda")  # fmt: skip
    tokens = batch * seq
    q = torch.randn(tokens, HEADS, HEAD, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(tokens, KV_HEADS, HEAD, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(tokens, KV_HEADS, HEAD, device="cuda", dtype=torch.bfloat16, generator=gen)
    prob = problem(spec, seq * 2)
    flops = 4 * batch * HEADS * HEAD * seq * seq / 2
    name = f"prefill {batch}x{seq} causal"
    rows, outs = [], {}

    def add(backend_name, fn, note="", extra=None):
        outs[backend_name] = fn()
        us = time_us_l2_flushed(fn, warmup=3, iters=15)
        rows.append(Row(name, backend_name, us, flops / us / 1e6, "TFLOP/s", note, extra=extra or {}))

    tri = TritonBackend(prob)
    tri.write_kv(k, v, cache, meta.slot_mapping)
    tri_plan = tri.plan(meta)
    add("TRITON", lambda: tri.forward(q, k, v, cache, tri_plan), str(tri_plan.prefill))
    try:
        fi = FlashInferBackend(prob)
        fi_plan = fi.plan(meta)
        add("FLASHINFER", lambda: fi.forward(q, k, v, cache, fi_plan), "paged prefill")
    except Exception as exc:
        print(f"  {name}: FlashInfer failed: {exc!r}", flush=True)
    # torch SDPA on contiguous [B, H, L, D] with K/V expanded to all heads (expansion not timed).
    qs = q.view(batch, seq, HEADS, HEAD).transpose(1, 2)
    ks = k.view(batch, seq, KV_HEADS, HEAD).transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, 1)
    vs = v.view(batch, seq, KV_HEADS, HEAD).transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    add("torch SDPA", lambda: sdpa(qs, ks, vs, is_causal=True).transpose(1, 2).reshape(tokens, HEADS, HEAD),
        "contiguous, flash backend")  # fmt: skip
    for k_name, out in outs.items():
        if k_name != "TRITON":
            print(f"  {name}: max rel diff TRITON vs {k_name}: {rel_err(outs['TRITON'], out):.2e}", flush=True)
    if sweep:
        shapes = ((128, 64, 4, 3), (128, 64, 4, 4), (128, 32, 4, 3), (256, 64, 8, 3), (256, 64, 8, 2), (128, 128, 4, 2))
        for cfg in (PrefillConfig(*shape) for shape in shapes):
            try:
                b = TritonBackend(prob, prefill_config=cfg)
                p = b.plan(meta)
                run = lambda b=b, p=p: b.forward(q, k, v, cache, p)  # noqa: E731
                add("TRITON sweep", run, str(cfg), extra=dict(cfg=cfg.__dict__))
            except Exception as exc:
                print(f"  sweep {cfg}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    return rows


# ------------------------------------------------------------------------------------ report
def with_ratios(rows: list[Row]) -> list[Row]:
    """Each row's throughput over FlashInfer's best in the same case."""
    best: dict[str, float] = {}
    for r in rows:
        if r.backend.startswith("FLASHINFER"):
            best[r.case] = max(best.get(r.case, 0.0), r.rate)
    for r in rows:
        r.ratio = r.rate / best[r.case] if r.case in best else None
    return rows


def table(rows: list[Row], *, sweep: bool) -> str:
    lines = ["| case | backend | µs | throughput | vs FlashInfer | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        if (r.backend == "TRITON sweep") != sweep:
            continue
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}x"
        lines.append(f"| {r.case} | {r.backend} | {r.us:.1f} | {r.rate:.2f} {r.unit} | {ratio} | {r.note} |")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", flush=True)
        return
    main = [r for r in rows if r.backend != "TRITON sweep"]
    fig, axes = plt.subplots(1, 2, figsize=(15, 5), gridspec_kw=dict(width_ratios=[3, 1]))
    for ax, unit in zip(axes, ("TB/s", "TFLOP/s")):
        cases = list(dict.fromkeys(r.case for r in main if r.unit == unit))
        backends = list(dict.fromkeys(r.backend for r in main if r.unit == unit))
        width = 0.8 / max(len(backends), 1)
        for i, b in enumerate(backends):
            vals = [next((r.rate for r in main if r.case == c and r.backend == b), 0.0) for c in cases]
            ax.bar([x + i * width for x in range(len(cases))], vals, width, label=b)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cases))])
        ax.set_xticklabels([c.replace(" ", "\n", 1) for c in cases], fontsize=8)
        ax.set_ylabel(unit)
        ax.legend(fontsize=8)
    axes[0].set_title("decode: KV bytes read per second")
    axes[1].set_title("causal prefill")
    fig.suptitle(f"meshserve attention kernels on {torch.cuda.get_device_name()} ({datetime.date.today()})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="also time Triton tile configs and split sizes")
    ap.add_argument("--no-prefill-sweep", action="store_true", help="sweep decode configurations only")
    ap.add_argument("--out", default=".", help="folder for attention.json and attention.png")
    ap.add_argument("--only", default="", help="run only cases whose name contains this text")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    t0 = time.time()
    for fp8 in (False, True):
        for batch, seq in DECODE_SHAPES:
            if args.only in f"decode bs{batch}x{seq}" + (" fp8" if fp8 else ""):
                rows += decode_case(batch, seq, fp8, args.sweep)
                print(f"[{time.time() - t0:.0f}s] decode bs{batch}x{seq} fp8={fp8} done", flush=True)
    for batch, seq in PREFILL_SHAPES:
        if args.only in f"prefill {batch}x{seq}":
            rows += prefill_case(batch, seq, args.sweep and not args.no_prefill_sweep)
            print(f"[{time.time() - t0:.0f}s] prefill {batch}x{seq} done", flush=True)
    rows = with_ratios(rows)
    command = "python -m bench.attention " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = dict(date=str(datetime.date.today()), device=torch.cuda.get_device_name(), torch=torch.__version__,
                command=command)  # fmt: skip
    try:
        import triton

        meta["triton"] = triton.__version__
        import flashinfer

        meta["flashinfer"] = flashinfer.__version__
    except ImportError:
        pass
    (out / "attention.json").write_text(json.dumps(dict(meta=meta, rows=[r.__dict__ for r in rows]), indent=1))
    plot(rows, out / "attention.png")
    if args.sweep:
        (out / "sweep.md").write_text(table(rows, sweep=True) + "\n")
        print("\nBest Triton sweep configurations per case (all in sweep.md):")
        for case in dict.fromkeys(r.case for r in rows):
            tried = sorted((r for r in rows if r.case == case and r.backend == "TRITON sweep"), key=lambda r: r.us)
            for r in tried[:3]:
                print(f"  {case}: {r.us:.1f} us  {r.rate:.2f} {r.unit}  {r.note}")
    print(f"\n{meta}\n" + table(rows, sweep=False), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
