"""One MoE layer's experts on one GPU, side by side: the torch reference loop (what ran before),
the fused Triton MoE, a torch `_grouped_mm` MoE, and FlashInfer's CUTLASS fused MoE.

    python -m bench.moe_layer [--out DIR]        # the H200 run (< 4 minutes)
    python -m bench.moe_layer --smoke [--out DIR]  # tiny shapes on CPU (Triton interpreter)

Shapes (issue 27): GPT-OSS-20B (hidden 2880, 32 experts x 2880, top-4, clamped SwiGLU with
biases) and DeepSeek-V2-Lite (hidden 2048, 64 experts x 1408, top-6, SiLU; its 2 shared
experts are in the "layer" row only), T = 1, 8, 64, 4096, bf16, random weights and inputs,
random routing from the model's own router. Every variant gets the same (weights, ids).
Roofline: every touched expert's weights read once at 4.18 TB/s (the issue's definition);
matmul peak 793 TFLOP/s. Variants are checked against the reference (max error relative to
the output's largest value) before they are timed; one that disagrees is reported, not timed.
Prints a table and writes moe_layer.json and moe_layer.png under --out.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

COPY_BPS, MATMUL_FLOPS = 4.18e12, 793e12


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    experts: int
    inter: int
    top_k: int
    shared: int  # DeepSeek shared experts (0: GPT-OSS)


SHAPES = (Shape("gpt-oss-20b", 2880, 32, 2880, 4, 0), Shape("deepseek-v2-lite", 2048, 64, 1408, 6, 2))
SMOKE_SHAPES = (Shape("gpt-oss-tiny", 64, 8, 32, 2, 0), Shape("deepseek-tiny", 64, 8, 32, 2, 1))
TOKENS, SMOKE_TOKENS = (1, 8, 64, 4096), (1, 8, 64)


@dataclass
class Row:
    shape: str
    tokens: int
    variant: str
    us: float | None
    roofline_us: float
    ratio: float | None  # us / roofline
    tflops: float | None
    err: float | None
    note: str = ""


def build_layer(shape: Shape, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """The model's own MoE module (HF weight layout), random weights."""
    from meshserve.workers.models.arch import SwigluExperts
    from meshserve.workers.models.deepseek_arch import MoEConfig
    from meshserve.workers.models.gptoss_moe import SwigluMoE
    from meshserve.workers.models.moe import MoE

    if shape.shared == 0:
        layer = SwigluMoE(shape.hidden, shape.inter, SwigluExperts(num_experts=shape.experts, top_k=shape.top_k))
    else:
        layer = MoE(shape.hidden, MoEConfig(
            num_experts=shape.experts, top_k=shape.top_k, moe_intermediate_size=shape.inter,
            num_shared_experts=shape.shared, num_groups=1, topk_groups=1, routed_scaling_factor=1.0,
            scoring="softmax", group_by="none", norm_topk_prob=False, correction_bias=False,
            first_k_dense_replace=0))  # fmt: skip
    layer = layer.to(device, dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=device) * (0.1 if "bias" in name else 0.02))
    return layer


def route(layer: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.route(x) if hasattr(layer, "route") else layer.gate(x)


def reference_fn(layer: torch.nn.Module) -> Callable:
    from meshserve.workers.models.moe import combine_experts

    if hasattr(layer, "route"):
        return lambda x, w, ids: combine_experts(x, w, ids, layer.experts.run)
    return lambda x, w, ids: combine_experts(x, w, ids, lambda e, xe: layer.experts[e](xe))


def packed_of(layer: torch.nn.Module):
    """(ExpertWeights, packed copy of the layer) for the fused variants."""
    packed = copy.deepcopy(layer)
    packed.pack_experts()
    return packed.fused, packed


def grouped_mm_fn(ew) -> Callable:
    """Sort rows by expert, two torch._grouped_mm calls, torch activation, weighted scatter-add."""
    from meshserve.workers.models.fused_moe import ACT_SILU

    inter, act = ew.intermediate, ew.activation
    w13_t, w2_t = ew.w13.transpose(1, 2), ew.w2.transpose(1, 2)  # [E, H, 2I], [E, I, H] (column-major)

    def run(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        offs = torch.zeros(ew.num_experts, dtype=torch.int32, device=x.device)
        offs.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = offs.cumsum(0, dtype=torch.int32)
        xs = x[order // ids.shape[1]]
        gu = torch._grouped_mm(xs, w13_t, offs=offs)
        if ew.b13 is not None:
            gu = gu + ew.b13[flat[order]]
        g, u = gu[:, :inter], gu[:, inter:]
        if act.kind == ACT_SILU:
            h = torch.nn.functional.silu(g) * u
        else:
            g, u = g.clamp(max=act.limit), u.clamp(-act.limit, act.limit)
            h = (u + 1) * g * torch.sigmoid(act.alpha * g)
        y = torch._grouped_mm(h, w2_t, offs=offs)
        if ew.b2 is not None:
            y = y + ew.b2[flat[order]]
        y = y * w.reshape(-1)[order, None].to(y.dtype)
        return torch.zeros_like(x).index_add_(0, order // ids.shape[1], y)

    return run


def flashinfer_fn(ew, gate_first: bool) -> Callable:
    """FlashInfer's CUTLASS fused MoE (TensorRT-LLM's kernels) on the same experts."""
    from flashinfer.fused_moe import cutlass_fused_moe

    from meshserve.workers.models.fused_moe import ACT_SILU

    inter, act = ew.intermediate, ew.activation

    def swap(t: torch.Tensor) -> torch.Tensor:  # ours: gate rows, then up rows
        return t if gate_first else torch.cat((t[:, inter:], t[:, :inter]), dim=1).contiguous()

    fc1, fc1_bias = swap(ew.w13), None if ew.b13 is None else swap(ew.b13)
    extra = {}
    if act.kind != ACT_SILU:
        e, dev = ew.num_experts, ew.w13.device
        extra = dict(swiglu_alpha=torch.full((e,), act.alpha, device=dev), swiglu_beta=torch.ones(e, device=dev),
                     swiglu_limit=torch.full((e,), act.limit, device=dev))

    def run(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return cutlass_fused_moe(x, ids.to(torch.int32), w.float(), fc1, ew.w2, x.dtype, quant_scales=[],
                                 fc1_expert_biases=fc1_bias, fc2_expert_biases=ew.b2, **extra)

    return run


def graphed(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
    """fn captured in a CUDA graph (as decode steps run it): replaying costs no launch overhead."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def time_us(fn: Callable[[], object], device: str, iters: int) -> float:
    for _ in range(3):
        fn()
    if device != "cuda":
        t = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
        return statistics.median(t) * 1e6
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1000.0


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()


def bench_shape(shape: Shape, tokens: tuple[int, ...], device: str, dtype: torch.dtype, *,
                flashinfer: bool = True) -> list[Row]:
    from meshserve.workers.models.fused_moe import fused_moe

    layer = build_layer(shape, device, dtype)
    ew, packed = packed_of(layer)
    variants: dict[str, Callable | str] = {"reference": reference_fn(layer),
                                           "fused": lambda x, w, ids: fused_moe(x, w, ids, ew)}
    variants["grouped_mm"] = grouped_mm_fn(ew) if hasattr(torch, "_grouped_mm") else "torch has no _grouped_mm"
    try:
        if not flashinfer:
            raise RuntimeError("--skip-flashinfer")
        import flashinfer.fused_moe  # noqa: F401

        variants["flashinfer"] = flashinfer_fn(ew, gate_first=False)
    except Exception as exc:  # not installed, or it cannot load here
        variants["flashinfer"] = f"skipped: {type(exc).__name__} {exc}"[:100]
    rows = []
    expert_bytes = 3 * shape.hidden * shape.inter * torch.finfo(dtype).bits // 8
    for T in tokens:
        gen = torch.Generator(device=device).manual_seed(T)
        x = torch.randn(T, shape.hidden, generator=gen, device=device).to(dtype)
        with torch.no_grad():
            w, ids = route(layer, x)
            touched = ids.unique().numel()
            roof = touched * expert_bytes / COPY_BPS * 1e6
            flops = 2 * T * shape.top_k * 3 * shape.hidden * shape.inter
            want = variants["reference"](x, w, ids)
            iters = 5 if T >= 1024 or device != "cuda" else 20
            for name, fn in variants.items():
                if name == "flashinfer" and not isinstance(fn, str):
                    fn = _flashinfer_checked(ew, fn, x, w, ids, want)
                    variants[name] = fn
                if isinstance(fn, str):
                    rows.append(Row(shape.name, T, name, None, roof, None, None, None, fn))
                    continue
                try:
                    err = rel_err(fn(x, w, ids), want)
                except Exception as exc:
                    rows.append(Row(shape.name, T, name, None, roof, None, None, None,
                                    f"failed: {type(exc).__name__}: {str(exc)[:80]}"))
                    continue
                if err > 3e-2:
                    rows.append(Row(shape.name, T, name, None, roof, None, None, err, "disagrees with the reference"))
                    continue
                us = time_us(lambda fn=fn, x=x, w=w, ids=ids: fn(x, w, ids), device, iters)
                rows.append(Row(shape.name, T, name, us, roof, us / roof, flops / us / 1e6, err))
            us = time_us(lambda x=x: packed(x), device, iters)  # routing + fused experts (+ shared experts)
            rows.append(Row(shape.name, T, "fused layer", us, roof, us / roof, flops / us / 1e6, None,
                            "router + experts" + (" + shared experts" if shape.shared else "")))
            if device == "cuda":  # as decode steps run it: inside a CUDA graph
                us = time_us(graphed(lambda x=x, w=w, ids=ids, f=variants["fused"]: f(x, w, ids)), device, iters)
                rows.append(Row(shape.name, T, "fused graph", us, roof, us / roof, flops / us / 1e6, None,
                                "experts, replayed from a CUDA graph"))
        print(f"  {shape.name} T={T} done", file=sys.stderr, flush=True)
    return rows


def _flashinfer_checked(ew, fn: Callable, x, w, ids, want) -> Callable | str:
    """FlashInfer's fc1 holds (up, gate) in TensorRT-LLM's convention; try (gate, up) if not."""
    for candidate in (fn, flashinfer_fn(ew, gate_first=True)):
        try:
            if rel_err(candidate(x, w, ids), want) <= 3e-2:
                return candidate
        except Exception as exc:
            return f"failed: {type(exc).__name__}: {str(exc)[:80]}"
    return "disagrees with the reference in either gate/up order"


def print_table(rows: list[Row]) -> None:
    print(f"{'shape':18} {'T':>5} {'variant':12} {'us':>10} {'roofline us':>11} {'ratio':>7} {'TFLOP/s':>8} "
          f"{'err':>8}  note")  # fmt: skip
    for r in rows:
        us = f"{r.us:10.1f}" if r.us is not None else f"{'-':>10}"
        ratio = f"{r.ratio:7.2f}" if r.ratio is not None else f"{'-':>7}"
        tf = f"{r.tflops:8.1f}" if r.tflops is not None else f"{'-':>8}"
        err = f"{r.err:8.1e}" if r.err is not None else f"{'-':>8}"
        print(f"{r.shape:18} {r.tokens:5d} {r.variant:12} {us} {r.roofline_us:11.2f} {ratio} {tf} {err}  {r.note}")


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r.shape for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        mine = [r for r in rows if r.shape == shape]
        for variant in dict.fromkeys(r.variant for r in mine):
            pts = [(r.tokens, r.ratio) for r in mine if r.variant == variant and r.ratio is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=variant)
        ax.axhline(1.5, color="grey", linestyle="--", linewidth=0.8, label="1.5x roofline (target, T<=64)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("time / bytes roofline")
        ax.set_title(shape)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (Triton interpreter)")
    ap.add_argument("--out", default=".", help="folder for moe_layer.json and moe_layer.png")
    ap.add_argument("--skip-flashinfer", action="store_true",
                    help="leave FlashInfer out (its first call JIT-builds CUTLASS kernels unless cached)")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
        device, dtype, shapes, tokens = "cpu", torch.float32, SMOKE_SHAPES, SMOKE_TOKENS
    else:
        if not torch.cuda.is_available():
            print("needs CUDA (or --smoke)", file=sys.stderr)
            return 2
        device, dtype, shapes, tokens = "cuda", torch.bfloat16, SHAPES, TOKENS
    t0 = time.perf_counter()
    rows = [r for shape in shapes for r in bench_shape(shape, tokens, device, dtype,
                                                        flashinfer=not args.skip_flashinfer)]
    print_table(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device":
            torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "dtype": str(dtype), "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
    (out / "moe_layer.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    plot(rows, out / "moe_layer.png")
    print(f"wrote {out / 'moe_layer.json'} and {out / 'moe_layer.png'} in {meta['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
