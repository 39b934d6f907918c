"""Decode and prefill GEMMs at Llama-3-8B's projection shapes, bf16 against every FP8 path, in one run:

    PYTHONPATH=$PWD python3 bench/quant_gemm.py [--out bench/results] [--reps 20] [--sweep] [--smoke]

Methods (one linear each; "layer" rows sum the four projections of one decoder layer):
- bf16            torch.matmul (cuBLAS; at M <= 16 with its split-K reduction kernel where it picks one)
- bf16_small_m    the weight-streaming kernel on bf16 weights (quant/small_m.py), M <= 16
- fp8_small_m_block / fp8_small_m_channel   the same kernel on FP8 weights, W8A16 (what FP8
                  checkpoints / online FP8 run at M <= 16), M <= 16
- scaled_mm_tensor  torch._scaled_mm per-tensor FP8, activations pre-quantized (the issue's peer)
- block_gemm      the Triton block GEMM alone, activations pre-quantized
- block           per-token-group activation quantization + block GEMM (FP8 checkpoints, M > 16)
- online_channel  per-token activation quantization (one Triton kernel) + _scaled_mm row-wise
                  (online FP8, M > 16)
- torch_blockwise torch's own 1x128 x 128x128 block-scaled F.scaled_mm, activations pre-quantized
                  (the peer of block_gemm), where this torch/GPU has it
- block_cublas    per-token-group quantization into torch's scale layout + torch_blockwise
                  (fp8_cublas.block_linear_cublas, probe included)
- channel_rescale / channel_rescale_bf16raw   online FP8 as per-token quantization + per-tensor
                  _scaled_mm with unit scales (raw product in float32 / bf16) + the rank-1 rescale
- block_wired / channel_wired   fp8_linear as the layers call it (gemm_table.DEFAULT_TABLE, small-M
                  kernel off): what a served FP8 model runs at this M
Per cell: median microseconds (triton.testing.do_bench: warm-up, L2 flushed, random data) and
weight-read TB/s; speed-ups against bf16. Then a CUDA graph of 32 layers x 4 projections at M = 1
(bench/quant_gemm_decode.py): the decode step's GEMM time per weight format and kernels per
step. `--sweep` also times alternative small-M tilings (which plan_stream should pick). Writes
quant_gemm.json and quant_gemm.png to --out; prints one short summary table last. `--smoke`:
tiny shapes on CPU (TRITON_INTERPRET), checks that every method runs and agrees; times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import torch

from bench.report import pyplot

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SMOKE_SHAPES = {"qkv": (96, 64), "o": (64, 64), "gate_up": (160, 64), "down": (64, 160)}
MS = (1, 16, 64, 4096)
SMOKE_MS = (1, 16, 64)
METHODS = ("bf16", "bf16_small_m", "fp8_small_m_block", "fp8_small_m_channel", "scaled_mm_tensor", "block_gemm",
           "block", "online_channel", "torch_blockwise", "block_cublas", "channel_rescale", "channel_rescale_bf16raw",
           "block_wired", "channel_wired")
SMALL_ONLY = {"bf16_small_m", "fp8_small_m_block", "fp8_small_m_channel"}
_SAID: set[str] = set()


def say_once(text: str) -> None:
    if text not in _SAID:
        _SAID.add(text)
        print(text, flush=True)


def weight_bytes(method: str, n: int, k: int) -> float:
    """Bytes of weights (and scales) one call reads."""
    if method.startswith("bf16"):
        return 2.0 * n * k
    if "block" in method:
        return n * k + 4.0 * -(-n // 128) * -(-k // 128)
    return n * k + 4.0 * n


def cases(m: int, n: int, k: int, device: str) -> dict[str, tuple[callable, torch.Tensor]]:
    """method -> (callable, its float32 reference output) for one shape; x and W random."""
    from meshserve.workers.quant.fp8 import (
        dequantize_fp8_block,
        quantize_fp8_block,
        quantize_fp8_per_channel,
        quantize_per_token_group,
    )
    from meshserve.workers.quant.fp8_cublas import block_linear_cublas, channel_rescale_linear
    from meshserve.workers.quant.fp8_triton import block_gemm, fp8_block_linear
    from meshserve.workers.quant.layers import _scaled_mm_per_channel, fp8_linear
    from meshserve.workers.quant.small_m import SMALL_M_MAX, stream_linear

    g = torch.Generator(device=device).manual_seed(m * 7 + n + k)
    x = torch.randn(m, k, device=device, generator=g).bfloat16()
    w = (torch.randn(n, k, device=device, generator=g) * 0.02).bfloat16()
    if device == "cpu":  # the interpreter: float32 activations/weights where bf16 math would be wrong
        x, w = x.float(), w.float()
    wq_b, ws_b = quantize_fp8_block(w, (128, 128))
    wq_c, ws_c = quantize_fp8_per_channel(w)
    xq_g, xs_g = quantize_per_token_group(x, 128)
    x_amax, w_amax = x.float().abs().max() / 448, w.float().abs().max() / 448
    xq_t, wq_t = (x.float() / x_amax).to(torch.float8_e4m3fn), (w.float() / w_amax).to(torch.float8_e4m3fn)
    fns = {
        "bf16": lambda: torch.matmul(x, w.t()),
        "scaled_mm_tensor": lambda: torch._scaled_mm(xq_t, wq_t.t(), scale_a=x_amax.float(), scale_b=w_amax.float(),
                                                     out_dtype=torch.bfloat16),
        "block_gemm": lambda: block_gemm(xq_g, xs_g, wq_b, ws_b, (128, 128), x.dtype),
        "block": lambda: fp8_block_linear(x, wq_b, ws_b, (128, 128)),
        "online_channel": lambda: _scaled_mm_per_channel(x, wq_c, ws_c),
        "channel_rescale": lambda: channel_rescale_linear(x, wq_c, ws_c),
        "channel_rescale_bf16raw": lambda: channel_rescale_linear(x, wq_c, ws_c, raw_dtype=torch.bfloat16),
        "block_wired": lambda: fp8_linear(x, wq_b, ws_b, (128, 128)),
        "channel_wired": lambda: fp8_linear(x, wq_c, ws_c, None),
    }
    blockwise = _torch_blockwise(xq_g, xs_g, wq_b, ws_b) if device == "cuda" else None
    if blockwise is not None:
        fns["torch_blockwise"] = blockwise
        if block_linear_cublas(x, wq_b, ws_b, (128, 128)) is not None:  # probes once per shape
            fns["block_cublas"] = lambda: block_linear_cublas(x, wq_b, ws_b, (128, 128))
    if m <= SMALL_M_MAX:
        fns["bf16_small_m"] = lambda: stream_linear(x, w)
        fns["fp8_small_m_block"] = lambda: stream_linear(x, wq_b, ws_b, (128, 128))
        fns["fp8_small_m_channel"] = lambda: stream_linear(x, wq_c, ws_c)
    # Each method against x @ W^T with the weights it reads, dequantized (float32): what is left
    # is its own arithmetic (and, for W8A8 paths, the activation quantization).
    xf = x.float()
    deq_block = dequantize_fp8_block(wq_b, ws_b, (128, 128))
    refs = {"bf16": xf @ w.float().t(), "block": xf @ deq_block.t(), "tensor": xf @ (wq_t.float() * w_amax).t(),
            "channel": xf @ (wq_c.float() * ws_c[:, None]).t()}
    kind = {"bf16": "bf16", "bf16_small_m": "bf16", "scaled_mm_tensor": "tensor", "online_channel": "channel",
            "fp8_small_m_channel": "channel", "channel_rescale": "channel", "channel_rescale_bf16raw": "channel",
            "channel_wired": "channel"}
    return {name: (fn, refs[kind.get(name, "block")]) for name, fn in fns.items()}


def _torch_blockwise(xq, xs, wq, ws):
    """torch's own block-scaled FP8 GEMM (F.scaled_mm: 1x128 activation scales, 128x128 weight
    scales; cuBLASLt on sm90, CUDA 12.9+) on pre-quantized operands in the layouts
    fp8_cublas.py passes (activation rows padded to 4, scales token-fastest; weight scales padded
    along K / 128 to a multiple of 4, transposed), or None (said once) where this torch/GPU
    refuses it. Its numbers are checked against the oracle like every other method's."""
    from meshserve.workers.quant.fp8_cublas import SCALE_ROW_ALIGN, blockwise_scaled_mm, torch_weight_scales

    m = xq.shape[0]
    pad = -m % SCALE_ROW_ALIGN
    xq_p = torch.nn.functional.pad(xq.view(torch.uint8), (0, 0, 0, pad)).view(xq.dtype)
    sa = torch.nn.functional.pad(xs, (0, 0, 0, pad), value=1.0).t().contiguous().t()
    sb = torch_weight_scales(ws)

    def run():
        return blockwise_scaled_mm(xq_p, sa, wq, sb, torch.bfloat16)[:m]

    try:
        run()
    except Exception as exc:  # an unsupported layout / build raises
        say_once(f"torch_blockwise unavailable: {str(exc).splitlines()[0][:160]}")
        return None
    return run


def time_us(fn, reps: int, device: str) -> float:
    if device == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    import triton

    times = [triton.testing.do_bench(fn, warmup=10, rep=reps, return_mode="median") for _ in range(3)]
    return statistics.median(times) * 1e3


def measure(ms, shapes, reps: int, device: str) -> list[dict]:
    rows = []
    for m in ms:
        for proj, (n, k) in shapes.items():
            row = {"m": m, "proj": proj, "n": n, "k": k, "us": {}, "rel_err": {}}
            for method, (fn, ref) in cases(m, n, k, device).items():
                try:
                    out = fn()
                except Exception as exc:  # a path this torch/GPU does not have: said once, left out
                    say_once(f"{method} unavailable: {str(exc).splitlines()[0][:140]}")
                    continue
                row["rel_err"][method] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                row["us"][method] = time_us(fn, reps, device)
            rows.append(row)
        layer = {"m": m, "proj": "layer", "n": 0, "k": 0, "us": {}, "rel_err": {}}
        mine = [r for r in rows if r["m"] == m and r["proj"] != "layer"]
        for method in METHODS:
            if all(method in r["us"] for r in mine):
                layer["us"][method] = sum(r["us"][method] for r in mine)
        rows.append(layer)
    return rows


def tbs(row: dict, method: str, shapes) -> float:
    """Weight-read TB/s of one cell (the layer row: all four projections' weights)."""
    projs = shapes.items() if row["proj"] == "layer" else [(row["proj"], (row["n"], row["k"]))]
    return sum(weight_bytes(method, n, k) for _, (n, k) in projs) / row["us"][method] / 1e6


def table(rows: list[dict], shapes) -> str:
    methods = [m for m in METHODS if any(m in r["us"] for r in rows)]
    head = f"{'M':>5} {'proj':>8} | " + " | ".join(f"{m:>22}" for m in methods) + " | worst rel. err"
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = []
        for m in methods:
            if m in r["us"]:
                cells.append(f"{r['us'][m]:8.1f}us {tbs(r, m, shapes):4.2f}TB/s {r['us']['bf16'] / r['us'][m]:4.2f}x")
            else:
                cells.append(f"{'-':>22}")
        err = max(r["rel_err"].values(), default=float("nan"))
        lines.append(f"{r['m']:>5} {r['proj']:>8} | " + " | ".join(cells) + (f" | {err:.4f}" if r["rel_err"] else " |"))
    return "\n".join(lines)


SUMMARY = (("bf16", "bf16"), ("scaled_mm_tensor", "per-tensor"), ("torch_blockwise", "blockwise torch"),
           ("block_cublas", "block cuBLAS+q"), ("block", "block Triton+q"), ("block_wired", "block as wired"),
           ("online_channel", "channel rowwise"), ("channel_rescale", "channel rescale"),
           ("channel_wired", "channel as wired"))


def suggest_table(rows: list[dict]) -> str:
    """gemm_table.GemmTable values these numbers argue for (the measured Ms only)."""
    layers = sorted((r for r in rows if r["proj"] == "layer"), key=lambda r: r["m"])

    def wins(r, a, b):
        return a in r["us"] and b in r["us"] and r["us"][a] < r["us"][b]

    cublas_from = next((r["m"] for r in layers if all(wins(q, "block_cublas", "block") for q in layers
                                                      if q["m"] >= r["m"])), None)
    rescale_upto = 0
    for r in layers:
        if not wins(r, "channel_rescale", "online_channel"):
            break
        rescale_upto = r["m"]
    raw = "float32" if all(not wins(r, "channel_rescale_bf16raw", "channel_rescale") for r in layers) else "bfloat16?"
    cublas = "never (keep the Triton block GEMM)" if cublas_from is None else f"{cublas_from} (measured Ms only)"
    return (f"suggested gemm_table: block_cublas_min_rows = {cublas}; channel_rescale_max_rows = {rescale_upto} "
            f"(largest measured M where the rescale beats row-wise at every M up to it); rescale_raw_dtype = {raw}")


def summary(rows: list[dict], graphs: list[dict]) -> str:
    """The short table printed last: per M, one decoder layer per method (us and x bf16), the
    dispatch table the numbers suggest, then the 32-layer decode graphs."""
    head = f"{'M':>5} | " + " | ".join(f"{label:>16}" for _, label in SUMMARY)
    lines = ["summary: one decoder layer (4 projections), us (speed-up over bf16 cuBLAS); '+q' = activation "
             "quantization included", head, "-" * len(head)]
    for r in rows:
        if r["proj"] != "layer":
            continue
        base = r["us"]["bf16"]
        cells = [f"{r['us'][m]:8.1f} ({base / r['us'][m]:4.2f}x)" if m in r["us"] else f"{'-':>16}"
                 for m, _ in SUMMARY]
        lines.append(f"{r['m']:>5} | " + " | ".join(cells))
    lines.append(suggest_table(rows))
    if graphs:
        base = graphs[0]["ms"]
        lines.append("decode proxy: CUDA graph of 32 layers x 4 projections, M = 1")
        for g in graphs:
            lines.append(f"  {g['method']:>20}: {g['ms']:.3f} ms  {g['tbs']:.2f} TB/s  {base / g['ms']:.2f}x  "
                         f"{g.get('kernels', '?')} kernels")
    return "\n".join(lines)


def plot(rows: list[dict], ms, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(ms), figsize=(5 * len(ms), 4))
    for ax, m in zip(axes, ms):
        sel = [r for r in rows if r["m"] == m]
        methods = [x for x in METHODS if all(x in r["us"] for r in sel)]
        width = 0.8 / max(len(methods), 1)
        for i, method in enumerate(methods):
            ax.bar([j + i * width for j in range(len(sel))], [r["us"]["bf16"] / r["us"][method] for r in sel], width,
                   label=method)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sel))], [r["proj"] for r in sel])
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(f"M = {m}: speed-up over bf16 cuBLAS")
    axes[0].legend(fontsize=7)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (smoke)"
    fig.suptitle(f"FP8 and small-M GEMMs on {name} (Llama-3-8B shapes)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--reps", type=int, default=20, help="milliseconds of timed runs per do_bench call")
    parser.add_argument("--sweep", action="store_true", help="also time alternative small-M tilings")
    parser.add_argument("--no-graph", action="store_true", help="skip the 32-layer decode graph")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: every method runs and agrees")
    args = parser.parse_args()
    from bench.quant_gemm_decode import decode_graphs, sweep

    device = "cpu" if args.smoke else "cuda"
    shapes, ms = (SMOKE_SHAPES, SMOKE_MS) if args.smoke else (SHAPES, MS)
    t0 = time.perf_counter()
    rows = measure(ms, shapes, args.reps, device)
    print(table(rows, shapes), flush=True)
    from meshserve.workers.quant.fp8_cublas import probe_results

    for (n, k, dtype, dev), verdict in probe_results().items():
        print(f"blockwise probe N={n} K={k} {dtype} {dev}: {verdict or 'serves'}", flush=True)
    print("summary (GEMMs; in case the decode graphs do not finish):\n" + summary(rows, []), flush=True)
    swept = sweep(shapes, device) if args.sweep else []
    graphs = [] if args.no_graph else decode_graphs(shapes, layers=2 if args.smoke else 32, device=device)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "smoke": args.smoke}
    probes = {f"{n}x{k} {dtype}": verdict for (n, k, dtype, _), verdict in probe_results().items()}
    (args.out / "quant_gemm.json").write_text(json.dumps({"meta": meta, "rows": rows, "decode_graphs": graphs,
                                                          "sweep": swept, "probes": probes}, indent=1))
    plot(rows, ms, args.out / "quant_gemm.png")
    print(f"\nwrote {args.out}/quant_gemm.json and .png in {time.perf_counter() - t0:.0f} s\n")
    print(summary(rows, graphs))
    # Against each method's own weights: W8A16 / bf16 kernels leave bf16 rounding only; paths that
    # quantize activations add e4m3's ~3% on random data. A wrong scale or column is >> 10%.
    bad = [(r["m"], r["proj"], k, v) for r in rows for k, v in r["rel_err"].items()
           if v > (0.01 if k in SMALL_ONLY else 0.08)]
    if bad:
        print(f"DISAGREE with the dequantized-weight matmul: {bad}")
        sys.exit(1)


if __name__ == "__main__":
    main()
