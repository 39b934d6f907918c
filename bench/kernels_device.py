"""Issue 42 items 3-4 on the H200 in one device call: the FP8 split-K GEMV (workers/quant/gemv.py)
checked, then timed against its predecessor and its peers.

    . bench/device_setup.sh && python3 bench/kernels_device.py --out $OUT      (~4-6 min cold)
    PYTHONPATH=$PWD python bench/kernels_device.py --smoke                     (CPU, interpreter)

`--part gemv16`: the same GEMV on bf16 weights against bf16 cuBLAS and small_m.py, per projection
of the Llama-3-8B, GPT-OSS-20B attention and DeepSeek-V2-Lite decode GEMVs
(bench/kernels_device_gemv16.py). The FP8 part (the default, `--part fp8`):

1. check: every GemvConfig in gemv.CONFIGS, both scale layouts, at the Llama-3-8B shapes (and
   TP-8 qkv and DeepSeek's kv_a for the default), M = 1, 5, 16, against a float64 matmul of the
   dequantized weight: ||y - ref|| / ||ref|| < 5e-3 (bf16 output; at M = 5 one row of
   activations ~2**18, past fp16's range before the kernel's 2**-8 scale), every element written (the
   allocator's cache is poisoned with NaN first), two calls bitwise equal, tile counters zero
   after, a CUDA-graph replay equal to eager. A config that fails is reported and never timed.
2. layer: per projection at M = 1, 4, 16, µs (triton.testing.do_bench, median, L2 flushed between
   calls): bf16 cuBLAS, the GEMV (default config; at M = 1 also its CUDA-core kernel,
   CORES_CONFIG), small_m.py's streaming kernel, per-channel
   row-wise and rank-1 (unit-scale per-tensor `_scaled_mm` + rescale) and block-scaled cuBLASLt
   blockwise / Triton block formulations as fp8_linear runs them, and per-tensor `_scaled_mm` on
   pre-quantized activations (the cuBLASLt FP8 ceiling, not a serving path).
3. sweep: each passing GemvConfig on the four 8B projections at M = 1 (µs per layer).
4. graph: 32 layers x 4 projections captured in one CUDA graph (distinct weights: 15 GB of bf16,
   nothing stays in L2), median of 20 replays, M = 1, 4, 8, 16: bf16 cuBLAS, FP8 per-channel and
   block on the GEMV (default, the sweep's best config, the cores kernel at M = 1, and the
   default tiles with programmatic dependent launch), on small_m.py's kernel, and on the
   tiled formulations; the table rows for workers/quant/gemm_table.py that the numbers support.
Writes kernels_device.json and kernels_device.png under --out; the summary table is printed last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import graph_replay_ms, graph_replays_equal  # noqa: E402 (the repository on the path first: run as a script)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
EXTRA_SHAPES = {"qkv_tp8": (768, 4096), "kv_a_mla": (576, 7168)}
SMOKE_SHAPES = {"qkv": (192, 256), "o": (128, 128), "gate_up": (320, 128), "down": (128, 384)}
BLOCK = (128, 128)
TOL = 5e-3


def _formats(w: torch.Tensor) -> dict[str, tuple]:
    """bf16 weight [N, K] -> {'block': (wq, scale, block), 'channel': (wq, scale, None)}."""
    from meshserve.workers.quant.fp8 import quantize_fp8_block, quantize_fp8_per_channel

    return {"block": (*quantize_fp8_block(w, BLOCK), BLOCK), "channel": (*quantize_fp8_per_channel(w), None)}


def _dequantized64(wq, scale, block) -> torch.Tensor:
    from meshserve.workers.quant.fp8 import dequantize_fp8_block

    if block is None:
        return wq.double() * scale.double()[:, None]
    return dequantize_fp8_block(wq, scale, block, torch.float64)


def _poison(device: str) -> None:
    """Fill what the caching allocator holds free with NaN, so an unwritten output element shows."""
    if device == "cuda":  # the large pool (one blob) and the small pool (< 1 MB blocks): both
        free = torch.cuda.mem_get_info()[0]
        blobs = [torch.empty(min(free // 2, 2 << 30), dtype=torch.uint8, device=device)]
        blobs += [torch.empty(512 << 10, dtype=torch.uint8, device=device) for _ in range(64)]
        for blob in blobs:
            blob.fill_(0xFF)  # 0xFFFF... is NaN in bf16/fp32
        del blobs


def check(shapes, extra, device: str, dtype: torch.dtype) -> tuple[list[dict], set[int]]:
    """Correctness of every config; returns the rows and the indexes of configs that failed."""
    from meshserve.workers.quant import gemv as gv

    rows, failed = [], set()
    g = torch.Generator(device=device).manual_seed(0)
    for name, (n, k) in {**shapes, **extra}.items():
        w = (torch.randn(n, k, device=device, generator=g) * 0.02).to(dtype)
        for fmt, (wq, scale, block) in _formats(w).items():
            ref_w = _dequantized64(wq, scale, block)
            bias = torch.randn(n, device=device, generator=g).to(dtype) * 0.1
            for i, cfg in enumerate(gv.CONFIGS):
                if name in extra and i:
                    continue  # the narrow shapes: the default config only
                for m in (1,) if cfg.cores else (1, 5, 16):
                    x = torch.randn(m, k, device=device, generator=g).to(dtype)
                    if m == 5:  # one row of large activations: 2**16 .. 2**20 must not overflow the fp16 operand
                        x[2] *= 2.0**18
                    ref = x.double() @ ref_w.T + bias.double()
                    try:
                        _poison(device)
                        y = gv.weight_gemv(x, wq, scale, block, bias, config=cfg)
                        y2 = gv.weight_gemv(x, wq, scale, block, bias, config=cfg)
                        err = ((y.double() - ref).norm() / ref.norm()).item()
                        ok = bool(torch.isfinite(y).all()) and err < TOL and torch.equal(y, y2)
                        ok = ok and gv.counters_zeroed(x.device)
                        why = "" if ok else f"err {err:.2e}, finite {bool(torch.isfinite(y).all())}, " \
                            f"repeatable {torch.equal(y, y2)}"
                    except Exception as exc:  # noqa: BLE001 - a compile or launch failure is a verdict
                        ok, err, why = False, float("nan"), str(exc).splitlines()[0][:160]
                    rows.append({"shape": name, "format": fmt, "config": i, "m": m, "rel_err": err, "ok": ok})
                    if not ok:
                        failed.add(i)
                        print(f"CHECK FAILED config {i} {cfg} {name} {fmt} M={m}: {why}", flush=True)
    if device == "cuda":
        for row in _graph_check(dtype):
            rows.append(row)
            if not row["ok"]:
                failed.add(row["config"])
    bad = sorted(failed)
    print(f"check: {sum(r['ok'] for r in rows)}/{len(rows)} passed; failed configs: {bad or 'none'}", flush=True)
    return rows, failed


def _graph_check(dtype) -> list[dict]:
    """Graphs replay the eager bits: a split GEMV (qkv shape, default config), and a chain of
    three dependent GEMVs (o-shaped: each one's output is the next one's input) on every pdl
    config, captured, against the same chain eager on the default config (same tiles, same bits)."""
    from meshserve.workers.quant import gemv as gv

    n, k = SHAPES["qkv"]
    wq, scale, block = _formats((torch.randn(n, k, device="cuda") * 0.02).to(dtype))["block"]
    x = torch.randn(4, k, device="cuda").to(dtype)
    chain = [_formats((torch.randn(4096, 4096, device="cuda") * 0.05).to(dtype))["channel"] for _ in range(3)]

    def run_chain(cfg):
        y = x[:, :4096]
        for w, s, b in chain:
            y = gv.weight_gemv(y, w, s, b, config=cfg)
        return y

    cases = [(0, lambda: gv.weight_gemv(x, wq, scale, block), lambda: gv.weight_gemv(x, wq, scale, block))]
    cases += [(i, lambda: run_chain(None), lambda c=c: run_chain(c)) for i, c in enumerate(gv.CONFIGS) if c.pdl]
    rows = []
    for index, eager_fn, graph_fn in cases:
        try:
            eager = eager_fn()
            graph_fn()  # compile outside the capture
        except Exception as exc:  # noqa: BLE001 - a launch failure is a verdict
            print(f"graph check config {index}: {str(exc).splitlines()[0][:160]}", flush=True)
            eager = None
        same = eager is not None and graph_replays_equal(eager, graph_fn, f"config {index}")
        print(f"graph replay equals eager (config {index}): {same}", flush=True)
        rows.append({"shape": "qkv" if index == 0 else "o_chain", "format": "block" if index == 0 else "channel",
                     "config": index, "m": 4, "rel_err": 0.0, "ok": same, "graph": True})
    return rows


def _bench(fn, device: str) -> float:
    if device == "cpu":
        fn()
        return float("nan")
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def _calls(dtype):
    """method -> (weight format, fn(x, *weights)) for the per-projection and graph timings."""
    from meshserve.workers.quant.gemm_table import GemmTable, GemmWay
    from meshserve.workers.quant.gemv import CORES_CONFIG, weight_gemv
    from meshserve.workers.quant.layers import fp8_linear

    def table(block_way=GemmWay.TRITON_BLOCK, channel_way=GemmWay.CHANNEL_ROWWISE):
        return GemmTable(small_m_block=((16, block_way),), small_m_channel=((16, channel_way),))

    t_stream, t_blockwise, t_rescale = table(GemmWay.STREAM, GemmWay.STREAM), table(GemmWay.CUBLAS_BLOCKWISE), \
        table(channel_way=GemmWay.CHANNEL_RESCALE)
    t_tiled = table()
    return {
        "bf16_cublas": ("bf16", lambda x, w: torch.matmul(x, w.t())),
        "channel_gemv": ("channel", lambda x, w, s, b: weight_gemv(x, w, s, b)),
        "channel_stream": ("channel", lambda x, w, s, b: fp8_linear(x, w, s, b, small_m=True, table=t_stream)),
        "channel_rowwise": ("channel", lambda x, w, s, b: fp8_linear(x, w, s, b, small_m=True, table=t_tiled)),
        "channel_rescale": ("channel", lambda x, w, s, b: fp8_linear(x, w, s, b, small_m=True, table=t_rescale)),
        "block_gemv": ("block", lambda x, w, s, b: weight_gemv(x, w, s, b)),
        "channel_gemv_cores": ("channel", lambda x, w, s, b: weight_gemv(x, w, s, b, config=CORES_CONFIG)),
        "block_gemv_cores": ("block", lambda x, w, s, b: weight_gemv(x, w, s, b, config=CORES_CONFIG)),
        "block_stream": ("block", lambda x, w, s, b: fp8_linear(x, w, s, b, small_m=True, table=t_stream)),
        "block_triton": ("block", lambda x, w, s, b: fp8_linear(x, w, s, b, small_m=True, table=t_tiled)),
        "block_cublas": ("block", lambda x, w, s, b: fp8_linear(x, w, s, b, small_m=True, table=t_blockwise)),
        "pertensor_scaled_mm": ("pertensor", lambda xq, w, one: torch._scaled_mm(
            xq, w.t(), scale_a=one, scale_b=one, out_dtype=dtype)),
    }


def _weights_for(fmt: str, w: torch.Tensor, quant: dict) -> tuple:
    if fmt == "bf16":
        return (w,)
    if fmt == "pertensor":
        return (quant["channel"][0], torch.ones((), device=w.device))
    return quant[fmt]


def _x_for(fmt: str, x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn) if fmt == "pertensor" else x  # |x| < 448: the ceiling, not a serving path


def layer(shapes, device: str, dtype, ms=(1, 4, 16)) -> list[dict]:
    calls = _calls(dtype)
    rows = []
    g = torch.Generator(device=device).manual_seed(1)
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, device=device, generator=g) * 0.02).to(dtype)
        quant = _formats(w)
        for m in ms:
            x = torch.randn(m, k, device=device, generator=g).to(dtype)
            for method, (fmt, fn) in calls.items():
                if "cores" in method and m != 1:
                    continue
                args = _weights_for(fmt, w, quant)
                xin = _x_for(fmt, x)
                try:
                    us = _bench(lambda fn=fn, xin=xin, args=args: fn(xin, *args), device)
                except Exception as exc:  # noqa: BLE001 - e.g. _scaled_mm on CPU
                    print(f"layer {name} M={m} {method}: unavailable ({str(exc).splitlines()[0][:100]})", flush=True)
                    continue
                nbytes = sum(t.numel() * t.element_size() for t in args if isinstance(t, torch.Tensor))
                rows.append({"shape": name, "m": m, "method": method, "us": us, "tbs": nbytes / us / 1e6})
    return rows


def sweep(shapes, device: str, dtype, failed: set[int]) -> tuple[list[dict], int, int | None]:
    """Each passing config over one layer's four projections at M = 1; returns the rows, the best
    tensor-core config and the best cores config (None: none passed)."""
    from meshserve.workers.quant import gemv as gv

    rows = []
    g = torch.Generator(device=device).manual_seed(2)
    totals = {i: 0.0 for i in range(len(gv.CONFIGS)) if i not in failed}
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, device=device, generator=g) * 0.02).to(dtype)
        quant = _formats(w)
        x = torch.randn(1, k, device=device, generator=g).to(dtype)
        for fmt in ("channel", "block"):
            wq, scale, block = quant[fmt]
            for i in list(totals):
                us = _bench(lambda c=gv.CONFIGS[i], a=(x, wq, scale, block): gv.weight_gemv(*a, config=c), device)
                totals[i] += us
                rows.append({"shape": name, "format": fmt, "config": i, "us": us, "tbs": wq.numel() / us / 1e6})
    tensor_core = {i: t for i, t in totals.items() if not gv.CONFIGS[i].cores}
    best = min(tensor_core, key=lambda i: tensor_core[i]) if device == "cuda" and tensor_core else 0
    for i, total in totals.items():
        print(f"sweep config {i} {gv.CONFIGS[i]}: one layer (both formats) {total:8.1f} us", flush=True)
    for name in shapes:
        for fmt in ("channel", "block"):
            mine = [r for r in rows if r["shape"] == name and r["format"] == fmt]
            if mine and device == "cuda":
                top = min(mine, key=lambda r: r["us"])
                default = next((r for r in mine if r["config"] == 0), top)
                print(f"sweep {name:>8} {fmt:>7}: best config {top['config']} {top['us']:.1f} us "
                      f"({top['tbs']:.2f} TB/s); default {default['us']:.1f} us ({default['tbs']:.2f} TB/s)",
                      flush=True)
    cores = {i: t for i, t in totals.items() if gv.CONFIGS[i].cores}
    best_cores = (min(cores, key=lambda i: cores[i]) if device == "cuda" else next(iter(cores))) if cores else None
    print(f"sweep best (tensor-core configs, every M): config {best} {gv.CONFIGS[best]}", flush=True)
    if best_cores is not None:
        print(f"sweep best (cores configs, M = 1): config {best_cores} {gv.CONFIGS[best_cores]}", flush=True)
    return rows, best, best_cores


def graphs(shapes, device: str, dtype, best: int, best_cores: int | None, failed: set[int], layers: int,
           ms=(1, 4, 8, 16)) -> list[dict]:
    """Per method and M: `layers` x the four projections in one CUDA graph, median of 20 replays."""
    from meshserve.workers.quant import gemv as gv

    calls = _calls(dtype)
    best_cfg = gv.CONFIGS[best]
    if not best_cfg.cores:  # the sweep's best over every M; the cores kernel has its own rows (M = 1)
        calls["channel_gemv_best"] = ("channel", lambda x, w, s, b: gv.weight_gemv(x, w, s, b, config=best_cfg))
        calls["block_gemv_best"] = ("block", lambda x, w, s, b: gv.weight_gemv(x, w, s, b, config=best_cfg))
    pdl = next((i for i, c in enumerate(gv.CONFIGS) if c.pdl and not c.tma), None)
    if pdl is not None and pdl not in failed:  # back-to-back launches: where programmatic dependent launch shows
        pcfg = gv.CONFIGS[pdl]
        calls["channel_gemv_pdl"] = ("channel", lambda x, w, s, b: gv.weight_gemv(x, w, s, b, config=pcfg))
        calls["block_gemv_pdl"] = ("block", lambda x, w, s, b: gv.weight_gemv(x, w, s, b, config=pcfg))
    if best_cores is not None and gv.CONFIGS[best_cores] != gv.CORES_CONFIG:
        cfg = gv.CONFIGS[best_cores]
        calls["channel_gemv_cores_best"] = ("channel", lambda x, w, s, b: gv.weight_gemv(x, w, s, b, config=cfg))
        calls["block_gemv_cores_best"] = ("block", lambda x, w, s, b: gv.weight_gemv(x, w, s, b, config=cfg))
    t0 = time.perf_counter()
    stack = []  # per layer: {name: (bf16 w, quant formats)}
    for i in range(layers):
        g = torch.Generator(device=device).manual_seed(100 + i)
        per = {}
        for name, (n, k) in shapes.items():
            w = (torch.randn(n, k, device=device, generator=g) * 0.02).to(dtype)
            per[name] = (w, _formats(w))
        stack.append(per)
    print(f"graph weights: {layers} layers in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for m in ms:
        xs = {name: torch.randn(m, k, device=device).to(dtype) for name, (_, k) in shapes.items()}
        for method, (fmt, fn) in calls.items():
            if "cores" in method and m != 1:
                continue
            plan = [(fn, _x_for(fmt, xs[name]), _weights_for(fmt, w, q)) for per in stack
                    for name, (w, q) in per.items()]
            nbytes = sum(t.numel() * t.element_size() for _, _, args in plan for t in args
                         if isinstance(t, torch.Tensor) and t.dim() == 2)

            def step(plan=plan):
                for f, xin, args in plan:
                    f(xin, *args)

            try:
                if device == "cpu":
                    step()
                    rows.append({"m": m, "method": method, "ms": float("nan"), "tbs": 0.0})
                    continue
                times, _ = graph_replay_ms(step)  # compiles, probes and counters outside the capture
            except Exception as exc:  # noqa: BLE001 - one method's failure must not lose the rest
                print(f"graph M={m} {method}: failed ({str(exc).splitlines()[0][:120]})", flush=True)
                continue
            ms_ = statistics.median(times)
            rows.append({"m": m, "method": method, "ms": ms_, "spread_ms": max(times) - min(times),
                         "tbs": nbytes / ms_ / 1e9, "weight_gb": nbytes / 1e9})
            print(f"graph M={m:>2} {method:>20}: {ms_:7.3f} ms  {nbytes / ms_ / 1e9:5.2f} TB/s", flush=True)
    return rows


SERVING = {"channel": ("channel_gemv", "channel_gemv_cores", "channel_stream", "channel_rowwise", "channel_rescale"),
           "block": ("block_gemv", "block_gemv_cores", "block_stream", "block_triton", "block_cublas")}
WAY = {"gemv": "GEMV", "gemv_cores": "GEMV_CORES", "stream": "STREAM", "rowwise": "CHANNEL_ROWWISE",
       "rescale": "CHANNEL_RESCALE", "triton": "TRITON_BLOCK", "cublas": "CUBLAS_BLOCKWISE"}


def suggest(graph_rows: list[dict]) -> dict[str, list]:
    """Per format, the fastest serving formulation per measured M (graph timings), as gemm_table rows."""
    out = {}
    for fmt, methods in SERVING.items():
        rows = []
        for m in sorted({r["m"] for r in graph_rows}):
            timed = {r["method"]: r["ms"] for r in graph_rows if r["m"] == m and r["method"] in methods}
            if timed:
                best = min(timed, key=timed.get)
                rows.append((m, f"GemmWay.{WAY[best.split('_', 1)[1]]}"))
        out[fmt] = rows
    return out


def summary(layer_rows, graph_rows, best: int, check_rows) -> None:
    from meshserve.workers.quant import gemv as gv

    print("\nsummary")
    failed = sorted({r["config"] for r in check_rows if not r["ok"]})
    print(f"check: {sum(r['ok'] for r in check_rows)}/{len(check_rows)} passed (failed configs, never timed: "
          f"{failed or 'none'}); sweep best config {best}: {gv.CONFIGS[best]}")
    for m in sorted({r["m"] for r in layer_rows}):
        per = {}
        for r in layer_rows:
            if r["m"] == m:
                per[r["method"]] = per.get(r["method"], 0.0) + r["us"]
        base = per.get("bf16_cublas", float("nan"))
        cells = "  ".join(f"{k} {v:.1f} ({base / v:.2f}x)" for k, v in per.items())
        print(f"layer M={m:>2} us: {cells}")
    print("| M | graph | ms | weight TB/s | vs bf16 |")
    print("|---:|---|---:|---:|---:|")
    for m in sorted({r["m"] for r in graph_rows}):
        base = next((r["ms"] for r in graph_rows if r["m"] == m and r["method"] == "bf16_cublas"), float("nan"))
        for r in graph_rows:
            if r["m"] == m:
                print(f"| {m} | {r['method']} | {r['ms']:.3f} | {r['tbs']:.2f} | {base / r['ms']:.2f}x |")
    for fmt, rows in suggest(graph_rows).items():
        print(f"gemm_table small_m_{fmt} by graph time (bucket bounds: the measured M): {rows}")


def plot(graph_rows, path: Path) -> None:
    from bench.report import pyplot

    plt = pyplot()
    if plt is None or not graph_rows:
        return
    methods = list(dict.fromkeys(r["method"] for r in graph_rows))
    ms = sorted({r["m"] for r in graph_rows})
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / len(methods)
    for j, method in enumerate(methods):
        vals = [next((r["tbs"] for r in graph_rows if r["m"] == m and r["method"] == method), 0.0) for m in ms]
        ax.bar([i + j * width for i in range(len(ms))], vals, width, label=method)
    ax.set_xticks([i + 0.4 for i in range(len(ms))], [f"M={m}" for m in ms])
    ax.set_ylabel("weight TB/s (32-layer decode graph)")
    ax.set_title("FP8 decode GEMMs, H200: split-K GEMV vs streaming kernel vs cuBLAS(Lt)")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/out"))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--budget", type=float, default=420.0,
                    help="seconds for the whole run: the graphs shrink to M = 1 and 16 when less than 150 are left")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on CPU under TRITON_INTERPRET (times meaningless)")
    ap.add_argument("--part", choices=["fp8", "gemv16"], default="fp8",
                    help="fp8: FP8 weights (the default); gemv16: bf16 weights (bench/kernels_device_gemv16.py; "
                         "--budget: seconds after which only cuBLAS, the dense default configs and small_m.py are "
                         "timed)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part == "gemv16":
        from bench.kernels_device_gemv16 import run

        return run(args.out, smoke=args.smoke, budget=args.budget)
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16  # the interpreter has no bf16 math
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    extra = {} if args.smoke else EXTRA_SHAPES
    if device == "cuda":
        import triton

        print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}", flush=True)
    t0 = time.perf_counter()
    from meshserve.workers.quant.gemv import CONFIGS, CORES_CONFIG

    check_rows, failed = check(shapes, extra, device, dtype)
    print(f"[{time.perf_counter() - t0:.0f} s] check done", flush=True)
    untimed = set()  # serving methods whose config failed: reported, never timed
    if 0 in failed:
        untimed |= {"channel_gemv", "block_gemv"}
        print("the default GEMV config FAILED its check: not timed; fix before it serves", flush=True)
    if CONFIGS.index(CORES_CONFIG) in failed:
        untimed |= {"channel_gemv_cores", "block_gemv_cores"}
        print("the cores GEMV config FAILED its check: not timed", flush=True)
    layer_rows = [r for r in layer(shapes, device, dtype, ms=(1, 16) if args.smoke else (1, 4, 16))
                  if r["method"] not in untimed]
    print(f"[{time.perf_counter() - t0:.0f} s] layer done", flush=True)
    sweep_rows, best, best_cores = sweep(shapes, device, dtype, failed) if len(failed) < len(CONFIGS) \
        else ([], 0, None)
    print(f"[{time.perf_counter() - t0:.0f} s] sweep done", flush=True)
    short = args.smoke or time.perf_counter() - t0 > args.budget - 150
    graph_rows = [r for r in graphs(shapes, device, dtype, best, best_cores, failed, 1 if args.smoke else args.layers,
                                    ms=(1, 16) if short else (1, 4, 8, 16)) if r["method"] not in untimed]
    print(f"[{time.perf_counter() - t0:.0f} s] graphs done", flush=True)
    (args.out / "kernels_device.json").write_text(json.dumps(
        {"check": check_rows, "layer": layer_rows, "sweep": sweep_rows, "best_config": best,
         "best_cores_config": best_cores, "graph": graph_rows,
         "suggested_table": suggest(graph_rows)}, indent=1))
    plot(graph_rows, args.out / "kernels_device.png")
    summary(layer_rows, graph_rows, best, check_rows)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
