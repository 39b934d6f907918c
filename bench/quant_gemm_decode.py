"""The decode-step parts of bench/quant_gemm.py: a CUDA graph of 32 layers x 4 projections at M = 1
per weight format and formulation (the decode step's GEMM time: the proxy for issue 24's "online
FP8 bs-1 decode step >= 1.7x bf16" and issue 18's kernels per step), and a sweep of small-M tilings.
Formulations: the small-M streaming kernel, fp8_linear as wired (gemm_table.DEFAULT_TABLE), and
fp8_linear with the cuBLASLt formulations forced (blockwise for block scales, unit-scale
_scaled_mm + rank-1 rescale for per-channel ones)."""

from __future__ import annotations

import statistics
import time

import torch

from bench.common import graph_replay_ms

GRAPH_METHODS = ("bf16_cublas", "bf16_small_m", "fp8_small_m_block", "fp8_small_m_channel", "fp8_block_wired",
                 "fp8_block_cublas", "fp8_channel_wired", "fp8_channel_rescale")
_BLOCK_METHODS = ("fp8_small_m_block", "fp8_block_wired", "fp8_block_cublas")
_CHANNEL_METHODS = ("fp8_small_m_channel", "fp8_channel_wired", "fp8_channel_rescale")


def _layer_weights(shapes, device: str, seed: int) -> dict[str, list]:
    """method -> [(proj args...)] for one layer: bf16 weights and both FP8 layouts of them."""
    from meshserve.workers.quant.fp8 import quantize_fp8_block, quantize_fp8_per_channel

    g = torch.Generator(device=device).manual_seed(seed)
    out = {m: [] for m in GRAPH_METHODS}
    dtype = torch.float32 if device == "cpu" else torch.bfloat16  # interpreter: no bf16 math
    for n, k in shapes.values():
        w = (torch.randn(n, k, device=device, generator=g, dtype=torch.float32) * 0.02).to(dtype)
        out["bf16_cublas"].append((w,))
        out["bf16_small_m"].append((w,))
        block, channel = (*quantize_fp8_block(w, (128, 128)), (128, 128)), quantize_fp8_per_channel(w)
        for method in _BLOCK_METHODS:
            out[method].append(block)  # one copy of the FP8 weights per format, shared by its methods
        for method in _CHANNEL_METHODS:
            out[method].append(channel)
    return out


def _kernels_per_replay(graph) -> int | str:
    """CUDA kernels one replay runs (torch profiler; '?' where it cannot see graph nodes)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        count = sum(1 for name in names if not name.lower().startswith(("memcpy", "memset")))
        return count or "?"  # zero: this CUPTI does not trace graph nodes
    except Exception as exc:  # profiler without CUPTI graph support
        print(f"kernel count unavailable: {str(exc).splitlines()[0][:120]}")
        return "?"


def decode_graphs(shapes, *, layers: int, device: str) -> list[dict]:
    """One CUDA graph per method: `layers` x the four projections at M = 1, distinct random weights
    per layer (15 GB of bf16 for 32 layers: nothing stays in L2). Median ms of 20 replays."""
    from meshserve.workers.quant.gemm_table import GemmTable
    from meshserve.workers.quant.layers import fp8_linear
    from meshserve.workers.quant.small_m import stream_linear

    cublas, rescale = GemmTable(block_cublas_min_rows=1), GemmTable(channel_rescale_max_rows=16)
    t0 = time.perf_counter()
    weights = {m: [] for m in GRAPH_METHODS}
    for layer in range(layers):
        for method, projs in _layer_weights(shapes, device, seed=layer).items():
            weights[method].append(projs)
    xdtype = torch.float32 if device == "cpu" else torch.bfloat16
    xs = [torch.randn(1, k, device=device).to(xdtype) for _, k in shapes.values()]
    calls = {
        "bf16_cublas": lambda x, w: torch.matmul(x, w.t()),
        "bf16_small_m": lambda x, w: stream_linear(x, w),
        "fp8_small_m_block": lambda x, w, s, b: stream_linear(x, w, s, b),
        "fp8_small_m_channel": lambda x, w, s: stream_linear(x, w, s),
        "fp8_block_wired": lambda x, w, s, b: fp8_linear(x, w, s, b),  # gemm_table.DEFAULT_TABLE, small-M off
        "fp8_block_cublas": lambda x, w, s, b: fp8_linear(x, w, s, b, table=cublas),
        "fp8_channel_wired": lambda x, w, s: fp8_linear(x, w, s, None),
        "fp8_channel_rescale": lambda x, w, s: fp8_linear(x, w, s, None, table=rescale),
    }
    results = []
    for method in GRAPH_METHODS:
        call = calls[method]
        nbytes = sum(t.numel() * t.element_size() for layer in weights[method] for proj in layer
                     for t in proj if isinstance(t, torch.Tensor))

        def step(call=call, method=method):
            for layer in weights[method]:
                for x, args in zip(xs, layer):
                    call(x, *args)

        if device == "cpu":  # smoke: no graphs; one eager pass checks that the step runs
            t = time.perf_counter()
            step()
            results.append({"method": method, "ms": (time.perf_counter() - t) * 1e3, "tbs": 0.0, "kernels": "?"})
            continue
        times, graph = graph_replay_ms(step)  # compile and warm up outside the capture
        ms = statistics.median(times)
        results.append({"method": method, "ms": ms, "tbs": nbytes / ms / 1e9, "weight_gb": nbytes / 1e9,
                        "kernels": _kernels_per_replay(graph)})
        del graph
    print(f"decode graphs: {layers} layers in {time.perf_counter() - t0:.0f} s")
    return results


def _plans(k: int, weight_bytes: int, scale_k: int | None):
    """Small-M tilings to try: 16/32/64 columns, 128..512 bytes per row and step, 1 or 2 splits,
    4 warps (and 2 at 16 columns), 4 stages (<= 24 variants per weight format)."""
    from meshserve.workers.quant.small_m import StreamPlan

    for block_n in (16, 32, 64):
        for row_bytes in (128, 256, 512):
            block_k = row_bytes // weight_bytes
            if block_n * block_k > 16384:
                continue
            unit = max(block_k, scale_k or 0)
            for splits in (1, 2):
                per = -(-k // splits)
                per = -(-per // unit) * unit
                # 16-column tiles: 4 warps replicate the activation tile's conversion (SASS,
                # bench/kernel_report_gemm.py); 2 warps may stream as well with half the work.
                for warps in (2, 4) if block_n == 16 else (4,):
                    yield StreamPlan(block_n, block_k, -(-k // per), per, num_warps=warps, num_stages=4)


def sweep(shapes, device: str) -> list[dict]:
    """For M in (1, 16) and each weight format and shape: the default plan's time and the best
    alternative's (printed as a table; a better plan is a candidate for plan_stream)."""
    import triton

    from meshserve.workers.quant.fp8 import quantize_fp8_block, quantize_fp8_per_channel
    from meshserve.workers.quant.small_m import stream_linear

    def bench(fn):
        if device == "cpu":
            fn()
            return 1.0
        return triton.testing.do_bench(fn, warmup=5, rep=10, return_mode="median") * 1e3

    rows = []
    for proj, (n, k) in shapes.items():
        w = (torch.randn(n, k, device=device) * 0.02).to(torch.float32 if device == "cpu" else torch.bfloat16)
        formats = {"bf16": (w, None, None), "fp8_block": (*quantize_fp8_block(w, (128, 128)), (128, 128)),
                   "fp8_channel": (*quantize_fp8_per_channel(w), None)}
        for m in (1, 16):
            x = torch.randn(m, k, device=device).to(w.dtype)
            for fmt, (wt, scale, block) in formats.items():
                def run(plan=None, x=x, wt=wt, scale=scale, block=block):
                    return stream_linear(x, wt, scale, block, plan=plan)

                default = bench(run)
                best, best_plan = default, "default"
                plans = list(_plans(k, wt.element_size(), block and block[1]))
                for plan in plans[:2] if device == "cpu" else plans:
                    try:
                        t = bench(lambda plan=plan, run=run: run(plan))
                    except Exception as exc:  # e.g. out of shared memory for this tile
                        print(f"sweep: {plan} failed: {str(exc).splitlines()[0][:100]}")
                        continue
                    if t < best:
                        best, best_plan = t, plan
                rows.append({"m": m, "proj": proj, "format": fmt, "default_us": default, "best_us": best,
                             "best_plan": str(best_plan)})
                print(f"sweep M={m:>2} {proj:>8} {fmt:>12}: default {default:7.1f} us, best {best:7.1f} us "
                      f"({best_plan})", flush=True)
        rows.append(_sweep_block_gemm(proj, w, 64 if device == "cpu" else 4096, bench))
    return rows


# (BM, BN, warps, stages) for the large-M block GEMM; the first is what _tiles picks at M >= 128.
BLOCK_TILES = ((128, 128, 8, 3), (128, 128, 4, 3), (64, 128, 4, 3), (64, 128, 4, 4), (128, 256, 8, 3),
               (256, 128, 8, 3), (128, 64, 4, 4))


def _sweep_block_gemm(proj: str, w: torch.Tensor, m: int, bench) -> dict:
    """The Triton block GEMM at prefill M over BLOCK_TILES (activations pre-quantized)."""
    from meshserve.workers.quant.fp8 import quantize_fp8_block, quantize_per_token_group
    from meshserve.workers.quant.fp8_triton import block_gemm

    wq, ws = quantize_fp8_block(w, (128, 128))
    xq, xs = quantize_per_token_group(torch.randn(m, w.shape[1], device=w.device).to(w.dtype), 128)
    times = {}
    for tiles in BLOCK_TILES[:2] if w.device.type == "cpu" else BLOCK_TILES:
        try:
            times[str(tiles)] = bench(lambda tiles=tiles: block_gemm(xq, xs, wq, ws, (128, 128), w.dtype, tiles=tiles))
        except Exception as exc:  # e.g. out of shared memory
            print(f"sweep: block GEMM tiles {tiles} failed: {str(exc).splitlines()[0][:100]}")
    best = min(times, key=times.get)
    flops = 2.0 * m * w.shape[0] * w.shape[1]
    print(f"sweep M={m} {proj:>8} block_gemm: default {times[str(BLOCK_TILES[0])]:7.1f} us, best {times[best]:7.1f} us "
          f"{best} ({flops / times[best] / 1e6:.0f} TFLOP/s)", flush=True)
    return {"m": m, "proj": proj, "format": "block_gemm", "default_us": times[str(BLOCK_TILES[0])],
            "best_us": times[best], "best_plan": best, "all_us": times}
