"""Causal prefill on one GPU: FlashInfer's paged prefill against the TRITON kernel's variants.

    python -m bench.prefill_sweep [--out DIR] [--only TEXT] [--iters N]

Cases: causal prefill 4 x 4096, 1 x 16384 and 8 x 1024 from the paged cache (GQA 32 / 8 heads,
head 128, bf16, random data, shuffled block tables), at pages of 16 and of 64 tokens. Variants
(VARIANTS below): FlashInfer's paged prefill at each page size; the TRITON kernel with pointer
gathers (today's path, kernels/config.py's tiles first) and with K/V pages through tensor
descriptors (TMA, kernels/kv_pages.py), over a handful of tiles, warps, stages and register caps.
Every case's prompts are fresh (no cached context), so the "fresh" variants read the step's own
contiguous K/V instead of the pages: FlashInfer's ragged prefill (ragged_prefill=True) and
TRITON's fresh_kv path by row descriptors ("fresh-desc", kernels/kv_rows.py: one load per tile
at any page size) or by pointers ("fresh-gather"), at pages 16 and 64. Every output is
first checked against a float32
reference (torch SDPA on the contiguous K/V, GQA expanded; spare cache slots hold NaN): a variant
that is wrong is reported and not timed. Compilation runs first in --jobs processes. Then CUDA events around
each call, L2 flushed before each, median of --iters calls after warm-up. Causal FLOPs =
4 * H * D * L^2 / 2 per sequence. Prints a table (TFLOP/s and the ratio to FlashInfer at page
16, the issue's reference, and at the same page) and writes prefill_sweep.json/.md/.png under
--out. `python -m bench.kernel_report --prefill-sweep` compiles the same variants for sm_90
without a GPU (registers, spills, shared memory).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from meshserve.attention.kernels.config import PrefillConfig

HEADS, KV_HEADS, HEAD = 32, 8, 128
CASES = ((4, 4096), (1, 16384), (8, 1024))
TOLERANCE = 2e-2  # bf16 output, relative to the largest reference magnitude (tests' bf16 bar)


@dataclass(frozen=True)
class Variant:
    page: int
    config: PrefillConfig | None  # None: FlashInfer
    note: str = ""
    ragged: bool = False  # FlashInfer only: its ragged prefill over the step's K/V

    @property
    def label(self) -> str:
        if self.config is None:
            return f"FlashInfer {'ragged ' if self.ragged else ''}p{self.page}"
        c = self.config
        path = ("fresh-" if c.fresh_kv else "") + ("gluon" if c.gluon else "desc" if c.kv_desc else "gather")
        extra = f" r{c.max_registers}" if c.max_registers else ""
        extra += " serial" if c.gluon and not c.gluon_overlap else ""
        return f"{path} {c.block_m}x{c.block_n} w{c.num_warps} s{c.num_stages}{extra} p{self.page}"


def _cfg(m: int, n: int, w: int, s: int, **kw) -> PrefillConfig:
    return PrefillConfig(block_m=m, block_n=n, num_warps=w, num_stages=s, **kw)


VARIANTS = (
    Variant(16, None),
    Variant(16, _cfg(128, 64, 4, 3), "default (gather)"),
    Variant(16, _cfg(256, 64, 8, 3), "long-prefill default (gather)"),
    Variant(16, _cfg(128, 64, 8, 3), "two 64-row warpgroups"),
    Variant(16, _cfg(64, 32, 4, 3, max_registers=168), "3 CTAs per SM"),
    Variant(16, _cfg(128, 64, 4, 3, kv_desc=True), "4 page loads per tile"),
    Variant(64, None),
    Variant(64, _cfg(128, 64, 4, 3), "default tiles, page 64"),
    Variant(64, _cfg(128, 64, 4, 3, kv_desc=True), "1 page load per tile"),
    Variant(64, _cfg(128, 64, 8, 3, kv_desc=True)),
    # The step's own K/V instead of the pages (every prompt here is fresh).
    Variant(16, None, "ragged over the step's K/V", ragged=True),
    Variant(64, None, "ragged over the step's K/V", ragged=True),
    Variant(16, _cfg(128, 64, 4, 3, kv_desc=True, fresh_kv=True), "1 row load per tile"),
    Variant(64, _cfg(128, 64, 4, 3, kv_desc=True, fresh_kv=True), "1 row load per tile"),
    Variant(16, _cfg(128, 64, 4, 3, fresh_kv=True), "step's K/V by pointers"),
    Variant(64, _cfg(128, 64, 4, 3, fresh_kv=True), "step's K/V by pointers"),
    # Compiled for sm_90 (bench.kernel_report): the fresh loads pipeline deeper, so 3 stages take
    # 128 KB of shared memory (1 CTA per SM); 2 stages, or 64-row tiles, keep 2 CTAs per SM.
    Variant(16, _cfg(128, 64, 4, 2, kv_desc=True, fresh_kv=True), "2 CTAs per SM"),
    Variant(16, _cfg(128, 64, 4, 2, fresh_kv=True), "2 CTAs per SM"),
    Variant(16, _cfg(64, 64, 4, 3, kv_desc=True, fresh_kv=True), "no spills, 2 CTAs per SM"),
    # Gluon (kernels/prefill_gluon.py): a TMA loader warp and two consumer warpgroups of 64 queries,
    # 128-key stages; the tiles are for the portable kernel where Gluon does not apply.
    Variant(16, _cfg(128, 64, 4, 2, kv_desc=True, fresh_kv=True, gluon=True), "Gluon, QK^T of the next tile overlaps"),
    Variant(16, _cfg(128, 64, 4, 2, kv_desc=True, fresh_kv=True, gluon=True, gluon_overlap=False),
            "Gluon, one tile at a time"),
    Variant(16, _cfg(128, 64, 4, 3, kv_desc=True, fresh_kv=True, gluon=True), "Gluon, 3-stage K/V ring (224 KB)"),
)


@dataclass
class Row:
    case: str
    variant: str
    page: int
    status: str  # "ok", "WRONG (err ...)", "FAILED: ..."
    err: float | None = None
    us: float | None = None
    tflops: float | None = None
    note: str = ""
    vs_fi16: float | None = None
    vs_fi_page: float | None = None
    vs_fi_best: float | None = None  # to the fastest FlashInfer row of the case (paged or ragged)


def _problem(spec, page: int, max_len: int, dtype: torch.dtype, device: str):
    from meshserve.attention.backend import AttentionProblem

    cc = torch.cuda.get_device_capability() if device == "cuda" else None
    return AttentionProblem(spec, dtype=str(dtype).removeprefix("torch."), block_size=page, max_model_len=max_len,
                            device=device, compute_capability=cc)  # fmt: skip


def _reference(q, k, v, batch: int, seq: int) -> torch.Tensor:
    """float32 causal attention on contiguous K/V (GQA expanded), [tokens, H, D]."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    group = HEADS // KV_HEADS
    qs = q.float().view(batch, seq, HEADS, HEAD).transpose(1, 2)
    ks = k.float().view(batch, seq, KV_HEADS, HEAD).transpose(1, 2).repeat_interleave(group, 1)
    vs = v.float().view(batch, seq, KV_HEADS, HEAD).transpose(1, 2).repeat_interleave(group, 1)
    return sdpa(qs, ks, vs, is_causal=True).transpose(1, 2).reshape(batch * seq, HEADS, HEAD)


def run_case(
    batch: int, seq: int, variants, iters: int, *, warm_only: bool = False, device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
) -> list[Row]:  # fmt: skip
    """One row per variant; warm_only: run each variant once (compiles it), check and time nothing.
    device "cpu" (TRITON_INTERPRET=1, float16, small cases): checks the bench itself, times nothing."""
    if not variants:
        return []
    from bench.common import rel_err, shuffled_tables
    from bench.common import time_us_l2_flushed as time_us
    from meshserve.attention.backend import KVCache
    from meshserve.attention.backends.flashinfer import FlashInferBackend
    from meshserve.attention.backends.triton_paged import TritonBackend
    from meshserve.attention.metadata import AttentionMetadata
    from meshserve.attention.spec import AttentionSpec

    gen = torch.Generator(device=device).manual_seed(seq + batch)
    spec = AttentionSpec(HEADS, KV_HEADS, HEAD)
    tokens = batch * seq
    q, k, v = (torch.randn(tokens, h, HEAD, device=device, dtype=dtype, generator=gen)
               for h in (HEADS, KV_HEADS, KV_HEADS))  # fmt: skip
    ref = None if warm_only else _reference(q, k, v, batch, seq)
    flops = 4 * batch * HEADS * HEAD * seq * seq / 2
    name = f"{batch}x{seq}"
    rows = []
    setups = {}  # page -> (metadata, cache filled through TRITON's write_kv)
    for var in variants:
        if var.page not in setups:
            per_seq = seq // var.page
            tables = shuffled_tables(batch, per_seq, torch.Generator().manual_seed(2))
            meta = AttentionMetadata.build(query_lens=[seq] * batch, seq_lens=[seq] * batch, block_tables=tables,
                                           block_size=var.page, device=device)  # fmt: skip
            # NaN in the spare blocks: a kernel that reads outside its pages shows up as wrong.
            data = torch.full((batch * per_seq + 8, 2, var.page, KV_HEADS, HEAD), float("nan"),
                              device=device, dtype=dtype)  # fmt: skip
            cache = KVCache(data)
            TritonBackend(_problem(spec, var.page, 2 * seq, dtype, device)).write_kv(k, v, cache, meta.slot_mapping)
            setups[var.page] = (meta, cache)
        meta, cache = setups[var.page]
        prob = _problem(spec, var.page, 2 * seq, dtype, device)
        row = Row(name, var.label, var.page, "ok", note=var.note)
        try:
            if var.config is None:
                backend = FlashInferBackend(prob, ragged_prefill=var.ragged)
                why = ["paged: " + r for r in backend.ragged_prefill_reasons(meta)] if var.ragged else []
            else:
                backend = TritonBackend(prob, prefill_config=var.config)
                why = _triton_fallbacks(backend, var.config, cache, q, k, v)
            if why:
                row.note = (row.note + "; " if row.note else "") + "fallback: " + "; ".join(why)
            plan = backend.plan(meta)
            fn = lambda b=backend, p=plan, c=cache: b.forward(q, k, v, c, p)  # noqa: E731
            if warm_only:
                fn()
                torch.cuda.synchronize()
                continue
            row.err = rel_err(fn(), ref)
            if not row.err <= TOLERANCE:  # NaN is wrong too
                row.status = f"WRONG (rel err {row.err:.2e})"
            elif device == "cuda":
                row.us = time_us(fn, warmup=2, iters=iters)
                row.tflops = flops / row.us / 1e6
        except Exception as exc:  # report it and keep measuring the rest
            row.status = f"FAILED: {type(exc).__name__}: {str(exc)[:160]}"
            if warm_only:
                continue
        print(f"  {name} {row.variant}: {row.status} {row.tflops and f'{row.tflops:.0f} TFLOP/s'}", flush=True)
        rows.append(row)
    fi = {r.page: r.tflops for r in rows if r.variant == f"FlashInfer p{r.page}" and r.tflops}  # paged
    fi_best = max((r.tflops for r in rows if r.variant.startswith("FlashInfer") and r.tflops), default=None)
    for r in rows:
        if r.tflops:
            r.vs_fi_best = r.tflops / fi_best if fi_best else None
            r.vs_fi16 = r.tflops / fi[16] if 16 in fi else None
            r.vs_fi_page = r.tflops / fi[r.page] if r.page in fi else None
    return rows


def _triton_fallbacks(backend, cfg: PrefillConfig, cache, q, k, v) -> list[str]:
    """Why TRITON runs another path than `cfg` asks for here (empty: the one asked for)."""
    if cfg.fresh_kv:
        why = ["pages: " + r for r in backend.fresh_kv_reasons(cfg)]
        if cfg.gluon and not why and (gluon := backend.gluon_prefill_reasons(q, k, v)):
            why = ["portable kernel: " + r for r in gluon]
        if cfg.kv_desc and not why and not cfg.gluon:
            why = ["row gather: " + r for r in backend.fresh_descriptor_reasons(cfg, k, v)]
        return why
    return ["page gather: " + r for r in backend.prefill_descriptor_reasons(cfg, cache)] if cfg.kv_desc else []


def _warm(labels: list[str], cases: list[tuple[int, int]]) -> None:
    """Compile these variants (Triton's and FlashInfer's on-disk caches), in a worker process."""
    chosen = [v for v in VARIANTS if v.label in labels]
    for batch, seq in cases:
        run_case(batch, seq, chosen, 0, warm_only=True)


def warm_in_parallel(variants, cases, jobs: int) -> None:
    """Compilation is most of a sweep's time; spread it over processes (the GPU is mostly idle).
    Both FlashInfer variants go to one worker: they share one JIT module."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    groups = [[v.label for v in variants if v.config is None]] + [[v.label] for v in variants if v.config]
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        for fut in [pool.submit(_warm, g, cases) for g in groups if g]:
            fut.result()


def table(rows: list[Row]) -> str:
    lines = ["| case | variant | µs | TFLOP/s | vs FlashInfer p16 | vs FlashInfer same page | vs best FlashInfer | "
             "max rel err | note |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    for r in rows:
        status = "" if r.status == "ok" else f"**{r.status}** "
        lines.append(f"| {r.case} | {r.variant} | {fmt(r.us, '.1f')} | {fmt(r.tflops, '.0f')} | "
                     f"{fmt(r.vs_fi16, '.2f')} | {fmt(r.vs_fi_page, '.2f')} | {fmt(r.vs_fi_best, '.2f')} | "
                     f"{fmt(r.err, '.1e')} | "
                     f"{status}{r.note} |")  # fmt: skip
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    from bench.report import pyplot

    plt = pyplot()
    if plt is None:
        return
    cases = list(dict.fromkeys(r.case for r in rows))
    fig, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 7), sharey=True, squeeze=False)
    colors = {"FlashInfer": "tab:green", "gather": "tab:blue", "desc": "tab:orange", "fresh-gather": "tab:purple",
              "fresh-desc": "tab:red", "fresh-gluon": "tab:brown"}  # fmt: skip
    for ax, case in zip(axes[0], cases):
        mine = [r for r in rows if r.case == case]
        vals = [r.tflops or 0.0 for r in mine]
        ax.barh(range(len(mine)), vals, color=[colors.get(r.variant.split()[0], "tab:gray") for r in mine])
        ax.set_yticks(range(len(mine)))
        ax.set_yticklabels([r.variant for r in mine], fontsize=7)
        ax.invert_yaxis()
        for i, r in enumerate(mine):
            text = f"{r.vs_fi16:.2f}x" if r.vs_fi16 else r.status.split(" ")[0]
            ax.text(vals[i], i, f" {text}", va="center", fontsize=7)
        ax.set_title(f"causal prefill {case}")
        ax.set_xlabel("TFLOP/s")
    fig.suptitle(f"TRITON prefill variants vs FlashInfer on {torch.cuda.get_device_name()} ({datetime.date.today()})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="folder for prefill_sweep.json, .md and .png")
    ap.add_argument("--only", default="", help="only variants whose label contains one of these comma-separated "
                    "texts (FlashInfer always)")
    ap.add_argument("--cases", default=",".join(f"{b}x{s}" for b, s in CASES), help="e.g. 4x4096,1x16384")
    ap.add_argument("--iters", type=int, default=10, help="timed calls per variant (median)")
    ap.add_argument("--jobs", type=int, default=8, help="processes compiling the variants first (0: none)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",") if c]
    variants = [v for v in VARIANTS if v.config is None or any(o in v.label for o in args.only.split(","))]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    t0 = time.time()
    if args.jobs > 0:
        warm_in_parallel(variants, cases, args.jobs)
        print(f"[{time.time() - t0:.0f}s] compiled in {args.jobs} processes", flush=True)
    for batch, seq in cases:
        rows += run_case(batch, seq, variants, args.iters)
        print(f"[{time.time() - t0:.0f}s] {batch}x{seq} done", flush=True)
    import triton

    command = "python -m bench.prefill_sweep " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = dict(date=str(datetime.date.today()), device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, command=command)  # fmt: skip
    try:
        import flashinfer

        meta["flashinfer"] = flashinfer.__version__
    except ImportError:
        pass
    (out / "prefill_sweep.json").write_text(json.dumps(dict(meta=meta, rows=[r.__dict__ for r in rows]), indent=1))
    (out / "prefill_sweep.md").write_text(table(rows) + "\n")
    plot(rows, out / "prefill_sweep.png")
    print(f"\n{meta}\n{table(rows)}", flush=True)
    best = {}
    for r in rows:
        if r.tflops and not r.variant.startswith("FlashInfer"):
            best.setdefault(r.case, r)
            best[r.case] = max(best[r.case], r, key=lambda x: x.tflops)
    for case, r in best.items():
        print(f"best TRITON at {case}: {r.variant}: {r.tflops:.0f} TFLOP/s, {r.vs_fi16 or 0:.2f}x FlashInfer p16, "
              f"{r.vs_fi_best or 0:.2f}x the best FlashInfer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
