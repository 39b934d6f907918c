"""One MoE layer's experts on one GPU, side by side: the torch reference loop (what ran before),
the fused Triton MoE (sorted path), a torch `_grouped_mm` MoE, FlashInfer's CUTLASS
fused MoE, the routing kernel against torch routing, and the whole layer in a CUDA graph.

    python -m bench.moe_layer [--out DIR]        # the H200 run (< 4 minutes, + FlashInfer's build)
    python -m bench.moe_layer --smoke [--out DIR]  # tiny shapes on CPU (Triton interpreter)
    python -m bench.moe_layer --sweep --sweep-tokens 4096 [--out DIR]   # tile sweep (bench/moe_sweep.py)

Shapes (issue 27): GPT-OSS-20B (hidden 2880, 32 experts x 2880, top-4, clamped SwiGLU with
biases) and DeepSeek-V2-Lite (hidden 2048, 64 experts x 1408, top-6, SiLU; its 2 shared
experts are in the "layer" row only), T = 1, 8, 64, 4096, bf16, random weights and inputs,
random routing from the model's own router. Every variant gets the same (weights, ids).
Roofline: every touched expert's weights read once at 4.18 TB/s (the issue's definition);
matmul peak 793 TFLOP/s. Variants are checked against the reference (max error relative to
the output's largest value) before they are timed; one that disagrees is reported, not timed.
Rows: "fused" is the default dispatch (the sorted path at every T; the row path that "fused
rows" timed was removed, docs/performance.md "MoE layer"); "... graph" replays it from a CUDA
graph (as decode steps run);
"routing" / "torch routing" time the router's top-k alone (graph replay; roofline: the router
weights); "layer graph" is the module's forward (router matmul + routing kernel + experts
(+ DeepSeek's shared experts)) in a graph, roofline = touched experts + shared experts + router.
FlashInfer JIT-builds CUTLASS kernels on its first call: that build runs in a child process
time-boxed by --flashinfer-timeout-s (what it built stays cached; a rerun is fast).
Prints a table and writes moe_layer.json and moe_layer.png under --out.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.common import graphed, rel_err, time_us

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


def flashinfer_warm(shape_name: str) -> None:
    """Child process of `flashinfer_ready`: one FlashInfer call per gate/up order builds the kernels."""
    shape = next(s for s in SHAPES if s.name == shape_name)
    ew, _ = packed_of(build_layer(shape, "cuda", torch.bfloat16))
    x = torch.randn(1, shape.hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.arange(shape.top_k, device="cuda")[None, :]
    for gate_first in (False, True):
        flashinfer_fn(ew, gate_first)(x, torch.full(ids.shape, 1.0 / shape.top_k, device="cuda"), ids)
    torch.cuda.synchronize()


def flashinfer_ready(shape: Shape, timeout_s: float) -> str | None:
    """None when FlashInfer's fused MoE is importable and built for this shape, else why not.
    The JIT build runs in a child process group, killed whole after timeout_s."""
    try:
        import flashinfer.fused_moe  # noqa: F401
    except Exception as exc:  # not installed, or it cannot load here
        return f"skipped: {type(exc).__name__} {exc}"[:100]
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "bench.moe_layer", "--flashinfer-warm", shape.name],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        return f"skipped: FlashInfer's JIT build took over {timeout_s:.0f} s (cached so far; rerun to go on)"
    if child.returncode != 0:
        return f"failed to build: {(log.strip().splitlines() or ['?'])[-1][:80]}"
    print(f"  FlashInfer ready for {shape.name} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return None


def router_parts(layer: torch.nn.Module, x: torch.Tensor):
    """(logits, RoutingSpec, correction bias) of the layer's router on x, as its forward makes them."""
    if hasattr(layer, "route"):
        return layer.router(x), layer.routing, None
    bias = layer.gate.e_score_correction_bias
    logits = torch.nn.functional.linear(x.float(), layer.gate.weight.float())
    return logits, layer.gate.spec, None if bias is None else bias.float()


def layer_roofline_us(shape: Shape, touched: int, itemsize: int) -> float:
    """Touched routed experts + shared experts + the router's weights, read once."""
    weights = (touched + shape.shared) * 3 * shape.hidden * shape.inter + shape.experts * shape.hidden
    return weights * itemsize / COPY_BPS * 1e6


def bench_shape(shape: Shape, tokens: tuple[int, ...], device: str, dtype: torch.dtype, *,
                flashinfer: bool = True, flashinfer_timeout_s: float = 300.0) -> list[Row]:
    from meshserve.workers.models.fused_moe import fused_moe

    layer = build_layer(shape, device, dtype)
    ew, packed = packed_of(layer)
    variants: dict[str, Callable | str] = {
        "reference": reference_fn(layer),
        "fused": lambda x, w, ids: fused_moe(x, w, ids, ew),
    }
    variants["grouped_mm"] = grouped_mm_fn(ew) if hasattr(torch, "_grouped_mm") else "torch has no _grouped_mm"
    why_not = "skipped: --skip-flashinfer" if not flashinfer else (
        "skipped: needs CUDA" if device != "cuda" else flashinfer_ready(shape, flashinfer_timeout_s))
    variants["flashinfer"] = why_not or flashinfer_fn(ew, gate_first=False)
    rows = []
    itemsize = torch.finfo(dtype).bits // 8
    expert_bytes = 3 * shape.hidden * shape.inter * itemsize
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
                if device == "cuda" and name.startswith("fused"):  # as decode steps run it: in a CUDA graph
                    us = time_us(graphed(lambda fn=fn, x=x, w=w, ids=ids: fn(x, w, ids)), device, iters)
                    rows.append(Row(shape.name, T, f"{name} graph", us, roof, us / roof, flops / us / 1e6, None,
                                    "experts, replayed from a CUDA graph"))
            rows += _routing_and_layer_rows(shape, layer, packed, x, touched, device, iters, flops)
        print(f"  {shape.name} T={T} done", file=sys.stderr, flush=True)
    return rows


def _routing_and_layer_rows(shape: Shape, layer, packed, x, touched: int, device: str, iters: int,
                            flops: float) -> list[Row]:  # fmt: skip
    """The routing kernel against torch routing on the same logits, and the whole layer."""
    from meshserve.workers.models.moe import select_experts
    from meshserve.workers.models.moe_routing import route_torch

    T, itemsize = x.shape[0], x.element_size()
    logits, spec, bias = router_parts(layer, x)
    router_roof = shape.experts * shape.hidden * itemsize / COPY_BPS * 1e6
    rows = []
    want_w, want_ids = route_torch(logits, spec, bias)
    got_w, got_ids = select_experts(logits, spec, bias, use_triton=True)
    same = torch.equal(got_ids, want_ids)
    err = rel_err(got_w, want_w)
    wrap = graphed if device == "cuda" else (lambda f: f)
    for name, fn in (("routing", lambda: select_experts(logits, spec, bias, use_triton=True)),
                     ("torch routing", lambda: route_torch(logits, spec, bias))):
        us = time_us(wrap(fn), device, iters)
        rows.append(Row(shape.name, T, name, us, router_roof, us / router_roof, None, err if name == "routing"
                        else None, ("graph replay; " if device == "cuda" else "") +
                        ("" if name != "routing" else "ids equal torch's" if same else "IDS DIFFER from torch's")))
    layer_roof = layer_roofline_us(shape, touched, itemsize)
    what = "router + routing kernel + experts" + (" + shared experts" if shape.shared else "")
    us = time_us(lambda: packed(x), device, iters)
    rows.append(Row(shape.name, T, "layer", us, layer_roof, us / layer_roof, flops / us / 1e6, None, what + ", eager"))
    if device == "cuda":
        us = time_us(graphed(lambda: packed(x)), device, iters)
        rows.append(Row(shape.name, T, "layer graph", us, layer_roof, us / layer_roof, flops / us / 1e6, None,
                        what + ", graph replay"))
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
    print(f"{'shape':18} {'T':>5} {'variant':18} {'us':>10} {'roofline us':>11} {'ratio':>7} {'TFLOP/s':>8} "
          f"{'err':>8}  note")  # fmt: skip
    for r in rows:
        us = f"{r.us:10.1f}" if r.us is not None else f"{'-':>10}"
        ratio = f"{r.ratio:7.2f}" if r.ratio is not None else f"{'-':>7}"
        tf = f"{r.tflops:8.1f}" if r.tflops is not None else f"{'-':>8}"
        err = f"{r.err:8.1e}" if r.err is not None else f"{'-':>8}"
        print(f"{r.shape:18} {r.tokens:5d} {r.variant:18} {us} {r.roofline_us:11.2f} {ratio} {tf} {err}  {r.note}")


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


def bench_sweep(shapes: tuple[Shape, ...], tokens: tuple[int, ...], device: str, dtype: torch.dtype,
                budget_s: float) -> list:
    """bench/moe_sweep.py over each shape and T, the budget split evenly between them."""
    from bench.moe_sweep import sweep_tokens

    rows = []
    for shape in shapes:
        layer = build_layer(shape, device, dtype)
        ew, _ = packed_of(layer)
        for T in tokens:
            with torch.no_grad():
                rows += sweep_tokens(shape, ew, lambda x, layer=layer: route(layer, x), T,
                                     budget_s / (len(shapes) * len(tokens)))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (Triton interpreter)")
    ap.add_argument("--out", default=".", help="folder for moe_layer.json and moe_layer.png")
    ap.add_argument("--skip-flashinfer", action="store_true", help="leave FlashInfer's fused MoE out")
    ap.add_argument("--flashinfer-timeout-s", type=float, default=300.0,
                    help="time box of FlashInfer's first-call JIT build, per shape (default 300)")
    ap.add_argument("--sweep", action="store_true", help="tile sweep of the fused GEMMs instead (moe_sweep.json/png)")
    ap.add_argument("--sweep-tokens", default="4096,64", help="token counts to sweep (default 4096,64)")
    ap.add_argument("--sweep-shapes", default=None, help="comma-separated shape names (default: all)")
    ap.add_argument("--sweep-budget-s", type=float, default=480.0,
                    help="the sweep's time budget, split evenly over (shape, T) (default 480)")
    ap.add_argument("--flashinfer-warm", default=None, help=argparse.SUPPRESS)  # the build's child process
    args = ap.parse_args(argv)
    if args.flashinfer_warm:
        flashinfer_warm(args.flashinfer_warm)
        return 0
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
        device, dtype, shapes, tokens = "cpu", torch.float32, SMOKE_SHAPES, SMOKE_TOKENS
    else:
        if not torch.cuda.is_available():
            print("needs CUDA (or --smoke)", file=sys.stderr)
            return 2
        device, dtype, shapes, tokens = "cuda", torch.bfloat16, SHAPES, TOKENS
    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device":
            torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "dtype": str(dtype)}  # fmt: skip
    if args.sweep:
        from bench.moe_sweep import as_json, plot_sweep, print_sweep

        if args.sweep_shapes:
            shapes = tuple(s for s in shapes if s.name in args.sweep_shapes.split(","))
        rows = bench_sweep(shapes, tuple(int(t) for t in args.sweep_tokens.split(",")), device, dtype,
                           args.sweep_budget_s)  # fmt: skip
        print_sweep(rows)
        meta["seconds"] = round(time.perf_counter() - t0, 1)
        (out / "moe_sweep.json").write_text(json.dumps({"meta": meta, "rows": as_json(rows)}, indent=1))
        plot_sweep(rows, out / "moe_sweep.png")
        print(f"wrote {out / 'moe_sweep.json'} and {out / 'moe_sweep.png'} in {meta['seconds']} s")
        return 0
    rows = [r for shape in shapes for r in bench_shape(shape, tokens, device, dtype, flashinfer=not
                                                        args.skip_flashinfer,
                                                        flashinfer_timeout_s=args.flashinfer_timeout_s)]  # fmt: skip
    print_table(rows)
    meta["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "moe_layer.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    plot(rows, out / "moe_layer.png")
    print(f"wrote {out / 'moe_layer.json'} and {out / 'moe_layer.png'} in {meta['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
