"""Encoder-decoder (BART) generation: meshserve per attention backend against HF transformers'
`generate`, in the same run, on one random-weight checkpoint built here (no download).

Shapes: --shape tiny (d_model 256, 4+4 layers: the CPU default) or base (bart-base: d_model 768,
6+6 layers, 12 heads, vocabulary 50265). Per batch size: random encoder inputs of --prompt-len
tokens, --output-len greedy tokens each (EOS ignored); tok/s = output tokens / wall seconds of the
whole `generate` call (the encoder included); best of --repeats after one warm-up call per engine.
Prints a table and writes a PNG (--plot).

    python -m bench.encdec                                           # CPU: tiny, batch 1, 8, 32
    python -m bench.encdec --device cuda --shape base --dtype bfloat16 --backends TRITON \\
        --batch-sizes 1,16,64,256 --plot docs/encdec-h200.png
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import torch

from bench.common import random_prompts
from bench.cpu_generate import llm_tok_s, table
from bench.report import pyplot

SHAPES = {
    "tiny": dict(vocab_size=8192, d_model=256, encoder_layers=4, decoder_layers=4, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=1024, decoder_ffn_dim=1024),
    "base": dict(vocab_size=50265, d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                 decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072),
}


def write_checkpoint(path: Path, shape: str):
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(**SHAPES[shape], max_position_embeddings=1024, forced_eos_token_id=None, dropout=0.0)
    torch.manual_seed(0)
    BartForConditionalGeneration(cfg).save_pretrained(path)
    return cfg


def meshserve_tok_s(path: Path, backend: str, batch_sizes: list[int], args) -> dict[int, float]:
    from meshserve import LLM

    llm = LLM(path, dtype=args.dtype, attention_backend=backend, device=args.device,
              max_num_seqs=max(batch_sizes), max_num_batched_tokens=max(8192, max(batch_sizes) * (args.prompt_len + 2)),
              max_model_len=args.output_len + 8, progress=False)
    return llm_tok_s(llm, backend, batch_sizes, args)


def hf_tok_s(path: Path, batch_sizes: list[int], args) -> dict[int, float]:
    from transformers import BartForConditionalGeneration

    dtype = getattr(torch, args.dtype)
    model = BartForConditionalGeneration.from_pretrained(path, dtype=dtype).to(args.device).eval()
    kw = dict(do_sample=False, max_new_tokens=args.output_len, min_new_tokens=args.output_len, pad_token_id=1)
    out = {}
    with torch.inference_mode():
        model.generate(torch.tensor(random_prompts(2, args.prompt_len, args.vocab, 0), device=args.device), **kw)
        for bs in batch_sizes:
            ids = torch.tensor(random_prompts(bs, args.prompt_len, args.vocab, bs), device=args.device)
            best = float("inf")
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                gen = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
                assert gen.shape[1] == args.output_len + 1  # the decoder start token, then the outputs
            out[bs] = bs * args.output_len / best
            print(f"HF transformers    bs={bs:<4} {out[bs]:9.0f} tok/s", flush=True)
    return out


def plot(results: dict[str, dict[int, float]], batch_sizes: list[int], title: str, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, row in results.items():
        ax.plot(batch_sizes, [row[b] for b in batch_sizes], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("output tokens / s")
    ax.set_title(title, fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--backends", default="CPU_SDPA,TORCH", help="meshserve attention backends, comma-separated")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=128, help="encoder input tokens")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true", help="leave HF transformers out")
    ap.add_argument("--plot", default="encdec.png", help="PNG path")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.vocab = SHAPES[args.shape]["vocab_size"]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(Path(tmp), args.shape)
        results = {b: meshserve_tok_s(Path(tmp), b, batch_sizes, args) for b in args.backends.split(",")}
        if not args.no_hf:
            results["HF"] = hf_tok_s(Path(tmp), batch_sizes, args)
    where = torch.cuda.get_device_name() if args.device == "cuda" else (platform.processor() or platform.machine())
    title = (f"BART {args.shape}, {args.dtype}, {args.prompt_len} in / {args.output_len} out, best of "
             f"{args.repeats}; {where}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("\n" + title)
    print(table(results, batch_sizes))
    plot(results, batch_sizes, title, args.plot)


if __name__ == "__main__":
    main()
