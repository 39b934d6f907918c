"""FP8 GEMMs on the GPU at Llama-3-8B's projection shapes: the block-scaled Triton GEMM (what
DeepSeek-V3 / Qwen3-FP8 checkpoints run), online FP8 (per-channel, torch._scaled_mm row-wise),
torch._scaled_mm per-tensor FP8 (the peer the issue names), and bf16 torch.matmul, in one run.

    python bench/quant_gemm.py [--out bench/results] [--reps 50]

Per (M, N, K): median microseconds (triton.testing.do_bench: warm-up, L2 flushed between runs,
random data), TFLOP/s and weight-read TB/s. "block" includes the activation quantization
kernel, "block_gemm" is the GEMM alone on pre-quantized activations (the like-for-like peer of
per-tensor _scaled_mm, whose activations are pre-quantized too). The "layer" rows sum one
decoder layer's four GEMMs: at M = 1 the decode step's linear time. Prints a table, writes JSON
and a PNG.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import triton

from meshserve.workers.quant.fp8 import quantize_fp8_block, quantize_fp8_per_channel, quantize_per_token_group
from meshserve.workers.quant.fp8_triton import block_gemm, fp8_block_linear
from meshserve.workers.quant.layers import fp8_linear

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = (1, 16, 64, 4096)
METHODS = ("bf16", "scaled_mm_tensor", "block_gemm", "block", "online_channel")


def _cases(m: int, n: int, k: int) -> dict[str, callable]:
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n + k)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    wq_b, ws_b = quantize_fp8_block(w, (128, 128))
    xq_g, xs_g = quantize_per_token_group(x, 128)
    wq_c, ws_c = quantize_fp8_per_channel(w)
    x_amax, w_amax = x.float().abs().max() / 448, w.float().abs().max() / 448
    xq_t = (x.float() / x_amax).to(torch.float8_e4m3fn)
    wq_t = (w.float() / w_amax).to(torch.float8_e4m3fn)
    one_a, one_b = x_amax.reshape(()).float(), w_amax.reshape(()).float()
    cases = {
        "bf16": lambda: torch.matmul(x, w.t()),
        "scaled_mm_tensor": lambda: torch._scaled_mm(xq_t, wq_t.t(), scale_a=one_a, scale_b=one_b,
                                                     out_dtype=torch.bfloat16),
        "block_gemm": lambda: block_gemm(xq_g, xs_g, wq_b, ws_b, (128, 128), torch.bfloat16),
        "block": lambda: fp8_block_linear(x, wq_b, ws_b, (128, 128)),
        "online_channel": lambda: fp8_linear(x, wq_c, ws_c, None),
    }
    blockwise = _torch_blockwise(xq_g, xs_g, wq_b, ws_b, cases["block_gemm"]())
    if blockwise is not None:
        cases["torch_blockwise"] = blockwise
    return cases


def _torch_blockwise(xq, xs, wq, ws, expected):
    """torch's own block-scaled FP8 GEMM (F.scaled_mm, 1x128 activations x 128x128 weights; cuBLAS
    on sm90), when this torch has it and it agrees with the Triton GEMM; else None (said once)."""
    F = torch.nn.functional
    kinds = getattr(F, "ScalingType", None) or getattr(F, "_ScalingType", None)
    if not hasattr(F, "scaled_mm") or kinds is None:
        _say_once("torch_blockwise: this torch has no F.scaled_mm")
        return None
    # Scale layouts to try: torch's tests keep block scales outer-dim-major (M-major for 1x128).
    act = getattr(kinds, "BlockWise1x128", None) or getattr(kinds, "Blockwise_1x128", None)
    wgt = getattr(kinds, "BlockWise128x128", None) or getattr(kinds, "Blockwise_128x128", None)
    layouts = [(xs.t().contiguous().t(), ws.t()), (xs, ws.t()), (xs.t().contiguous().t(), ws)]
    errors = []
    for sa, sb in layouts:
        def run(sa=sa, sb=sb):
            return F.scaled_mm(xq, wq.t(), sa, act, sb, wgt, output_dtype=torch.bfloat16)
        try:
            out = run()
            rel = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
        except Exception as exc:  # an unsupported layout / build raises; try the next
            errors.append(str(exc).splitlines()[0][:120])
            continue
        if rel < 1e-2:
            return run
        errors.append(f"wrong result (rel. error {rel:.3f})")
    _say_once("torch_blockwise unavailable: " + " | ".join(errors))
    return None


_SAID: set[str] = set()


def _say_once(text: str) -> None:
    if text not in _SAID:
        _SAID.add(text)
        print(text)


def measure(reps: int) -> list[dict]:
    rows = []
    for m in MS:
        for name, (n, k) in SHAPES.items():
            row = {"m": m, "proj": name, "n": n, "k": k}
            for method, fn in _cases(m, n, k).items():
                fn()
                times = [triton.testing.do_bench(fn, warmup=10, rep=reps, return_mode="median") for _ in range(3)]
                row[method] = statistics.median(times) * 1e3  # microseconds
            rows.append(row)
        layer = {"m": m, "proj": "layer", "n": 0, "k": 0}
        for method in rows[-1]:
            if method not in layer:
                layer[method] = sum(r.get(method, float("nan")) for r in rows if r["m"] == m and r["proj"] != "layer")
        rows.append(layer)
    return rows


def table(rows: list[dict]) -> str:
    methods = [m for m in (*METHODS, "torch_blockwise") if m in rows[0]]
    head = (f"{'M':>5} {'proj':>8} {'N':>6} {'K':>6} | " + " ".join(f"{m:>16}" for m in methods)
            + " | block/tensor  block/bf16  online/bf16  TFLOP/s(block_gemm)  TB/s(block, weights)")
    lines = [head, "-" * len(head)]
    for r in rows:
        flops = 2 * r["m"] * r["n"] * r["k"]
        tflops = f"{flops / r['block_gemm'] / 1e6:19.1f}" if flops else " " * 19
        tbs = f"{r['n'] * r['k'] / r['block'] / 1e6:21.2f}" if flops else " " * 21
        lines.append(f"{r['m']:>5} {r['proj']:>8} {r['n'] or '':>6} {r['k'] or '':>6} | "
                     + " ".join(f"{r.get(m, float('nan')):>14.1f}us" for m in methods)
                     + f" | {r['scaled_mm_tensor'] / r['block_gemm']:12.2f}x {r['bf16'] / r['block']:10.2f}x"
                     f" {r['bf16'] / r['online_channel']:11.2f}x {tflops} {tbs}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MS), figsize=(5 * len(MS), 4), sharey=False)
    for ax, m in zip(axes, MS):
        sel = [r for r in rows if r["m"] == m]
        xs = range(len(sel))
        width = 0.8 / len(METHODS)
        for i, method in enumerate(METHODS):
            ax.bar([x + i * width for x in xs], [r["bf16"] / r[method] for r in sel], width, label=method)
        ax.set_xticks([x + 0.4 - width / 2 for x in xs], [r["proj"] for r in sel])
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(f"M = {m}: speed-up over bf16")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"FP8 GEMMs on {torch.cuda.get_device_name()} (Llama-3-8B shapes)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--reps", type=int, default=50, help="milliseconds of timed runs per do_bench call")
    args = parser.parse_args()
    t0 = time.perf_counter()
    rows = measure(args.reps)
    print(table(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    (args.out / "quant_gemm.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, args.out / "quant_gemm.png")
    print(f"\nwrote {args.out}/quant_gemm.json and .png in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
