"""Which BLAS library runs the bf16 decode GEMMs best: cuBLAS against cuBLASLt (H200 probe).

One CUDA graph of 32 layers x 4 projections (Llama-3-8B shapes, distinct weights, so every
weight streams from HBM as in a decode step) per M and library; prints ms per replay, weight
TB/s and kernels per replay (torch profiler).
    python3 -m bench.blas_probe [--ms 1,16,64,256]
"""

from __future__ import annotations

import argparse

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _graph(ws, x_by_k, outs):
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for i, w in enumerate(ws):
                torch.matmul(x_by_k[w.shape[1]], w.t(), out=outs[i])
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for i, w in enumerate(ws):
            torch.matmul(x_by_k[w.shape[1]], w.t(), out=outs[i])
    return g


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,16,64,256")
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    dev = torch.device("cuda")
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
          for _ in range(args.layers) for n, k in SHAPES.values()]
    nbytes = sum(w.numel() * 2 for w in ws)
    rows = []
    for m in [int(v) for v in args.ms.split(",")]:
        x_by_k = {k: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for k in (4096, 14336)}
        outs = [torch.empty(m, w.shape[0], device=dev, dtype=torch.bfloat16) for w in ws]
        ref = None
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            g = _graph(ws, x_by_k, outs)
            g.replay()
            torch.cuda.synchronize()
            if ref is None:
                ref = [o.clone() for o in outs[:4]]
            err = max((o.float() - r.float()).abs().max().item() for o, r in zip(outs[:4], ref))
            for _ in range(3):
                g.replay()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(10):
                e0.record()
                g.replay()
                e1.record()
                e1.synchronize()
                times.append(e0.elapsed_time(e1))
            ms = sorted(times)[len(times) // 2]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                g.replay()
                torch.cuda.synchronize()
            kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            names = {}
            for e in kern:
                names[e.name[:60]] = names.get(e.name[:60], 0) + 1
            rows.append((m, lib, ms, nbytes / ms / 1e9, len(kern), err))
            print(f"M={m} {lib}: {ms:.3f} ms, {nbytes / ms / 1e9:.2f} TB/s, {len(kern)} kernels, "
                  f"max diff vs cublas {err:.3g}", flush=True)
            for n, c in sorted(names.items(), key=lambda t: -t[1])[:6]:
                print(f"    {c:4d} {n}")
            del g
        torch.backends.cuda.preferred_blas_library("cublas")
    print("\n| M | library | ms / 32 layers | weight TB/s | kernels | max diff |")
    print("|---:|---|---:|---:|---:|---:|")
    for m, lib, ms, tbs, k, err in rows:
        print(f"| {m} | {lib} | {ms:.3f} | {tbs:.2f} | {k} | {err:.3g} |")


if __name__ == "__main__":
    main()
