"""CPU generation on the bundled demo model: meshserve (per attention backend) against HF
transformers' `generate`, in the same run, on the same checkpoint and prompts.

Per batch size: random prompts of --prompt-len tokens, --output-len greedy tokens each (EOS
ignored), float32; tok/s = output tokens / wall seconds of the whole `generate` call (prefill
included). Each measurement is the best of --repeats after one warm-up call per engine.

    python -m bench.cpu_generate                              # batch 1, 16, 64
    python -m bench.cpu_generate --backends CPU_SDPA,TORCH --batch-sizes 1,16 --repeats 2
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from bench.common import random_prompts


def meshserve_tok_s(backend: str | None, batch_sizes: list[int], args: argparse.Namespace) -> dict[int, float]:
    from meshserve import LLM
    from meshserve.demo_model import DEMO_MODEL_DIR

    llm = LLM(DEMO_MODEL_DIR, dtype="float32", attention_backend=backend, device="cpu",
              max_num_seqs=max(batch_sizes), max_model_len=512, progress=False)
    return llm_tok_s(llm, backend or "auto", batch_sizes, args)


def clock(args: argparse.Namespace):
    """The timer: wall seconds, or with args.clock == "cpu" this process's CPU seconds."""
    return time.process_time if getattr(args, "clock", "wall") == "cpu" else time.perf_counter


def llm_tok_s(llm, label: str, batch_sizes: list[int], args: argparse.Namespace) -> dict[int, float]:
    """Output tok/s of `llm.generate` per batch size (args: prompt_len, output_len, vocab, repeats,
    clock); best of args.repeats after one warm-up call; shuts `llm` down."""
    from meshserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(random_prompts(2, args.prompt_len, args.vocab, 0), params)  # warm-up
    out = {}
    for bs in batch_sizes:
        prompts = random_prompts(bs, args.prompt_len, args.vocab, bs)
        best = float("inf")
        for _ in range(args.repeats):
            t0 = clock(args)()
            outs = llm.generate(prompts, params)
            best = min(best, clock(args)() - t0)
            assert all(len(o.token_ids) == args.output_len for o in outs)
        out[bs] = bs * args.output_len / best
        print(f"meshserve {label:<8} bs={bs:<3} {out[bs]:8.0f} tok/s", flush=True)
    llm.shutdown()
    return out


def hf_tok_s(batch_sizes: list[int], args: argparse.Namespace) -> dict[int, float]:
    from transformers import AutoModelForCausalLM

    from meshserve.demo_model import DEMO_MODEL_DIR

    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    kw = dict(do_sample=False, max_new_tokens=args.output_len, min_new_tokens=args.output_len, pad_token_id=1)
    out = {}
    with torch.inference_mode():
        model.generate(torch.tensor(random_prompts(2, args.prompt_len, args.vocab, 0)), **kw)  # warm-up
        for bs in batch_sizes:
            ids = torch.tensor(random_prompts(bs, args.prompt_len, args.vocab, bs))
            best = float("inf")
            for _ in range(args.repeats):
                t0 = clock(args)()
                gen = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
                best = min(best, clock(args)() - t0)
                assert gen.shape[1] == args.prompt_len + args.output_len
            out[bs] = bs * args.output_len / best
            print(f"HF transformers    bs={bs:<3} {out[bs]:8.0f} tok/s", flush=True)
    return out


def table(results: dict[str, dict[int, float]], batch_sizes: list[int]) -> str:
    names = list(results)
    ours = [n for n in names if n != "HF"]
    head = ["batch"] + [f"{n} tok/s" for n in names] + [f"{n} / HF" for n in ours if "HF" in results]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for bs in batch_sizes:
        row = [str(bs)] + [f"{results[n][bs]:.0f}" for n in names]
        if "HF" in results:
            row += [f"{results[n][bs] / results['HF'][bs]:.2f}x" for n in ours]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="CPU_SDPA,TORCH", help="meshserve attention backends, comma-separated")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    ap.add_argument("--no-hf", action="store_true", help="leave HF transformers out")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.vocab = 4096  # the demo model's vocabulary
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    results = {b: meshserve_tok_s(b, batch_sizes, args) for b in args.backends.split(",")}
    if not args.no_hf:
        results["HF"] = hf_tok_s(batch_sizes, args)
    print(f"\ndemo model, float32, {args.prompt_len} in / {args.output_len} out, best of {args.repeats}; "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(table(results, batch_sizes))


if __name__ == "__main__":
    main()
