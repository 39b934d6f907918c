"""bf16 weights on the split-K GEMV (workers/quant/gemv.py) against bf16 cuBLAS and small_m.py, per
decode projection of three model shapes, in one device call (~4-5 min warm):

    . bench/device_setup.sh && python3 bench/kernels_device.py --part gemv16 --out $OUT
    PYTHONPATH=$PWD python bench/kernels_device.py --part gemv16 --smoke     (CPU, interpreter)

Shapes (N x K, bias): Llama-3-8B qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down
4096x14336; GPT-OSS-20B attention (hidden 2880, 64 q heads x 64, 8 kv heads) qkv 5120x2880 and o
2880x4096, both with bias; DeepSeek-V2-Lite's dense GEMVs q 3072x2048, kv_a 576x2048, o
2048x2048, shared-expert gate_up 5632x2048 (meshserve runs it as two 2816x2048 linears, gate and
up) and down 2048x2816. M = 1, 4, 16.
1. check: every GemvConfig in gemv.CONFIGS (the cores ones at M = 1 only) on every shape and M
   against a float64 product x @ W^T (+ b): every output within half a bf16 ulp (2**-8 relative)
   plus 2**-16 of the sum of |terms| (float32 accumulation over K <= 14336 terms), finite over
   NaN-poisoned memory, two calls bitwise equal, tile counters zero after; then a CUDA-graph
   replay of a split GEMV (both kernels) equal to eager. small_m.py's stream kernel is checked
   alike. A config that fails (a compile that runs out of shared memory: a bf16 step takes twice
   an FP8 one's bytes) is reported and never timed.
2. graphs: per shape, M and method, L distinct copies of the projection (at least 1 GB of
   weights, 4..256 layers: nothing stays in L2) captured in one CUDA graph, median of 20
   replays: µs per projection, weight TB/s, ratio to cuBLAS. Methods: bf16 cuBLAS (F.linear, bias
   in its epilogue), the GEMV with gemv.DENSE_CONFIG and DENSE_CORES_CONFIG (M = 1), small_m.py,
   then every other passing config (what the budget leaves).
3. summary: per model (one layer: the sum of its projections) and M, each method's µs and
   ratio to cuBLAS; the fastest tensor-core config over everything and the fastest cores config
   (what DENSE_CONFIG / DENSE_CORES_CONFIG should be), and the gemm_table small_m_dense rows the
   numbers support. kernels_device_gemv16.json and .png under --out.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from bench.common import graph_replay_ms, graph_replays_equal

SHAPES = {
    "llama3-8b": {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate_up": (28672, 4096, False),
                  "down": (4096, 14336, False)},
    "gpt-oss-20b": {"qkv": (5120, 2880, True), "o": (2880, 4096, True)},
    "deepseek-v2-lite": {"q": (3072, 2048, False), "kv_a": (576, 2048, False), "o": (2048, 2048, False),
                         "shared_gate_up": (5632, 2048, False), "shared_down": (2048, 2816, False)},
}
SMOKE_SHAPES = {"tiny": {"qkv": (192, 256, True), "o": (100, 300, False)}}
MS = (1, 4, 16)
GRAPH_BYTES = 1 << 30  # weights per timed graph
MAX_LAYERS = 256
CUBLAS, STREAM = "cublas", "stream"


def _gemv_name(i: int) -> str:
    return f"gemv[{i}]"


def _poison(device: str) -> None:
    if device == "cuda":
        free = torch.cuda.mem_get_info()[0]
        blob = torch.empty(min(free // 2, 2 << 30), dtype=torch.uint8, device=device)
        blob.fill_(0xFF)  # NaN in bf16/fp32: an unwritten output shows
        del blob


def _methods(failed: set[int]) -> dict[str, object]:
    """name -> fn(x, w, b) in timing order: cuBLAS, the dense default configs, small_m.py, then the
    other passing configs."""
    from meshserve.workers.quant import gemv as gv
    from meshserve.workers.quant.small_m import stream_linear

    out = {CUBLAS: lambda x, w, b: torch.nn.functional.linear(x, w, b)}
    first = [gv.CONFIGS.index(gv.DENSE_CONFIG), gv.CONFIGS.index(gv.DENSE_CORES_CONFIG)]
    order = first + [i for i in range(len(gv.CONFIGS)) if i not in first]
    for i in order[:2]:
        if i not in failed:
            out[_gemv_name(i)] = lambda x, w, b, c=gv.CONFIGS[i]: gv.weight_gemv(x, w, bias=b, config=c)
    if -1 not in failed:  # -1: the stream kernel's check
        out[STREAM] = lambda x, w, b: stream_linear(x, w, bias=b)
    for i in order[2:]:
        if i not in failed:
            out[_gemv_name(i)] = lambda x, w, b, c=gv.CONFIGS[i]: gv.weight_gemv(x, w, bias=b, config=c)
    return out


def _cores(method: str) -> bool:
    from meshserve.workers.quant import gemv as gv

    return method.startswith("gemv[") and gv.CONFIGS[int(method[5:-1])].cores


def _within(y: torch.Tensor, x: torch.Tensor, w64: torch.Tensor, b: torch.Tensor | None,
            rounding: float) -> tuple[bool, float, float]:
    """(every output within rounding |ref| + 2**-16 sum|terms|, relative error norm, worst excess);
    w64: the weight in float64."""
    ref = x.double() @ w64.T + (0 if b is None else b.double())
    terms = x.double().abs() @ w64.abs().T + (0 if b is None else b.double().abs())
    excess = (y.double() - ref).abs() - (rounding * ref.abs() + 2.0**-16 * terms)
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    return bool(torch.isfinite(y).all()) and bool((excess <= 0).all()), rel, excess.max().item()


def check(shapes: dict, device: str, dtype: torch.dtype) -> tuple[list[dict], set[int]]:
    """Correctness of every config and of small_m.py (index -1); returns the rows and the failed indexes."""
    from meshserve.workers.quant import gemv as gv
    from meshserve.workers.quant.small_m import stream_linear

    rows, failed = [], set()
    g = torch.Generator(device=device).manual_seed(0)
    kernels = [(i, lambda x, w, b, c=c: gv.weight_gemv(x, w, bias=b, config=c)) for i, c in enumerate(gv.CONFIGS)]
    kernels.append((-1, lambda x, w, b: stream_linear(x, w, bias=b)))
    for model, projections in shapes.items():
        for name, (n, k, has_bias) in projections.items():
            w = (torch.randn(n, k, device=device, generator=g) * 0.02).to(dtype)
            b = (torch.randn(n, device=device, generator=g) * 0.1).to(dtype) if has_bias else None
            w64 = w.double()
            for m in MS:
                x = torch.randn(m, k, device=device, generator=g).to(dtype)
                for i, fn in kernels:
                    if i >= 0 and gv.CONFIGS[i].cores and m != 1:
                        continue
                    try:
                        _poison(device)
                        y, y2 = fn(x, w, b), fn(x, w, b)
                        # half an ulp of bf16 (the interpreter's bf16 stores truncate: a whole one)
                        ok, rel, worst = _within(y, x, w64, b, 2.0**-8 if device == "cuda" else 2.0**-7)
                        clean = gv.counters_zeroed(x.device)
                        ok = ok and torch.equal(y, y2) and clean
                        why = "" if ok else f"rel {rel:.2e}, worst excess {worst:.3g}, repeatable " \
                            f"{torch.equal(y, y2)}, counters zeroed {clean}"
                    except Exception as exc:  # noqa: BLE001 - a compile or launch failure is a verdict
                        ok, rel, why = False, float("nan"), str(exc).splitlines()[0][:160]
                    rows.append({"model": model, "shape": name, "config": i, "m": m, "rel_err": rel, "ok": ok})
                    if not ok:
                        if i not in failed:
                            print(f"CHECK FAILED {'stream' if i < 0 else f'config {i} {gv.CONFIGS[i]}'} {model} "
                                  f"{name} M={m}: {why}", flush=True)
                        failed.add(i)
    if device == "cuda":
        rows += _graph_check(dtype, failed)
    print(f"check: {sum(r['ok'] for r in rows)}/{len(rows)} passed; failed configs: {sorted(failed) or 'none'} "
          f"(-1: small_m.py)", flush=True)
    return rows, failed


def _graph_check(dtype, failed: set[int]) -> list[dict]:
    """A split GEMV of the 8B o_proj shape (DENSE_CONFIG at M = 4, DENSE_CORES_CONFIG at M = 1),
    captured, replays the eager bits."""
    from meshserve.workers.quant import gemv as gv

    w = (torch.randn(4096, 4096, device="cuda") * 0.02).to(dtype)
    rows = []
    for cfg, m in ((gv.DENSE_CONFIG, 4), (gv.DENSE_CORES_CONFIG, 1)):
        index = gv.CONFIGS.index(cfg)
        x = torch.randn(m, 4096, device="cuda").to(dtype)
        try:
            eager = gv.weight_gemv(x, w, config=cfg)
        except Exception as exc:  # noqa: BLE001 - a launch failure is a verdict
            print(f"graph check config {index}: {str(exc).splitlines()[0][:160]}", flush=True)
            eager = None
        same = eager is not None and graph_replays_equal(
            eager, lambda cfg=cfg, x=x: gv.weight_gemv(x, w, config=cfg), f"config {index}")
        print(f"graph replay equals eager (config {index}, M = {m}): {same}", flush=True)
        rows.append({"model": "llama3-8b", "shape": "o", "config": index, "m": m, "rel_err": 0.0, "ok": same,
                     "graph": True})
        if not same:
            failed.add(index)
    return rows


def _graph_ms(step, device: str) -> float:
    """Median ms of 20 replays of `step` captured in one CUDA graph (NaN on CPU: run once)."""
    if device == "cpu":
        step()
        return float("nan")
    times, _ = graph_replay_ms(step)  # compiles and counters outside the capture
    return statistics.median(times)


def graphs(shapes: dict, device: str, dtype: torch.dtype, failed: set[int], deadline: float) -> list[dict]:
    """Per shape, M and method: µs per projection in a graph of L distinct copies. Two passes: cuBLAS,
    the dense default configs and small_m.py on every shape first, then the other passing configs
    until `deadline` (time.perf_counter())."""
    methods = _methods(failed)
    essential = list(methods)[:4]  # cuBLAS, DENSE_CONFIG, DENSE_CORES_CONFIG, small_m.py (those that passed)
    rows = []
    for names in (essential, [m for m in methods if m not in essential]):
        for model, projections in shapes.items():
            for name, (n, k, has_bias) in projections.items():
                if names is not essential and time.perf_counter() > deadline:
                    break  # out of budget: the other configs are left out (the summary says which)
                rows += _time_shape(model, name, n, k, has_bias, {m: methods[m] for m in names}, device, dtype)
    return rows


def _time_shape(model, name, n, k, has_bias, methods, device, dtype) -> list[dict]:
    nbytes = n * k * 2
    layers = 1 if device == "cpu" else max(4, min(MAX_LAYERS, -(-GRAPH_BYTES // nbytes)))
    g = torch.Generator(device=device).manual_seed(7)
    stack = [((torch.randn(n, k, device=device, generator=g) * 0.02).to(dtype),
              (torch.randn(n, device=device, generator=g) * 0.1).to(dtype) if has_bias else None)
             for _ in range(layers)]
    rows = []
    for m in MS:
        x = torch.randn(m, k, device=device).to(dtype)
        for method, fn in methods.items():
            if _cores(method) and m != 1:
                continue

            def step(fn=fn, x=x):
                for w, b in stack:
                    fn(x, w, b)

            try:
                ms = _graph_ms(step, device)
            except Exception as exc:  # noqa: BLE001 - one method's failure must not lose the rest
                print(f"graph {model} {name} M={m} {method}: failed ({str(exc).splitlines()[0][:120]})", flush=True)
                continue
            us = ms * 1e3 / layers
            rows.append({"model": model, "shape": name, "m": m, "method": method, "us": us, "layers": layers,
                         "tbs": nbytes / us / 1e6})
        cells = "  ".join(f"{r['method']} {r['us']:.1f} ({r['tbs']:.2f} TB/s)" for r in rows if r["m"] == m)
        print(f"graph {model} {name} {n}x{k} M={m} ({layers} layers) us: {cells}", flush=True)
    return rows


def _totals(rows: list[dict], m: int, model: str | None = None) -> dict[str, float]:
    """method -> µs summed over the shapes (of `model`; None: all), only methods timed on every one."""
    mine = [r for r in rows if r["m"] == m and (model is None or r["model"] == model)]
    shapes = {(r["model"], r["shape"]) for r in mine}
    out = {}
    for method in dict.fromkeys(r["method"] for r in mine):
        timed = [r["us"] for r in mine if r["method"] == method]
        if len(timed) == len(shapes):
            out[method] = sum(timed)
    return out


def suggest(rows: list[dict]) -> dict:
    """The configs and small_m_dense rows these timings support (sums over every shape)."""
    from meshserve.workers.quant import gemv as gv

    per_config: dict[str, float] = {}
    for m in MS:  # tensor-core configs: summed over every M; cores configs: M = 1
        for method, us in _totals(rows, m).items():
            if method.startswith("gemv["):
                per_config[method] = per_config.get(method, 0.0) + us
    tc = {k: v for k, v in per_config.items() if not _cores(k)}
    cores = {k: v for k, v in per_config.items() if _cores(k)}
    best_tc = min(tc, key=tc.get) if tc else None
    best_cores = min(cores, key=cores.get) if cores else None
    way = {CUBLAS: "GemmWay.DENSE_CUBLAS", STREAM: "GemmWay.STREAM"}
    table = []
    for m in MS:
        totals = _totals(rows, m)
        if not totals:
            continue
        cands = {method: us for method, us in totals.items() if method in (CUBLAS, STREAM)}
        if best_tc in totals:
            cands["GEMV"] = totals[best_tc]
        if m == 1 and best_cores in totals:
            cands["GEMV_CORES"] = totals[best_cores]
        best = min(cands, key=cands.get)
        table.append((m, way.get(best, f"GemmWay.{best}")))
    return {"dense_config": None if best_tc is None else str(gv.CONFIGS[int(best_tc[5:-1])]),
            "dense_cores_config": None if best_cores is None else str(gv.CONFIGS[int(best_cores[5:-1])]),
            "small_m_dense": table}


def summary(check_rows: list[dict], rows: list[dict], failed: set[int], shapes: dict) -> dict:
    from meshserve.workers.quant import gemv as gv

    print("\nsummary (bf16 weights; µs per projection in CUDA graphs of distinct weights)")
    print(f"check: {sum(r['ok'] for r in check_rows)}/{len(check_rows)} passed; failed (never timed): "
          f"{sorted(failed) or 'none'} (-1: small_m.py); DENSE_CONFIG = config "
          f"{gv.CONFIGS.index(gv.DENSE_CONFIG)}, DENSE_CORES_CONFIG = config {gv.CONFIGS.index(gv.DENSE_CORES_CONFIG)}")
    tips = suggest(rows)
    best_tc = next((f"gemv[{i}]" for i, c in enumerate(gv.CONFIGS) if str(c) == tips["dense_config"]), None)
    dense, cores = _gemv_name(gv.CONFIGS.index(gv.DENSE_CONFIG)), _gemv_name(gv.CONFIGS.index(gv.DENSE_CORES_CONFIG))
    print("| model | projection | M | cuBLAS µs (TB/s) | GEMV DENSE_CONFIG | GEMV best config | cores (M = 1) | "
          "small_m.py |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for model, projections in shapes.items():
        for name, (n, k, _) in projections.items():
            for m in MS:
                mine = {r["method"]: r for r in rows if (r["model"], r["shape"], r["m"]) == (model, name, m)}
                if CUBLAS not in mine:
                    continue
                base = mine[CUBLAS]["us"]

                def one(method, mine=mine, base=base):
                    r = mine.get(method)
                    return f"{r['tbs']:.2f} TB/s ({base / r['us']:.2f}x)" if r else "-"

                print(f"| {model} | {name} {n}x{k} | {m} | {base:.1f} ({mine[CUBLAS]['tbs']:.2f}) | {one(dense)} | "
                      f"{one(best_tc)} | {one(cores) if m == 1 else '-'} | {one(STREAM)} |")
    print("\nper model (one layer: the sum of its projections), µs and ratio to cuBLAS")
    print("| model | M | cuBLAS µs | GEMV (DENSE_CONFIG) | GEMV best config | cores (M = 1) | small_m.py | "
          "cuBLAS TB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for model in shapes:
        weight = sum(n * k * 2 for n, k, _ in shapes[model].values())
        for m in MS:
            t = _totals(rows, m, model)
            base = t.get(CUBLAS, float("nan"))

            def cell(method, t=t, base=base):
                return f"{t[method]:.1f} ({base / t[method]:.2f}x)" if method in t else "-"

            print(f"| {model} | {m} | {base:.1f} | {cell(dense)} | {cell(best_tc)} | "
                  f"{cell(cores) if m == 1 else '-'} | {cell(STREAM)} | {weight / base / 1e6:.2f} |")
    untimed = sorted({f"gemv[{i}]" for i in range(len(gv.CONFIGS)) if i not in failed}
                     - {r["method"] for r in rows})
    if untimed:
        print(f"not timed (budget): {untimed}")
    print(f"best tensor-core config over every shape and M (set gemv.DENSE_CONFIG): {tips['dense_config']}")
    print(f"best cores config at M = 1 (set gemv.DENSE_CORES_CONFIG): {tips['dense_cores_config']}")
    print(f"gemm_table small_m_dense by graph time (bucket bounds: the measured M; GEMV with the best "
          f"config): {tips['small_m_dense']}")
    return tips


def plot(rows: list[dict], path: Path) -> None:
    from bench.report import pyplot, save_figure
    from meshserve.workers.quant import gemv as gv

    plt = pyplot()
    if plt is None or not rows:
        return
    keep = [CUBLAS, _gemv_name(gv.CONFIGS.index(gv.DENSE_CONFIG)), _gemv_name(gv.CONFIGS.index(gv.DENSE_CORES_CONFIG)),
            STREAM]
    labels = list(dict.fromkeys(f"{r['model'][:8]} {r['shape']}" for r in rows))
    fig, axes = plt.subplots(len(MS), 1, figsize=(12, 3.2 * len(MS)))
    for ax, m in zip(axes, MS, strict=True):
        width = 0.8 / len(keep)
        for j, method in enumerate(keep):
            vals = [next((r["tbs"] for r in rows if f"{r['model'][:8]} {r['shape']}" == lab and r["m"] == m
                          and r["method"] == method), 0.0) for lab in labels]
            ax.bar([i + j * width for i in range(len(labels))], vals, width, label=method)
        ax.set_xticks([i + 0.4 for i in range(len(labels))], labels, fontsize=7, rotation=20)
        ax.set_ylabel(f"TB/s, M = {m}")
        ax.legend(fontsize=7, ncol=4)
    axes[0].set_title("bf16 decode GEMVs: cuBLAS vs the split-K GEMV vs small_m.py (CUDA graphs)")
    save_figure(fig, path)


def run(out: Path, *, smoke: bool, budget: float) -> int:
    """The whole part; returns 1 when the dense default configs failed their check."""
    from meshserve.workers.quant import gemv as gv

    device = "cpu" if smoke else "cuda"
    dtype = torch.bfloat16
    shapes = SMOKE_SHAPES if smoke else SHAPES
    t0 = time.perf_counter()
    if device == "cuda":
        import triton

        print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}", flush=True)
    check_rows, failed = check(shapes, device, dtype)
    print(f"[{time.perf_counter() - t0:.0f} s] check done", flush=True)
    rows = graphs(shapes, device, dtype, failed, deadline=t0 + budget)
    print(f"[{time.perf_counter() - t0:.0f} s] graphs done", flush=True)
    tips = summary(check_rows, rows, failed, shapes)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels_device_gemv16.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
         "configs": [str(c) for c in gv.CONFIGS], "check": check_rows, "graph": rows, "suggested": tips},
        indent=1))
    plot(rows, out / "kernels_device_gemv16.png")
    defaults = {gv.CONFIGS.index(gv.DENSE_CONFIG), gv.CONFIGS.index(gv.DENSE_CORES_CONFIG)}
    return 1 if failed & defaults else 0
