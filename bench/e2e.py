"""End-to-end generation throughput: meshserve.LLM against HF transformers' `generate`, same run.

A Llama-3-8B-shaped checkpoint with random bf16 weights is written to disk (sharded safetensors
+ config.json, no download) and loaded by both. For each batch size: prompts of random tokens,
greedy decoding of a fixed number of tokens (EOS ignored), output tokens per second of wall
time. The bs=1 decode step time is set against the weight-bytes roofline (every weight but
the embedding table read once per step at the measured copy bandwidth).

    python -m bench.e2e                          # on the H200: 8B shape, bs 1/16/64, 128 in / 256 out
    python -m bench.e2e --device cpu --tiny      # smoke run on a CPU
    python -m bench.e2e --write docs/performance.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.report import write_section

BANDWIDTH = 4.18e12  # bytes/s, measured copy bandwidth of the H200 (read + write)
LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
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
    from safetensors.torch import save_file

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
    weight_map, total = {}, 0
    for k, tensors in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        for t_name, t in tensors.items():
            weight_map[t_name] = name
            total += t.numel() * t.element_size()
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
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


def decode_weight_bytes(shape: dict, itemsize: int) -> int:
    """Bytes a decode step must read: every weight except the embedding table (one row is read)."""
    h, inter, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    layer = h * h * 2 + 2 * kv * h + 3 * h * inter + 2 * h
    return (shape["num_hidden_layers"] * layer + h + v * h) * itemsize


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def bench_meshserve(path: Path, args: argparse.Namespace, vocab: int) -> tuple[dict, dict]:
    from meshserve import LLM, SamplingParams

    llm = LLM(
        path,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        device=args.device,
        max_model_len=args.prompt_len + args.output_len + 16,
        kv_cache_memory_bytes=args.kv_bytes,
        max_num_seqs=max(args.batch_sizes),
        max_num_batched_tokens=max(8192, args.prompt_len * 2),
        progress=False,
    )
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(random_prompts(2, args.prompt_len, vocab, 0), SamplingParams(temperature=0, max_tokens=8))
    results = {}
    for bs in args.batch_sizes:
        prompts = random_prompts(bs, args.prompt_len, vocab, bs)
        sync(args.device)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        sync(args.device)
        elapsed = time.perf_counter() - t0
        assert all(len(o.token_ids) == args.output_len for o in outs)
        results[bs] = bs * args.output_len / elapsed
        print(f"meshserve bs={bs:<3} {results[bs]:10.1f} tok/s  ({elapsed:.2f} s)", flush=True)
    # bs=1 step times, step by step: the first step is the prefill, the rest are decodes.
    core = llm.core
    core.add_request(random_prompts(1, args.prompt_len, vocab, 7)[0], params)
    times = []
    while core.has_unfinished():
        sync(args.device)
        t0 = time.perf_counter()
        core.step()
        sync(args.device)
        times.append(time.perf_counter() - t0)
    step = {"prefill_s": times[0], "decode_median_s": statistics.median(times[1:]), "backend": core.info.backend}
    llm.shutdown()
    del llm
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return results, step


def bench_hf(path: Path, args: argparse.Namespace, vocab: int) -> tuple[dict, float] | None:
    try:
        import transformers
    except ImportError:
        print("HF transformers is not installed: no comparison", flush=True)
        return None
    dtype = getattr(torch, args.dtype)
    dtype_kw = {"dtype": dtype} if int(transformers.__version__.split(".")[0]) >= 5 else {"torch_dtype": dtype}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, **dtype_kw).to(args.device).eval()

    def generate(prompts: list[list[int]], new: int) -> float:
        ids = torch.tensor(prompts, device=args.device)
        sync(args.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        sync(args.device)
        assert out.shape[1] == ids.shape[1] + new
        return time.perf_counter() - t0

    generate(random_prompts(2, args.prompt_len, vocab, 0), 8)
    results = {}
    for bs in args.batch_sizes:
        elapsed = generate(random_prompts(bs, args.prompt_len, vocab, bs), args.output_len)
        results[bs] = bs * args.output_len / elapsed
        print(f"HF        bs={bs:<3} {results[bs]:10.1f} tok/s  ({elapsed:.2f} s)", flush=True)
    one = generate(random_prompts(1, args.prompt_len, vocab, 7), args.output_len) / args.output_len
    return results, one


def report(
    args: argparse.Namespace,
    shape_name: str,
    ours: dict,
    step: dict,
    hf: tuple | None,
    roofline_s: float,
    weight_bytes: int,
) -> str:
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    lines = [
        BEGIN,
        "## End-to-end generation (bench/e2e.py)",
        "",
        f"{shape_name} with random {args.dtype} weights on {device}; torch {torch.__version__}; "
        f"attention backend {step['backend']}; {args.prompt_len} prompt tokens, {args.output_len} generated "
        "(greedy, EOS ignored); output tokens per second of wall time, HF transformers "
        "`generate` in the same run.",
        "",
        "| batch | meshserve tok/s | HF tok/s | meshserve / HF |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for bs in args.batch_sizes:
        theirs = hf[0][bs] if hf else math.nan
        lines.append(f"| {bs} | {ours[bs]:.1f} | {theirs:.1f} | {ours[bs] / theirs:.2f}x |")
    decode = step["decode_median_s"]
    lines += [
        "",
        f"bs=1 decode step (median): {decode * 1e3:.2f} ms; weight-bytes roofline "
        f"{weight_bytes / 1e9:.2f} GB / {BANDWIDTH / 1e12:.2f} TB/s = {roofline_s * 1e3:.2f} ms "
        f"({roofline_s / decode:.0%} of roofline)"
        + (f"; HF {hf[1] * 1e3:.2f} ms per token" if hf else "")
        + f"; bs=1 prefill of {args.prompt_len} tokens: {step['prefill_s'] * 1e3:.1f} ms.",
        END,
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer toy shape (CPU smoke run)")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--batch-sizes", default=None, help="comma separated (default 1,16,64; tiny: 1,4)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128 (tiny: 16)")
    ap.add_argument("--output-len", type=int, default=None, help="default 256 (tiny: 16)")
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--kv-bytes", type=int, default=None, help="KV cache budget (default 16 GiB on CUDA)")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers comparison")
    ap.add_argument("--workdir", default=None, help="where the checkpoint is written (default: a temp dir)")
    ap.add_argument("--write", default=None, help="put the results section into this markdown file")
    args = ap.parse_args(argv)
    shape, shape_name = (TINY, "A tiny Llama") if args.tiny else (LLAMA3_8B, "Llama-3-8B-shaped model")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.batch_sizes = [int(b) for b in (args.batch_sizes or ("1,4" if args.tiny else "1,16,64")).split(",")]
    args.prompt_len = args.prompt_len or (16 if args.tiny else 128)
    args.output_len = args.output_len or (16 if args.tiny else 256)
    if args.kv_bytes is None and args.device == "cuda":
        args.kv_bytes = 16 << 30
    workdir = Path(tempfile.mkdtemp(prefix="meshserve_e2e_", dir=args.workdir))
    try:
        t0 = time.perf_counter()
        size = write_checkpoint(workdir, shape, getattr(torch, args.dtype), args.device)
        print(f"checkpoint: {size / 1e9:.2f} GB written in {time.perf_counter() - t0:.1f} s", flush=True)
        ours, step = bench_meshserve(workdir, args, shape["vocab_size"])
        hf = None if args.no_hf else bench_hf(workdir, args, shape["vocab_size"])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    itemsize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    weight_bytes = decode_weight_bytes(shape, itemsize)
    section = report(args, shape_name, ours, step, hf, weight_bytes / BANDWIDTH, weight_bytes)
    print(section)
    if args.write:
        write_section(Path(args.write), section, BEGIN, END)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
