"""End-to-end decode steps: meshserve against a compiled static-cache Llama, in the same run.

On a CPU (`--device cpu` without `--tiny`) it measures the bundled demo model against HF
transformers' `generate` instead, in alternating rounds, and prints the ratios: bench/e2e_cpu.py.

A Llama-3-8B-shaped checkpoint with random bf16 weights is written to disk (sharded safetensors
+ config.json, no download) and loaded by meshserve (`LLM`, the engine's own step loop) and by
the baseline in bench/baseline_llama.py (gpt-fast style, torch.compile reduce-overhead).
Per batch size, with prompts of random tokens already prefilled:
- wall ms per decode step (mean over consecutive steps; the engine's whole step: schedule, run,
  sample, update),
- GPU-busy ms and kernels per step (torch profiler: kernel time summed over a few steps),
- the roofline (weights + the step's KV bytes at the measured copy bandwidth) and our ratio,
- the baseline's ms per step at the same context, and meshserve / baseline.
Then output tokens/s of `generate` (128 in / 256 out, EOS ignored) and time to first token
for long prompts, with MFU against the measured bf16 matmul peak. Table + PNG.

    python -m bench.e2e                          # on the H200: 8B shape, bs 1/16/64/256
    python -m bench.e2e --enforce-eager          # the same without CUDA graphs
    python -m bench.e2e --batch-sizes 1 --quantization fp8 --quantize-lm-head   # FP8 weights, FP8 LM head
    python -m bench.e2e --device cpu --tiny --no-baseline   # smoke run of the GPU bench on a CPU
    python -m bench.e2e --device cpu --out bench/results    # demo model against HF, batch 1/16/64
    python -m bench.e2e --write docs/performance.md --out bench/results
    python -m bench.e2e --model gpt-oss-20b [--layers 24]   # GPT-OSS-20B shape (bench/e2e_gptoss.py)
    python -m bench.e2e --model deepseek-v2-lite            # DeepSeek-V2-Lite shape (bench/e2e_deepseek.py)
    python -m bench.e2e --model deepseek-v2-lite --device cpu --tiny --no-baseline   # its CPU smoke run

The shapes are the table MODELS (name -> shape, checkpoint writer, roofline); adding a model is
one entry. The MoE shapes have no compiled baseline (bench/baseline_llama.py is a Llama); their
roofline counts the experts a step touches (GPT-OSS: sliding layers' KV up to their window;
DeepSeek: MLA's one latent row per token and layer), and the kernel list printed for the
smallest batch shows the MoE kernels (_route_kernel, _gate_up_rows_kernel, _down_rows_kernel)
among the rest. On CUDA the roofline's bandwidth is a device copy measured at the start of the
run (`--bandwidth` overrides it), so an H100 run is held to an H100's memory.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import e2e_deepseek, e2e_gptoss
from bench.common import int_list, random_prompts, save_shards, sync
from bench.report import write_section

BANDWIDTH = 4.18e12  # bytes/s, measured copy bandwidth of the H200 (read + write)
MATMUL_PEAK = 793e12  # FLOP/s, measured bf16 matmul peak of the H200
LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling=None,
)
BEGIN, END = "<!-- bench/e2e.py:begin -->", "<!-- bench/e2e.py:end -->"


def write_checkpoint(path: Path, shape: dict, dtype: torch.dtype, device: str, seed: int = 0) -> int:
    """Random Llama weights as per-layer safetensors shards + index + config.json; returns bytes."""
    g = torch.Generator(device).manual_seed(seed)
    h, inter, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    hd = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * hd

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype).cpu()

    shards = [{"model.embed_tokens.weight": rand(v, h)}]
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shards.append(
            {
                f"{p}.self_attn.q_proj.weight": rand(h, h),
                f"{p}.self_attn.k_proj.weight": rand(kv, h),
                f"{p}.self_attn.v_proj.weight": rand(kv, h),
                f"{p}.self_attn.o_proj.weight": rand(h, h),
                f"{p}.mlp.gate_proj.weight": rand(inter, h),
                f"{p}.mlp.up_proj.weight": rand(inter, h),
                f"{p}.mlp.down_proj.weight": rand(h, inter),
                f"{p}.input_layernorm.weight": torch.ones(h, dtype=dtype),
                f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
            }
        )
    shards.append({"model.norm.weight": torch.ones(h, dtype=dtype), "lm_head.weight": rand(v, h)})
    total = save_shards(path, shards)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": str(dtype)[6:],
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "attention_bias": False,
        "mlp_bias": False,
        **shape,
    }
    if config["rope_scaling"] is None:
        del config["rope_scaling"]
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return total


def decode_weight_bytes(shape: dict, itemsize: int, *, linear_itemsize: int | None = None,
                        head_itemsize: int | None = None) -> int:
    """Bytes a decode step must read: every weight except the embedding table (one row is read).
    `linear_itemsize` / `head_itemsize`: the projections' / LM head's bytes per weight when they
    differ from the model dtype's (FP8: 1; their per-row scales are left out, < 0.1 %)."""
    h, inter, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    projections = h * h * 2 + 2 * kv * h + 3 * h * inter
    layers = shape["num_hidden_layers"] * (projections * (linear_itemsize or itemsize) + 2 * h * itemsize)
    return layers + h * itemsize + v * h * (head_itemsize or itemsize)


def kv_bytes_per_token(shape: dict, itemsize: int) -> int:
    hd = shape["hidden_size"] // shape["num_attention_heads"]
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * hd * itemsize


def prefill_flops(shape: dict, tokens: int) -> float:
    """Matmul FLOPs of a causal prefill: 2 per weight per token, plus QK^T and PV over the causal half."""
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    layer = 2 * h * h + 2 * kv * h + 3 * h * inter
    dense = 2 * tokens * (shape["num_hidden_layers"] * layer + h * shape["vocab_size"] / tokens)
    attention = 2 * tokens * tokens * h * shape["num_hidden_layers"]  # 4 L^2 h / 2 per layer
    return dense + attention


def llama_step_bytes(shape: dict, itemsize: int, batch: int, context: float, **weight_itemsizes: int) -> float:
    """Bytes one decode step of `batch` sequences at `context` tokens must move: weights + KV
    (`weight_itemsizes`: decode_weight_bytes' FP8 sizes)."""
    return (decode_weight_bytes(shape, itemsize, **weight_itemsizes)
            + batch * context * kv_bytes_per_token(shape, itemsize))


@dataclass(frozen=True)
class ModelShape:
    """One `--model`: its shape (HF config fields) and a tiny one, the writer of its random
    checkpoint, and its roofline."""

    title: str
    tiny_title: str
    shape: dict
    tiny: dict
    write_checkpoint: Callable[[Path, dict, torch.dtype, str], int]  # (dir, shape, dtype, device) -> bytes
    step_bytes: Callable[[dict, int, int, float], float]  # (shape, itemsize, batch, context) -> bytes a step moves
    prefill_flops: Callable[[dict, int], float]  # (shape, prompt tokens) -> FLOPs
    roofline_note: str  # what the roofline counts, after "weights + the step's KV bytes"
    baseline: bool  # whether bench/baseline_llama.py (a Llama) can run it


MODELS = {
    "llama3-8b": ModelShape(
        "Llama-3-8B-shaped model", "A tiny Llama", LLAMA3_8B, TINY, write_checkpoint, llama_step_bytes,
        prefill_flops, ".", baseline=True),
    # No compiled baseline for the MoE shapes (bench/baseline_llama.py is a Llama).
    "gpt-oss-20b": ModelShape(
        "GPT-OSS-20B-shaped model", "A tiny GPT-OSS", e2e_gptoss.GPT_OSS_20B, e2e_gptoss.TINY_GPT_OSS,
        e2e_gptoss.write_checkpoint, e2e_gptoss.step_bytes, e2e_gptoss.prefill_flops,
        ". MoE: the experts the batch touches; sliding layers' KV up to the window.", baseline=False),
    "deepseek-v2-lite": ModelShape(
        "DeepSeek-V2-Lite-shaped model", "A tiny DeepSeek-V2", e2e_deepseek.DEEPSEEK_V2_LITE,
        e2e_deepseek.TINY_DEEPSEEK, e2e_deepseek.write_checkpoint, e2e_deepseek.step_bytes,
        e2e_deepseek.prefill_flops,
        ". MoE: the shared experts and the routed experts the batch touches; MLA's KV: one latent + rope key "
        "per token and layer.", baseline=False),
}  # fmt: skip


def copy_bandwidth(device: str) -> float:
    """Bytes/s (read + write) of a 1 GiB device-to-device copy, median of 10, measured in this run so
    that the roofline is this GPU's (an H100's is lower than the H200's 4.18 TB/s); CPU: BANDWIDTH."""
    if device != "cuda":
        return BANDWIDTH
    src = torch.randint(0, 255, (1 << 30,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(13):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:  # warm-up
            times.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / statistics.median(times)


def gpu_profile(run_steps, steps: int) -> tuple[float, float, list]:
    """(GPU-busy seconds, kernels, by name) per step over `steps` steps: kernel durations summed (one
    stream); by name: [(kernel name, launches per step, microseconds per step)], slowest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_steps(steps)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    busy = sum(e.device_time_total for e in kernels) * 1e-6  # us -> s
    names: dict[str, list[float]] = {}
    for e in kernels:
        entry = names.setdefault(e.name[:90], [0, 0.0])
        entry[0] += 1
        entry[1] += e.device_time_total
    by_name = sorted(((n, c / steps, t / steps) for n, (c, t) in names.items()), key=lambda r: -r[2])
    return busy / steps, len(kernels) / steps, by_name


def timeline(run_steps, steps: int, path: Path) -> str:
    """A torch-profiler trace (CPU with Python stacks, CUDA) of `steps` steps, gzipped to `path`;
    returns bench/trace_gaps.py's summary of the device's idle gaps in it."""
    import gzip
    import shutil
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from bench.trace_gaps import device_gaps, load, summarize

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        run_steps(steps)
        torch.cuda.synchronize()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(suffix=".json") as raw:
        prof.export_chrome_trace(raw.name)
        gaps = device_gaps(load(raw.name))
        with open(raw.name, "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return f"timeline: {path}\n" + summarize(gaps, steps)


def decode_steps(llm, bs: int, args: argparse.Namespace, vocab: int) -> dict:
    """Prefill bs prompts, then time the engine's decode steps one by one."""
    from meshserve import SamplingParams

    core = llm.core
    timed, profiled = args.steps, 5 if args.device == "cuda" else 0
    params = SamplingParams(temperature=0, max_tokens=timed + 2 * profiled + 12, ignore_eos=True)
    reqs = [core.add_request(p, params) for p in random_prompts(bs, args.prompt_len, vocab, bs)]
    while any(not r.output_ids for r in reqs):  # prefill (chunked under the token budget)
        core.step()
    for _ in range(5):
        core.step()
    # No synchronisation between the steps: with overlap scheduling the device runs step N while
    # the host plans step N+1, and a sync would undo exactly that. Mean over the timed steps.
    sync(args.device)
    t0 = time.perf_counter()
    for _ in range(timed):
        core.step()
    sync(args.device)
    wall = (time.perf_counter() - t0) / timed
    context = statistics.mean(len(r.prompt_ids) + len(r.output_ids) for r in reqs)
    busy = kernels = math.nan
    by_name: list = []
    if profiled:
        def run(n: int) -> None:
            for _ in range(n):
                core.step()

        busy, kernels, by_name = gpu_profile(run, profiled)
        if args.host_profile and args.out:  # where the host's part of a step goes
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.runcall(run, profiled)
            with open(Path(args.out) / f"host_bs{bs}.txt", "w") as f:
                pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(40)
        if args.timeline and args.out:  # which host work each device idle gap waited for
            print(f"bs={bs} " + timeline(run, profiled, Path(args.out) / f"timeline_bs{bs}.json.gz"), flush=True)
    while core.has_unfinished():
        core.step()
    return {"wall_s": wall, "busy_s": busy, "kernels": kernels, "context": context, "by_kernel": by_name}


def ttft(llm, length: int, vocab: int, device: str, seed: int) -> float:
    """Seconds from adding one fresh prompt (no prefix-cache hit) to its first token."""
    from meshserve import SamplingParams

    core = llm.core
    req = core.add_request(random_prompts(1, length, vocab, seed)[0], SamplingParams(max_tokens=1))
    sync(device)
    t0 = time.perf_counter()
    while not req.output_ids:
        core.step()
    sync(device)
    elapsed = time.perf_counter() - t0
    while core.has_unfinished():
        core.step()
    return elapsed


def bench_meshserve(path: Path, args: argparse.Namespace, shape: dict) -> dict:
    from meshserve import LLM, SamplingParams

    vocab = shape["vocab_size"]
    longest = max([args.prompt_len + args.output_len, *args.ttft_lens]) + 64
    t0 = time.perf_counter()
    llm = LLM(path, dtype=args.dtype, attention_backend=args.attention_backend, device=args.device,
              max_model_len=-(-longest // 256) * 256, kv_cache_memory_bytes=args.kv_bytes,
              max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=max([8192, *args.ttft_lens]),
              enforce_eager=args.enforce_eager, async_scheduling=False if args.no_async_scheduling else None,
              progress=False,
              quantization=args.quantization, small_m_gemm=args.small_m_gemm,
              quantize_lm_head=args.quantize_lm_head)
    start_s = time.perf_counter() - t0
    graphs = llm.core.executor.worker.runner.decode_graphs
    out = {"backend": llm.core.info.backend, "start_s": start_s, "graphs": graphs is not None,
           "overlap": llm.core.overlap,
           "capture_s": graphs.capture_seconds if graphs else 0.0,
           "capture_mib": graphs.capture_bytes / 2**20 if graphs else 0.0, "steps": {}, "tok_s": {}, "ttft": {}}
    print(f"meshserve ready in {start_s:.1f} s (backend {out['backend']}, graphs {out['graphs']}, "
          f"capture {out['capture_s']:.1f} s / {out['capture_mib']:.0f} MiB)", flush=True)
    llm.generate(random_prompts(2, args.prompt_len, vocab, 0), SamplingParams(temperature=0, max_tokens=8))
    for bs in args.batch_sizes:
        out["steps"][bs] = r = decode_steps(llm, bs, args, vocab)
        print(f"meshserve bs={bs:<3} {r['wall_s'] * 1e3:7.2f} ms/step  busy {r['busy_s'] * 1e3:6.2f} ms  "
              f"{r['kernels']:.0f} kernels", flush=True)
        if bs == args.batch_sizes[0]:  # where the launches of the smallest batch go
            for name, count, us in sorted(r["by_kernel"], key=lambda k: -k[1])[:25]:
                print(f"    {count:6.1f} x {us:8.1f} us  {name}", flush=True)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for bs in args.throughput_sizes:
        prompts = random_prompts(bs, args.prompt_len, vocab, bs + 1)
        sync(args.device)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        sync(args.device)
        elapsed = time.perf_counter() - t0
        assert all(len(o.token_ids) == args.output_len for o in outs)
        out["tok_s"][bs] = bs * args.output_len / elapsed
        print(f"meshserve generate bs={bs}: {out['tok_s'][bs]:.0f} tok/s", flush=True)
    for length in args.ttft_lens:
        ttft(llm, length, vocab, args.device, seed=length)  # warm-up: compile the prefill tiles for this length
        out["ttft"][length] = ttft(llm, length, vocab, args.device, seed=length + 1)
        print(f"meshserve TTFT {length}: {out['ttft'][length] * 1e3:.1f} ms", flush=True)
    llm.shutdown()
    del llm
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def bench_baseline(path: Path, args: argparse.Namespace, contexts: dict[int, float]) -> dict[int, tuple]:
    from bench.baseline_llama import time_decode

    out = {}
    for bs in args.batch_sizes:
        try:
            out[bs] = time_decode(path, batch=bs, context=round(contexts[bs]), steps=args.steps + 3,
                                  device=args.device, dtype=getattr(torch, args.dtype))
        except Exception as exc:  # a failed baseline must not cost the meshserve numbers
            print(f"baseline bs={bs} failed: {type(exc).__name__}: {exc}"[:400], flush=True)
            out[bs] = (math.nan, math.nan)
        print(f"baseline  bs={bs:<3} {out[bs][1] * 1e3:7.2f} ms/step (compile {out[bs][0]:.0f} s)", flush=True)
    return out


def report(args: argparse.Namespace, model: ModelShape, shape_name: str, shape: dict, ours: dict,
           base: dict) -> tuple[str, list]:  # fmt: skip
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    itemsize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    step_bytes, fp8_note = model.step_bytes, ""
    if args.quantization == "fp8":
        if model.step_bytes is llama_step_bytes:  # FP8 projections (and head): 1 byte a weight
            step_bytes = functools.partial(llama_step_bytes, linear_itemsize=1,
                                           head_itemsize=1 if args.quantize_lm_head else None)
            fp8_note = " FP8 weights counted at 1 byte each (scales left out)."
        else:
            fp8_note = f" Weights counted at {args.dtype}'s size, not FP8's (not modelled for this shape)."
    weights, bandwidth = step_bytes(shape, itemsize, 1, 0), args.bandwidth
    mode = ("CUDA graphs" if ours["graphs"] else "eager") + (", overlap scheduling" if ours["overlap"] else "")
    lines = [
        BEGIN,
        "## End-to-end decode (bench/e2e.py)",
        "",
        f"{shape_name} with random {args.dtype} weights on {device} (quantization {args.quantization}"
        f"{', LM head in FP8 too' if args.quantize_lm_head else ''}, "
        f"small_m_gemm {args.small_m_gemm}); torch {torch.__version__}; attention "
        f"backend {ours['backend']}, decode steps {mode} (start-up {ours['start_s']:.1f} s, of which graph "
        f"capture {ours['capture_s']:.1f} s and {ours['capture_mib']:.0f} MiB). Prompts of {args.prompt_len} "
        "random tokens, already prefilled; one engine step = schedule, run, sample, update. Roofline = "
        f"weights ({weights / 1e9:.2f} GB at batch 1) + the step's KV bytes at {bandwidth / 1e12:.2f} TB/s "
        f"({args.bandwidth_source}){model.roofline_note}{fp8_note}"
        + ("" if args.no_baseline else " Baseline: bench/baseline_llama.py, a static-cache Llama under "
           "torch.compile(mode=\"reduce-overhead\") on the same checkpoint, in the same run."),
        "",
        "| batch | context | wall ms/step | GPU-busy ms | busy % | kernels/step | roofline ms | roofline / wall "
        "| baseline ms | speed vs baseline |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    rows = []
    for bs in args.batch_sizes:
        r = ours["steps"][bs]
        roof = step_bytes(shape, itemsize, bs, r["context"]) / bandwidth
        b = base.get(bs, (math.nan, math.nan))[1]
        rows.append((bs, r["wall_s"], r["busy_s"], roof, b))
        lines.append(
            f"| {bs} | {r['context']:.0f} | {r['wall_s'] * 1e3:.2f} | {r['busy_s'] * 1e3:.2f} | "
            f"{r['busy_s'] / r['wall_s']:.0%} | {r['kernels']:.0f} | {roof * 1e3:.2f} | {roof / r['wall_s']:.0%} | "
            f"{b * 1e3:.2f} | {b / r['wall_s']:.2f}x |" if b == b else
            f"| {bs} | {r['context']:.0f} | {r['wall_s'] * 1e3:.2f} | {r['busy_s'] * 1e3:.2f} | "
            f"{r['busy_s'] / r['wall_s']:.0%} | {r['kernels']:.0f} | {roof * 1e3:.2f} | {roof / r['wall_s']:.0%} | "
            "- | - |"
        )
    lines.append("")
    for bs, tok_s in ours["tok_s"].items():
        lines.append(f"- `generate`, batch {bs}, {args.prompt_len} in / {args.output_len} out: {tok_s:,.0f} "
                     "output tok/s.")
    for length, t in ours["ttft"].items():
        flops = model.prefill_flops(shape, length)
        lines.append(f"- Time to first token, one {length}-token prompt: {t * 1e3:.1f} ms "
                     f"({flops / t / 1e12:.0f} TFLOP/s effective, {flops / t / MATMUL_PEAK:.0%} MFU).")
    lines.append(END)
    return "\n".join(lines), rows


def plot(rows: list, path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return
    bs = [str(r[0]) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.2
    for k, (label, idx) in enumerate((("meshserve wall", 1), ("meshserve GPU busy", 2), ("roofline", 3),
                                      ("compiled baseline", 4))):
        ax.bar([i + (k - 1.5) * width for i in range(len(bs))], [r[idx] * 1e3 for r in rows], width, label=label)
    ax.set_xticks(range(len(bs)), bs)
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("ms per decode step")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer toy shape (CPU smoke run)")
    ap.add_argument("--model", default="llama3-8b", choices=list(MODELS), help="the shape (MODELS)")
    ap.add_argument("--layers", type=int, default=None, help="keep this many layers (default: the model's)")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--batch-sizes", default=None, help="decode batches (default 1,16,64,256; tiny: 1,4)")
    ap.add_argument("--throughput-sizes", default=None, help="generate() batches (default 64; tiny: 4)")
    ap.add_argument("--ttft-lens", default=None, help="long prompts for TTFT (default 4096,16384; tiny: none)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128 (tiny: 16)")
    ap.add_argument("--output-len", type=int, default=None, help="default 256 (tiny: 16)")
    ap.add_argument("--bandwidth", type=float, default=None,
                    help="TB/s of the roofline (default: CUDA: a device copy measured in this run; CPU: 4.18)")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size")
    ap.add_argument("--attention-backend", default=None,
                    help="a backend name, or a phase split prefill=NAME,decode=NAME (default: automatic)")
    ap.add_argument("--quantization", default="none",
                    help="fp8: meshserve with online FP8 weights (docs/quantization.md)")
    ap.add_argument("--quantize-lm-head", action="store_true",
                    help="with --quantization fp8: the LM head in FP8 too (ModelConfig.quantize_lm_head)")
    ap.add_argument("--small-m-gemm", default="auto", choices=["auto", "on", "off"],
                    help="meshserve's decode GEMMs on the weight-streaming kernel (docs/engine.md)")
    ap.add_argument("--enforce-eager", action="store_true", help="meshserve without CUDA graphs")
    ap.add_argument("--no-async-scheduling", action="store_true", help="meshserve without overlap scheduling")
    ap.add_argument("--kv-bytes", type=int, default=None, help="KV cache budget (default 24 GiB on CUDA)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the compiled baseline (CPU: HF transformers)")
    ap.add_argument("--rounds", type=int, default=3, help="CPU: alternating meshserve / HF rounds (best is kept)")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU: torch intra-op threads of both engines (default: meshserve's own choice, "
                         "meshserve/core/cpu_threads.py; HF at torch's)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="CPU: time generate by wall seconds, or by this process's CPU seconds (steadier on a "
                         "shared machine with one thread; it leaves out time spent waiting for a core)")
    ap.add_argument("--host-profile", action="store_true", help="cProfile a few steps per batch (into --out)")
    ap.add_argument("--timeline", action="store_true",
                    help="CUDA: a profiler trace of a few steps per batch (into --out) and its idle-gap summary")
    ap.add_argument("--workdir", default=None, help="where the checkpoint is written (default: a temp dir)")
    ap.add_argument("--write", default=None, help="put the results section into this markdown file")
    ap.add_argument("--out", default=None, help="folder for the PNG plot and the JSON results")
    args = ap.parse_args(argv)
    if args.device == "cpu" and not args.tiny:  # the demo model against HF transformers
        from bench import e2e_cpu

        args.batch_sizes = int_list(args.batch_sizes or "1,16,64")
        return e2e_cpu.main(args)
    model = MODELS[args.model]
    shape = model.tiny if args.tiny else model.shape
    shape_name = model.tiny_title if args.tiny else model.title
    if args.layers:
        shape, shape_name = {**shape, "num_hidden_layers": args.layers}, f"{shape_name} ({args.layers} layers)"
    args.no_baseline = args.no_baseline or not model.baseline
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.batch_sizes = int_list(args.batch_sizes or ("1,4" if args.tiny else "1,16,64,256"))
    args.throughput_sizes = int_list(args.throughput_sizes or ("4" if args.tiny else "64"))
    args.ttft_lens = int_list(args.ttft_lens if args.ttft_lens is not None else ("" if args.tiny else "4096,16384"))
    args.prompt_len = args.prompt_len or (16 if args.tiny else 128)
    args.output_len = args.output_len or (16 if args.tiny else 256)
    if args.kv_bytes is None and args.device == "cuda":
        args.kv_bytes = 24 << 30
    if args.bandwidth is not None:
        args.bandwidth, args.bandwidth_source = args.bandwidth * 1e12, "given"
    else:
        args.bandwidth = copy_bandwidth(args.device)
        args.bandwidth_source = "a device copy measured in this run" if args.device == "cuda" else "the H200's"
    print(f"roofline bandwidth: {args.bandwidth / 1e12:.2f} TB/s ({args.bandwidth_source})", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="meshserve_e2e_", dir=args.workdir))
    try:
        t0 = time.perf_counter()
        size = model.write_checkpoint(workdir, shape, getattr(torch, args.dtype), args.device)
        print(f"checkpoint: {size / 1e9:.2f} GB written in {time.perf_counter() - t0:.1f} s", flush=True)
        ours = bench_meshserve(workdir, args, shape)
        contexts = {bs: r["context"] for bs, r in ours["steps"].items()}
        base = {} if args.no_baseline else bench_baseline(workdir, args, contexts)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    section, rows = report(args, model, shape_name, shape, ours, base)
    print(section)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "e2e.json").write_text(json.dumps({"meshserve": ours, "baseline": base, "bandwidth": args.bandwidth},
                                                  indent=1, default=str))
        plot(rows, out / "e2e.png", f"{shape_name}, {args.dtype}: one decode step")
    if args.write:
        write_section(Path(args.write), section, BEGIN, END)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
