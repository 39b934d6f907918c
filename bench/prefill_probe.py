"""Where a lone prompt's time to first token goes, offline, on CUDA (issue 41's TTFT baseline).

    python3 -m bench.prefill_probe --out $OUT [--input-len 512] [--variants default,no-warmup,...]

On 2026-12-06 the offline TTFT of a lone 512-token prompt (8B shape, TRITON) read 34 ms on an
H100 where it had read 15-17 ms on the two days before. This probe separates the candidates, one
fresh `LLM` per variant, same checkpoint, same prompt lengths:
  default     the engine as `serve` and `LLM` run it
  eager-prefill  without the piecewise graphs of steps with prefill tokens (piecewise_graph_tokens=0)
  no-warmup   without the start-up warm-up (engine/warmup.py)
  no-fresh    TRITON's fresh-prompt tiles off (fresh prompts read the pages, as before 2026-12-05)
  sync        without overlap scheduling
  page64      pages of 64 (TRITON's page-descriptor tiles)
Per variant: TTFT p50 / min / max over --repeats prompts (after 3 unmeasured), the engine steps a
prompt takes, the wall time inside each `core.step()`, and a torch-profiler pass over one
prompt: GPU-busy ms (kernel time summed), kernels, and the slowest kernels. GPU busy close to
the TTFT says the device is the limit; a TTFT well above it says the host is.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from bench.common import random_prompts, sync
from bench.e2e import LLAMA3_8B, TINY, gpu_profile, write_checkpoint
from bench.report import pyplot

VARIANTS = ("default", "eager-prefill", "no-warmup", "no-fresh", "sync", "page64")


@contextmanager
def _no_fresh_tiles():
    """TRITON without its fresh-prompt tiles: the measured default config made to say None."""
    from meshserve.attention.backends import triton_paged

    saved = triton_paged.fresh_prefill_config
    triton_paged.fresh_prefill_config = lambda *a, **k: None
    try:
        yield
    finally:
        triton_paged.fresh_prefill_config = saved


def _kwargs(variant: str, args: argparse.Namespace) -> dict:
    kw = dict(dtype=args.dtype, attention_backend=args.attention_backend, device=args.device,
              max_model_len=512 if args.tiny else 4096, kv_cache_memory_bytes=(64 << 20) if args.tiny else (8 << 30),
              max_num_seqs=16, max_num_batched_tokens=8192, progress=False)
    if variant == "eager-prefill":
        kw["piecewise_graph_tokens"] = 0
    if variant == "no-warmup":
        kw["warmup"] = False
    if variant == "sync":
        kw["async_scheduling"] = False
    if variant == "page64":
        kw["block_size"] = 64
    return kw


def one_prompt(llm, prompt: list[int], device: str) -> tuple[float, list[float]]:
    """(seconds to the first token, wall seconds of each core.step() on the way)."""
    from meshserve import SamplingParams

    core = llm.core
    req = core.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    steps = []
    sync(device)
    t0 = time.perf_counter()
    while not req.output_ids:
        s = time.perf_counter()
        core.step()
        steps.append(time.perf_counter() - s)
    sync(device)
    elapsed = time.perf_counter() - t0
    while core.has_unfinished():
        core.step()
    return elapsed, steps


def _profiled(llm, prompt: list[int], device: str, steps: int) -> None:
    one_prompt(llm, prompt, device)


def variants_profiled(args: argparse.Namespace) -> str:
    return args.variants.split(",")[0]


def host_profile(llm, prompt: list[int], args: argparse.Namespace) -> None:
    """Where the host's time of one prompt goes: cProfile (self time per function, then the
    cumulative time of the engine's own functions), and torch's CPU-side op totals."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    prof = cProfile.Profile()
    prof.runcall(one_prompt, llm, prompt, args.device)
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats("meshserve", 40)
    print(text.getvalue(), flush=True)
    with profile(activities=[ProfilerActivity.CPU]) as tprof:
        one_prompt(llm, prompt, args.device)
    print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)


def probe(path: Path, variant: str, args: argparse.Namespace, vocab: int) -> dict:
    from meshserve import LLM

    ctx = _no_fresh_tiles() if variant == "no-fresh" else nullcontext()
    with ctx:
        t0 = time.perf_counter()
        llm = LLM(str(path), **_kwargs(variant, args))
        start_s = time.perf_counter() - t0
        prompts = random_prompts(args.repeats + 4, args.input_len, vocab, 7)
        for p in prompts[:3]:
            one_prompt(llm, p, args.device)
        runs = [one_prompt(llm, p, args.device) for p in prompts[3:-1]]
        ttfts = [r[0] * 1e3 for r in runs]
        busy, kernels, by_name = float("nan"), float("nan"), []
        if args.device == "cuda":
            last = prompts[-1]
            busy, kernels, by_name = gpu_profile(functools.partial(_profiled, llm, last, args.device), 1)
        if args.host_profile and variant == variants_profiled(args):
            host_profile(llm, prompts[-1], args)
        llm.shutdown()
    del llm
    if args.device == "cuda":
        torch.cuda.empty_cache()
    steps = [[round(s * 1e3, 2) for s in r[1]] for r in runs]
    row = {"variant": variant, "start_s": start_s, "ttft_p50": statistics.median(ttfts), "ttft_min": min(ttfts),
           "ttft_max": max(ttfts), "steps": statistics.median(len(s) for s in steps), "step_ms": steps[:5],
           "busy_ms": busy * 1e3, "kernels": kernels, "top": [(n, c, round(us, 1)) for n, c, us in by_name[:10]]}
    print(f"{variant}: ready {start_s:.1f} s; TTFT p50 {row['ttft_p50']:.2f} ms (min {row['ttft_min']:.2f}, max "
          f"{row['ttft_max']:.2f}); {row['steps']} steps, first five prompts' steps (ms) {row['step_ms']}; "
          f"GPU busy {row['busy_ms']:.2f} ms, {kernels:.0f} kernels", flush=True)
    for name, count, us in row["top"]:
        print(f"    {count:5.0f} x {us:9.1f} us  {name}", flush=True)
    return row


def plot(rows: list[dict], path: Path, title: str) -> None:
    """TTFT p50 (min-max as the error bar) beside GPU-busy ms, one pair of bars per variant."""
    plt = pyplot()
    if plt is None or not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = range(len(rows))
    p50 = [r["ttft_p50"] for r in rows]
    err = [[p - r["ttft_min"] for p, r in zip(p50, rows)], [r["ttft_max"] - p for p, r in zip(p50, rows)]]
    ax.bar([x - 0.2 for x in xs], p50, 0.4, yerr=err, capsize=3, label="TTFT p50 (min-max)")
    ax.bar([x + 0.2 for x in xs], [r["busy_ms"] for r in rows], 0.4, label="GPU busy")
    ax.set_xticks(list(xs), [r["variant"] for r in rows], rotation=20)
    ax.set(ylabel="ms", title=title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--attention-backend", default="TRITON")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--tiny", action="store_true", help="the 2-layer toy shape, float32 (a CPU smoke run)")
    ap.add_argument("--host-profile", action="store_true", help="cProfile and torch's CPU op totals of one prompt "
                    "of the first variant")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    shape = TINY if args.tiny else LLAMA3_8B
    args.dtype = "float32" if args.tiny else "bfloat16"
    workdir = Path(tempfile.mkdtemp(prefix="meshserve_probe_"))
    rows = []
    try:
        t0 = time.perf_counter()
        write_checkpoint(workdir, shape, getattr(torch, args.dtype), args.device)
        print(f"checkpoint written in {time.perf_counter() - t0:.1f} s", flush=True)
        for v in variants:
            try:
                rows.append(probe(workdir, v, args, shape["vocab_size"]))
            except Exception as exc:  # one variant's failure must not cost the others
                print(f"{v}: failed: {type(exc).__name__}: {exc}"[:400], flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\n| variant ({args.input_len} tokens, {args.attention_backend}) | TTFT p50 ms | min | max | steps | "
          "GPU busy ms | kernels |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['variant']} | {r['ttft_p50']:.2f} | {r['ttft_min']:.2f} | {r['ttft_max']:.2f} | {r['steps']} | "
              f"{r['busy_ms']:.2f} | {r['kernels']:.0f} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "prefill_probe.json").write_text(json.dumps(rows, indent=1))
        title = f"a lone {args.input_len}-token prompt ({args.attention_backend})"
        plot(rows, Path(args.out) / "prefill_probe.png", title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
