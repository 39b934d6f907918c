"""Compile the TRITON backend's kernels for a GPU target on a machine without one, and report them.

    python -m bench.kernel_report [--arch 90] [--sass DIR] [--prefill-sweep | --gluon]

Runs the backend's real launch path on CPU tensors with the kernel launch intercepted: every
launch is compiled with `triton.compile` for sm_<arch> instead of run, and cuobjdump reports the
registers, stack frame (spills) and shared memory of each variant. This catches compile errors and register
spills before any GPU time is spent; with --sass it also writes each kernel's SASS (to check
for wgmma/HGMMA in prefill and 16-byte loads in decode). --prefill-sweep compiles the TRITON
variants of bench/prefill_sweep.py instead and prints their registers, spills, shared memory,
resident CTAs per SM and TMA / cp.async load counts (the Gluon prefill's variants too: Gluon
does not run in the interpreter, so its compile errors show here first). The H200 has Triton 3.6:
to read its machine code here, install that wheel beside the venv's Triton and put it first on the path:
`pip install --no-deps --target /tmp/t36 triton==3.6.0; PYTHONPATH=/tmp/t36:. python -m bench.kernel_report`.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from meshserve.attention.backend import AttentionProblem, KVCache
from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.spec import AttentionSpec, KVCacheDtype

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


class Recorder:
    """Stands in for JITFunction.run: compiles each launch for `target` and keeps the result."""

    def __init__(self, target: GPUTarget, sass_dir: Path | None) -> None:
        self.target, self.sass_dir, self.rows, self.seen = target, sass_dir, [], set()
        self.label = ""  # names the SASS files of the next launches (else they are numbered)

    def __call__(self, fn: JITFunction, *args, grid, warmup, **kwargs):
        # The same binding and specialisation (16-byte alignment, divisibility by 16) as a launch.
        backend = make_backend(self.target)
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        launch = {k: kwargs[k] for k in LAUNCH_OPTIONS if k in kwargs}
        key = (fn.fn.__name__, tuple(sorted(constexprs.items())), tuple(sorted(launch.items())), str(attrs))
        if key in self.seen:
            return None
        self.seen.add(key)
        compiled = triton.compile(_source(fn)(fn, signature, constexprs, attrs), target=self.target,
                                  options=options.__dict__)  # fmt: skip
        named = {fn.params[path[0]].name: value for path, value in constexprs.items()}
        self.rows.append((fn.fn.__name__, launch, named, _resource_report(compiled)))
        if self.sass_dir is not None:
            self._write_sass(fn.fn.__name__, compiled)
        return None

    def _write_sass(self, name: str, compiled) -> None:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            sass = subprocess.run([str(CUOBJDUMP), "-sass", f.name], capture_output=True, text=True).stdout
        path = self.sass_dir / f"{name}_{self.label or len(self.rows)}.sass"
        path.write_text(sass)
        ops = ("HGMMA", "HMMA", "LDGSTS", "UTMALDG", "LDG.E.128", "LDL", "STL", "USETMAXREG", "MUFU.EX2")
        ops = {op: len(re.findall(op, sass)) for op in ops}
        self.rows[-1][3]["sass"] = ops


def _source(fn: JITFunction):
    """The compiler's source class of `fn`: Gluon kernels (kernels/prefill_gluon.py) have their own."""
    if type(fn).__name__.startswith("Gluon"):
        from triton.experimental.gluon._runtime import GluonASTSource

        return GluonASTSource
    return ASTSource


def _resource_report(compiled) -> dict:
    """Registers and stack frame (spilled registers land there) from the cubin, and shared memory;
    with warp specialisation, the register counts its warpgroups move to (setmaxnreg)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([str(CUOBJDUMP), "-res-usage", f.name], capture_output=True, text=True).stdout
    grab = lambda pat: int(m.group(1)) if (m := re.search(pat, text)) else -1  # noqa: E731
    # num_warps after compilation: warp specialisation adds producer warps to the ones asked for.
    moves = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", compiled.asm.get("ptx", ""))
    return dict(registers=grab(r"REG:(\d+)"), stack=grab(r"STACK:(\d+)"), shared=compiled.metadata.shared,
                warps=compiled.metadata.num_warps, setmaxnreg=sorted({(op, int(n)) for op, n in moves}))  # fmt: skip


def problems() -> list[tuple[str, AttentionProblem, list[int], list[int]]]:
    """(label, problem, query_lens, seq_lens): the benchmark shapes plus feature variants."""
    out = []
    for dtype in ("bfloat16", "float16", "float32"):
        for kv in (KVCacheDtype.AUTO, KVCacheDtype.FP8_E4M3):
            if dtype == "float32" and kv.is_fp8:
                continue
            spec = AttentionSpec(32, 8, 128, kv_cache_dtype=kv)
            out.append((f"{dtype} {kv} gqa32/8 d128", spec, dtype))
    out.append(("bf16 all features", AttentionSpec(32, 8, 128, sliding_window=512, num_sink_tokens=4, has_sinks=True,
                                                     use_alibi=True, logits_soft_cap=30.0), "bfloat16"))  # fmt: skip
    out.append(("bf16 d64", AttentionSpec(16, 2, 64), "bfloat16"))
    out.append(("bf16 d80", AttentionSpec(16, 4, 80), "bfloat16"))
    out.append(("bf16 d256", AttentionSpec(8, 1, 256), "bfloat16"))
    return [(label, AttentionProblem(spec, dtype=dt, block_size=16, max_model_len=65536, device="cuda",
                                     compute_capability=(9, 0)), [300, 1, 1], [300, 5000, 40000])
            for label, spec, dt in out]  # fmt: skip


def _literal(text: str):
    import ast

    return ast.literal_eval(text)


def prefill_sweep(recorder: Recorder, only: str = "") -> None:
    """Compile bench/prefill_sweep.py's TRITON variants at the bench's shapes (bf16, GQA 32/8,
    head 128) and print one line each: the machine code the H200 sweep will run. only: the
    variants whose label contains one of these comma-separated texts (default all)."""
    from bench.prefill_sweep import VARIANTS
    from meshserve.attention.backends.triton_paged import TritonBackend

    print("| variant | registers | stack | shared KB | warps | CTAs/SM (regs, smem) | UTMALDG | LDGSTS | LDL+STL |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for var in (v for v in VARIANTS if v.config is not None and any(o in v.label for o in only.split(","))):
        spec = AttentionSpec(32, 8, 128)
        prob = AttentionProblem(spec, dtype="bfloat16", block_size=var.page, max_model_len=65536, device="cuda",
                                compute_capability=(9, 0))  # fmt: skip
        per_seq = 4096 // var.page
        meta = AttentionMetadata.build(query_lens=[4096], seq_lens=[4096], block_tables=[list(range(per_seq))],
                                       block_size=var.page)  # fmt: skip
        backend = TritonBackend(prob, prefill_config=var.config)
        cache = KVCache(torch.empty(per_seq + 8, 2, var.page, 8, 128, dtype=torch.bfloat16))
        q = torch.empty(4096, 32, 128, dtype=torch.bfloat16)
        k, v = (torch.empty(4096, 8, 128, dtype=torch.bfloat16) for _ in range(2))  # the fresh variants read them
        recorder.label = var.label.replace(" ", "_")
        before = len(recorder.rows)
        try:
            backend.forward(q, k, v, cache, backend.plan(meta))
        except Exception as exc:  # a variant that does not compile is a finding, not the end
            print(f"| {var.label} | FAILED: {type(exc).__name__}: {str(exc)[:200]} |")
            continue
        for *_, rep in recorder.rows[before:]:
            threads = 32 * rep["warps"]
            by_regs = 65536 // (threads * max(rep["registers"], 1))
            by_smem = (227 * 1024) // max(rep["shared"], 1)
            sass = rep.get("sass", {})
            spills = sass.get("LDL", 0) + sass.get("STL", 0) if sass else "-"
            print(f"| {var.label} | {rep['registers']} | {rep['stack']} | {rep['shared'] / 1024:.0f} | "
                  f"{rep['warps']} | {min(by_regs, by_smem)} ({by_regs}, {by_smem}) | {sass.get('UTMALDG', '-')} | "
                  f"{sass.get('LDGSTS', '-')} | {spills} |", flush=True)  # fmt: skip


def gluon_prefill(recorder: Recorder) -> None:
    """Compile the Gluon prefill kernel (kernels/prefill_gluon.py) for heads 64 and 128, causal and
    full, with and without the LSE, on the Llama-3-8B head counts, and print one JSON line each:
    registers, stack, shared memory, warps, the setmaxnreg moves. Needs a process without
    TRITON_INTERPRET (the interpreter wraps Gluon functions, which then do not compile)."""
    import json

    from meshserve.attention.kernels import prefill_gluon as pg

    for head, causal, lse, overlap, stages in ((64, True, False, True, 2), (64, False, True, False, 2),
                                               (128, True, False, True, 2), (128, False, True, True, 2),
                                               (128, True, False, False, 2), (128, True, False, True, 3)):  # fmt: skip
        tokens, heads, kv_heads = 512, 32, 8
        q = torch.empty(tokens, heads, head, dtype=torch.bfloat16)
        kv = torch.empty(tokens, 2, kv_heads, head, dtype=torch.bfloat16)  # strided rows, as a layer's K/V
        out = torch.empty_like(q)
        lse_t = torch.empty(tokens, heads, dtype=torch.float32)
        ints = torch.zeros(8, dtype=torch.int32)
        refused = pg.gluon_prefill_reasons(q, kv[:, 0], kv[:, 1])
        # the launch the backend makes (its kernel call compiled by the recorder, not run)
        pg.gluon_fresh_prefill(q, kv[:, 0], kv[:, 1], out, lse_t, ints, ints, ints, 0.125, causal=causal,
                               return_lse=lse, overlap=overlap, stages=stages)  # fmt: skip
        name, _, _, rep = recorder.rows[-1]
        print(json.dumps(dict(rep, kernel=name, head=head, causal=causal, lse=lse, overlap=overlap, stages=stages,
                              refused=refused, consumer_regs=pg.CONSUMER_REGS, loader_regs=pg.LOADER_REGS)),
              flush=True)


def attention_launches(overrides: dict | None = None):
    """(label, launch) for each benchmark problem: the backend's KV write and forward.
    overrides: PrefillConfig fields replacing each problem's default prefill tiles."""
    from meshserve.attention.backend import LayerParams
    from meshserve.attention.backends.triton_paged import TritonBackend

    for label, prob, qlens, slens in problems():
        spec = prob.spec
        dt = getattr(torch, prob.dtype)
        kv_dt = torch.float8_e4m3fn if spec.kv_cache_dtype.is_fp8 else dt
        blocks = [list(range(i * 3000, i * 3000 + -(-s // 16))) for i, s in enumerate(slens)]
        meta = AttentionMetadata.build(query_lens=qlens, seq_lens=slens, block_tables=blocks, block_size=16)
        backend = TritonBackend(prob, num_sms=132)
        if overrides:
            cfg = dataclasses.replace(backend.prefill_cfg, **overrides)
            backend = TritonBackend(prob, num_sms=132, prefill_config=cfg)
        plan = backend.plan(meta)
        cache = KVCache(torch.empty(9000, 2, 16, spec.num_kv_heads, spec.head_size, dtype=kv_dt))
        n = sum(qlens)
        q = torch.empty(n, spec.num_heads, spec.head_size, dtype=dt)
        k = torch.empty(n, spec.num_kv_heads, spec.head_size, dtype=dt)
        layer = LayerParams(sinks=torch.zeros(spec.num_heads), alibi_slopes=torch.zeros(spec.num_heads))

        def launch(backend=backend, k=k, cache=cache, meta=meta, q=q, plan=plan, layer=layer):
            backend.write_kv(k, k, cache, meta.slot_mapping)
            backend.forward(q, k, k, cache, plan, layer=layer, return_lse=True)

        yield label, launch


def report_parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--sass", type=Path, default=None, help="write each kernel's SASS here")
    return ap


def compile_report(launches, description: str, args: argparse.Namespace | None = None) -> int:
    """Parse --arch/--sass (unless `args` are given), run each (label, launch) with every kernel
    launch compiled for that target instead of run, and print each new variant's resources and
    a spill summary. `launches` may be a function of the Recorder instead (it prints its own)."""
    args = args or report_parser(description).parse_args()
    if args.sass:
        args.sass.mkdir(parents=True, exist_ok=True)
    recorder = Recorder(GPUTarget("cuda", args.arch, 32), args.sass)
    original = JITFunction.run
    JITFunction.run = lambda self, *a, grid, warmup, **kw: recorder(self, *a, grid=grid, warmup=warmup, **kw)
    try:
        if callable(launches):
            launches(recorder)
            return 0
        for label, launch in launches:
            before = len(recorder.rows)
            launch()
            for name, options, _, rep in recorder.rows[before:]:
                print(f"{label:32s} {name:18s} {options} {rep}", flush=True)
    finally:
        JITFunction.run = original
    spilled = [r for r in recorder.rows if r[3]["stack"] > 0]
    print(f"{len(recorder.rows)} kernel variants compiled for sm_{args.arch}; {len(spilled)} with a stack frame")
    return 0


def main() -> int:
    ap = report_parser(__doc__.splitlines()[0])
    ap.add_argument("--prefill-sweep", action="store_true", help="compile bench/prefill_sweep.py's variants only")
    ap.add_argument("--only", default="", help="with --prefill-sweep: variants whose label contains one of these "
                    "comma-separated texts")
    ap.add_argument("--gluon", action="store_true", help="compile the Gluon prefill's variants only (JSON lines)")
    ap.add_argument("--prefill", default="", help="PrefillConfig fields for every problem's default prefill "
                    "tiles, e.g. 'kv_desc=True,max_registers=168'")  # fmt: skip
    args = ap.parse_args()
    if args.prefill_sweep:
        return compile_report(lambda recorder: prefill_sweep(recorder, args.only), "", args)
    if args.gluon:
        return compile_report(gluon_prefill, "", args)
    overrides = {k: _literal(v) for k, v in (kv.split("=") for kv in args.prefill.split(",") if kv)}
    return compile_report(attention_launches(overrides), "", args)


if __name__ == "__main__":
    raise SystemExit(main())
