"""MLA decode on one GPU: today's TRITON kernel, the FlashMLA-structured variants and FlashInfer, side by side.

    python -m bench.mla_decode_device [--out DIR] [--shapes 64x4096,...] [--only TEXT] [--iters-ms 150]
    TRITON_INTERPRET=1 python -m bench.mla_decode_device --dry-run   # CPU: the script's logic, tiny shapes

DeepSeek-V3 shapes (bench/attention_mla.py's inputs: 128 heads, latent 512 + rope 64, pages of 64,
bf16, random data, shuffled block tables), the four shapes of docs/performance.md's MLA decode
table. Variants: bench/mla_decode_variants.py (bench/kernel_report_mla.py compiles the same ones
for sm_90 and reports registers, spills and shared memory). FlashInfer 0.5.3's MLA decode when
it imports (its JIT build runs in a background process meanwhile).

Each variant is first checked on every decode row against a float32 reference, with its output
and partial buffers poisoned with NaN (a variant that is wrong is reported and not timed), and
its CUDA-graph plan (splits fixed for 32k keys, each row cut by its own length) checked at the
first shape. Then two rounds over all variants (triton.testing.do_bench medians, L2 cleared
before each call), so the spread between rounds says what is noise. Prints a table last and
writes mla_decode_device.json, .md and .png under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import subprocess
import time
from pathlib import Path

import torch

import bench.attention_mla as am
from bench.mla_decode_variants import Variant, variants
from meshserve.attention.mla.backends.triton_decode import TritonMLADecodeBackend

TOLERANCE = 1e-2  # bf16 output, relative norm error (both backends measured 2.2e-3 to 2.8e-3)
GRAPH_MAX_LEN = 32768


def full_reference(inp: dict) -> torch.Tensor:
    """float32 latent attention of every decode row: o_lat [B, H, 512]."""
    return am.reference(inp, rows=inp["batch"])


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.float()
    if not torch.isfinite(out).all():
        return float("nan")
    return ((out - ref).norm() / ref.norm()).item()


def poison_next_output(inp: dict) -> None:
    """Free a NaN-filled block of the output's size: the caching allocator hands it to the next
    torch.empty of that size, so an element the kernel leaves unwritten reads NaN."""
    nan = torch.full_like(inp["q_lat"], float("nan"))
    del nan


def check_triton(var: Variant, inp: dict, ref: torch.Tensor) -> tuple[float, dict]:
    backend = TritonMLADecodeBackend(am.problem(), config=var.config)
    plan = backend.plan(inp["meta"])
    if plan.partial_o is not None:
        plan.partial_o.fill_(float("nan"))
    poison_next_output(inp)
    out, _ = backend.attend_latent(inp["q_lat"], inp["q_pe"], inp["cache"], plan)
    return rel_err(out, ref), dict(splits=plan.num_splits, partition=plan.partition)


def check_graph_plan(var: Variant, inp: dict, ref: torch.Tensor) -> float:
    """The plan a CUDA graph replays: splits fixed for GRAPH_MAX_LEN keys over static buffers,
    then the real lengths and tables written into them."""
    meta = inp["meta"]
    n = meta.num_decodes
    pages = GRAPH_MAX_LEN // am.PAGE
    seq_lens = torch.ones(n, dtype=torch.int32, device=meta.seq_lens.device)
    table = torch.zeros(n, pages, dtype=torch.int32, device=meta.seq_lens.device)
    static = dataclasses.replace(meta, seq_lens=seq_lens, block_table=table, seq_lens_host=(GRAPH_MAX_LEN,) * n,
                                 max_seq_len=GRAPH_MAX_LEN)  # fmt: skip
    backend = TritonMLADecodeBackend(am.problem(), config=var.config)
    plan = backend.plan_for_graph(static)
    seq_lens.copy_(meta.seq_lens)
    table[:, : meta.block_table.shape[1]] = meta.block_table
    if plan.partial_o is not None:
        plan.partial_o.fill_(float("nan"))
    out, _ = backend.attend_latent(inp["q_lat"], inp["q_pe"], inp["cache"], plan)
    return rel_err(out, ref)


def triton_fn(var: Variant, inp: dict):
    backend = TritonMLADecodeBackend(am.problem(), config=var.config)
    plan = backend.plan(inp["meta"])
    return lambda: backend.attend_latent(inp["q_lat"], inp["q_pe"], inp["cache"], plan)


def flashinfer_fn(inp: dict):
    wrapper = am.flashinfer_wrapper(inp)
    cache = inp["cache"]
    return lambda: wrapper.run(inp["q_lat"], inp["q_pe"], cache.latent, cache.rope)


def time_us(fn, rep_ms: int) -> float:
    if am.DEVICE != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e3


@dataclasses.dataclass
class FlashInferBuild:
    """FlashInfer's JIT build in a background process, and why FlashInfer is left out (if it is)."""

    process: subprocess.Popen | None
    left_out: str | None = None


def run_shape(batch: int, seq_len: int, chosen: list[Variant], args, *, fi: FlashInferBuild, first: bool,
              t0: float) -> list[dict]:  # fmt: skip
    """Check every variant at this shape (the graph plan too when `first`), then time the right ones."""
    inp = am.make_inputs(batch, seq_len)
    ref = full_reference(inp)
    fns: dict[str, object] = {}
    rows: list[dict] = []
    for var in chosen:
        row = dict(variant=var.label, config=dataclasses.asdict(var.config))
        row["config"]["kernel"] = var.config.kernel.value
        try:
            row["err"], info = check_triton(var, inp, ref)
            row.update(info)
            if first:
                row["graph_err"] = check_graph_plan(var, inp, ref)
            if row["err"] < TOLERANCE and row.get("graph_err", 0.0) < TOLERANCE:
                fns[var.label] = triton_fn(var, inp)
            else:
                row["error"] = "wrong result: not timed"
        except Exception as exc:  # a variant that fails is a finding, not the end of the run
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rows.append(row)
        print(f"[{time.time() - t0:.0f}s] {batch}x{seq_len} checked {json.dumps(row)}", flush=True)
    use_flashinfer = am.DEVICE == "cuda" and importlib.util.find_spec("flashinfer") is not None
    if fi.process is not None and fi.left_out is None:  # FlashInfer's JIT build ran meanwhile
        try:
            fi.process.wait(timeout=max(args.flashinfer_build_s - (time.time() - t0), 1))
        except subprocess.TimeoutExpired:  # a build that eats the call would leave no table at all
            fi.process.kill()
            fi.left_out = f"JIT build over {args.flashinfer_build_s} s: left out"
    if fi.left_out is not None:
        rows.insert(0, dict(variant="FLASHINFER", error=fi.left_out))
    elif use_flashinfer:
        try:
            fn = flashinfer_fn(inp)
            poison_next_output(inp)
            err = rel_err(fn(), ref)
            rows.insert(0, dict(variant="FLASHINFER", err=err))
            if err < TOLERANCE:
                fns["FLASHINFER"] = fn
            else:
                rows[0]["error"] = "wrong result: not timed"
        except Exception as exc:
            rows.insert(0, dict(variant="FLASHINFER", error=f"{type(exc).__name__}: {str(exc)[:300]}"))
    for _ in range(args.rounds):  # all variants once per round: drift shows as a spread
        for row in rows:
            if row["variant"] in fns:
                row.setdefault("us_rounds", []).append(time_us(fns[row["variant"]], args.rep_ms))
    for row in rows:
        if row.get("us_rounds"):
            row["us"] = min(row["us_rounds"])
            row["spread"] = (max(row["us_rounds"]) - min(row["us_rounds"])) / row["us"]
            row["tbs"], row["tflops"] = am.rates(batch, seq_len, row["us"] / 1e3)
    fi = next((r.get("us") for r in rows if r["variant"] == "FLASHINFER"), None)
    base = next((r.get("us") for r in rows if r["variant"].startswith("default")), None)
    for row in rows:
        if row.get("us"):
            row["vs_flashinfer"] = fi / row["us"] if fi else None
            row["vs_default"] = base / row["us"] if base else None
        row["shape"] = f"{batch}x{seq_len}"
    del inp, fns
    if am.DEVICE == "cuda":
        torch.cuda.empty_cache()
    print(f"[{time.time() - t0:.0f}s] {batch}x{seq_len} timed", flush=True)
    return rows


def format_table(rows: list[dict], device: str) -> str:
    lines = [f"MLA decode, {device}: 128 heads, latent 512 + rope 64, page 64, bf16 (us: best of the rounds)",
             "| batch x kv len | variant | us | spread | TFLOP/s | latent TB/s | vs FLASHINFER | vs default | "
             "rel err | graph err | splits |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    for r in rows:
        if "us" not in r:
            lines.append(f"| {r['shape']} | {r['variant']} | {r.get('error', '-')} | | | | | | "
                         f"{f(r.get('err'), '.1e')} | {f(r.get('graph_err'), '.1e')} | |")  # fmt: skip
            continue
        lines.append(f"| {r['shape']} | {r['variant']} | {r['us']:.1f} | {r['spread']:.1%} | {r['tflops']:.0f} | "
                     f"{r['tbs']:.2f} | {f(r.get('vs_flashinfer'), '.2f')}x | {f(r.get('vs_default'), '.2f')}x | "
                     f"{r['err']:.1e} | {f(r.get('graph_err'), '.1e')} | {r.get('splits', '-')} |")  # fmt: skip
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, device: str) -> None:
    from bench.report import pyplot

    plt = pyplot()
    if plt is None:
        return
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 5), sharey=True, squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        mine = [r for r in rows if r["shape"] == shape]
        vals = [r.get("tflops") or 0.0 for r in mine]
        colors = ["tab:green" if r["variant"] == "FLASHINFER" else
                  "tab:gray" if r["variant"].startswith("default") else "tab:blue" for r in mine]  # fmt: skip
        ax.barh(range(len(mine)), vals, color=colors)
        ax.set_yticks(range(len(mine)))
        ax.set_yticklabels([r["variant"] for r in mine], fontsize=7)
        ax.invert_yaxis()
        for i, r in enumerate(mine):
            text = f"{r['vs_flashinfer']:.2f}x" if r.get("vs_flashinfer") else ("-" if "us" in r else "failed")
            ax.text(vals[i], i, f" {text}", va="center", fontsize=7)
        ax.set_title(f"MLA decode {shape}")
        ax.set_xlabel("TFLOP/s")
    fig.suptitle(f"TRITON MLA decode variants vs FlashInfer, {device} ({datetime.date.today()})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--shapes", default=",".join(f"{b}x{n}" for b, n in am.SHAPES))
    ap.add_argument("--only", default="", help="comma-separated substrings: the variants to run (default: all)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rep-ms", type=int, default=150, help="do_bench's repetition time per measurement")
    ap.add_argument("--flashinfer-build-s", type=int, default=150,
                    help="give up on FlashInfer when its JIT build is not done this many seconds after start")
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, float32, 16 heads, one tiny shape")
    args = ap.parse_args()
    if args.dry_run:
        am.DEVICE, am.DTYPE, am.HEADS = "cpu", torch.float32, 16
        args.shapes, args.rounds = "2x130", 1
    chosen = [v for v in variants() if not args.only or any(s in v.label for s in args.only.split(","))]
    device = torch.cuda.get_device_name() if am.DEVICE == "cuda" else "cpu (interpreter)"
    t0 = time.time()
    fi = FlashInferBuild(am.warm_flashinfer_in_background())
    rows: list[dict] = []
    args.out.mkdir(parents=True, exist_ok=True)
    for i, shape in enumerate(args.shapes.split(",")):
        batch, seq_len = (int(v) for v in shape.split("x"))
        rows += run_shape(batch, seq_len, chosen, args, fi=fi, first=i == 0, t0=t0)
        # After every shape, so that a call cut short by its time limit still brings numbers back.
        (args.out / "mla_decode_device.json").write_text(json.dumps(dict(device=device, rows=rows), indent=1))
    table = format_table(rows, device)
    (args.out / "mla_decode_device.md").write_text(table + "\n")
    plot(rows, args.out / "mla_decode_device.png", device)
    print(table)


if __name__ == "__main__":
    main()
