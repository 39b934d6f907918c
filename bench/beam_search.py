"""n / best_of and beam search: what sharing the prompt's KV saves, and beam search beside HF's.

Two parts, on the bundled demo model (or --model DIR), side by side in one run:
- `n`: one request with n = k against k independent requests (seeds s + i: the same tokens),
  prefix caching off so that only the fork shares the prompt; wall time and tokens computed
  (the fork computes the prompt once, plus one row per sample for its last token).
- `beam`: LLM.beam_search against HF transformers' generate(num_beams=w, do_sample=False) on
  the same checkpoint and device, for each width; wall time, and whether the sequences agree.
Prints a table, writes JSON and a PNG (bench/results/beam_search.{json,png}).

    python -m bench.beam_search                          # CPU, demo model
    python -m bench.beam_search --device cuda --dtype float32 --prompt-len 1000
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from meshserve import LLM, BeamSearchParams, SamplingParams


def _llm(args, *, prefix_caching: bool) -> LLM:
    return LLM(args.model, dtype=args.dtype, device=args.device, num_kv_blocks=args.num_kv_blocks,
               max_model_len=args.max_model_len, enable_prefix_caching=prefix_caching, progress=False)


def _timed(fn, *args, **kwargs):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def bench_n(args, prompt: list[int]) -> list[dict]:
    llm = _llm(args, prefix_caching=False)
    llm.generate([1, 2, 3], SamplingParams(max_tokens=2))  # warm-up
    rows = []
    for k in args.samples:
        base = dict(temperature=0.8, max_tokens=args.new_tokens, ignore_eos=True)
        for mode in ("fork", "independent"):
            before = llm.core.scheduler.stats.num_computed_tokens
            if mode == "fork":
                prompts, params = prompt, SamplingParams(**base, seed=1, n=k)
            else:
                prompts, params = [prompt] * k, [SamplingParams(**base, seed=1 + i) for i in range(k)]
            _, seconds = _timed(llm.generate, prompts, params)
            rows.append({"part": "n", "k": k, "mode": mode, "seconds": seconds,
                         "computed_tokens": llm.core.scheduler.stats.num_computed_tokens - before})
    llm.shutdown()
    return rows


def bench_beam(args, prompt: list[int]) -> list[dict]:
    import transformers

    llm = _llm(args, prefix_caching=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(llm.model_dir, dtype=getattr(torch, args.hf_dtype))
    hf = hf.to(args.device or ("cuda" if torch.cuda.is_available() else "cpu")).eval()
    llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=2))  # warm-up
    rows = []
    for width in args.widths:
        params = BeamSearchParams(beam_width=width, max_tokens=args.new_tokens, ignore_eos=True)
        (out,), ours = _timed(llm.beam_search, prompt, params)
        ids = torch.tensor([prompt], device=hf.device)
        with torch.no_grad():
            ref, theirs = _timed(hf.generate, ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=args.new_tokens, num_beams=width, do_sample=False,
                                 num_return_sequences=width, eos_token_id=None, pad_token_id=0)
        same = [s.token_ids for s in out.sequences] == [r[len(prompt):] for r in ref.tolist()]
        rows.append({"part": "beam", "k": width, "mode": "meshserve", "seconds": ours, "same_as_hf": same})
        rows.append({"part": "beam", "k": width, "mode": "hf", "seconds": theirs, "same_as_hf": same})
    llm.shutdown()
    return rows


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, part, modes, xlabel in ((axes[0], "n", ("fork", "independent"), "n (samples of one prompt)"),
                                    (axes[1], "beam", ("meshserve", "hf"), "beam width")):
        for mode in modes:
            pts = [(r["k"], r["seconds"]) for r in rows if r["part"] == part and r["mode"] == mode]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("seconds")
        ax.legend()
    axes[0].set_title("n samples: forked prompt vs independent requests")
    axes[1].set_title("beam search: meshserve vs HF generate")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the bundled demo model)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--hf-dtype", default="float32")
    p.add_argument("--prompt-len", type=int, default=400)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--samples", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--widths", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    prompt = [5 + (i * 37) % 3000 for i in range(args.prompt_len)]
    rows = bench_n(args, prompt) + bench_beam(args, prompt[:100])
    print(f"{'part':<6}{'k':>4}  {'mode':<12}{'seconds':>9}  {'computed tokens':>16}  same as HF")
    for r in rows:
        print(f"{r['part']:<6}{r['k']:>4}  {r['mode']:<12}{r['seconds']:>9.3f}  {r.get('computed_tokens', ''):>16}"
              f"  {r.get('same_as_hf', '')}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "beam_search.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out / "beam_search.png")


if __name__ == "__main__":
    main()
