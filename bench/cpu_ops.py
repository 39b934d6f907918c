"""Torch ops per decode step on a CPU: meshserve `LLM.generate` against HF transformers' `generate`.

The demo model is tiny, so a CPU decode step is dominated by how many ops it dispatches, not by
their math; and on the 2-core machine an op after a layer's GEMVs runs with cold caches (an
`add` of 256 floats: about 8 us against 1 us warm). This bench counts the ops each engine
dispatches from Python per decode step (top-level `aten::` events of torch.profiler: an op
called inside another, such as `mm` inside `linear`, is not counted again), by op name, and
every aten dispatch including those made inside composite ops (`F.rms_norm` is one top-level
op and 13 dispatches). Times
are left out: profiled per-op times on a shared 2-core machine move more than the differences.
Per decode step = (a generate of --long tokens minus one of --short tokens) / (long - short),
so the prompt's prefill cancels out.

    python -m bench.cpu_ops                      # batch 1 and 16, one thread
    python -m bench.cpu_ops --batch-sizes 64 --top 25
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import random_prompts

DEMO_VOCAB = 4096


ALL = "every aten dispatch"


def _top_level_ops(run) -> Counter:
    """Calls per top-level aten op (not called from inside another aten op) of one call of `run`,
    and under ALL the count of every aten event (nested ones too)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    aten = [evt for evt in prof.events() if evt.name.startswith("aten::")]
    counts = Counter(evt.name for evt in aten
                     if evt.cpu_parent is None or not evt.cpu_parent.name.startswith("aten::"))
    counts[ALL] = len(aten)
    return counts


def per_step(make_run, short: int, long: int) -> Counter:
    """Ops per decode step: the difference of a long and a short generate, over the extra steps."""
    make_run(short)()  # warm-up
    c0 = _top_level_ops(make_run(short))
    c1 = _top_level_ops(make_run(long))
    return Counter({k: (c1[k] - c0[k]) / (long - short) for k in c1})


def meshserve_runs(bs: int):
    from meshserve import LLM, SamplingParams
    from meshserve.demo_model import DEMO_MODEL_DIR

    llm = LLM(DEMO_MODEL_DIR, dtype="float32", device="cpu", max_num_seqs=max(bs, 2), max_model_len=512,
              progress=False)
    prompts = random_prompts(bs, 64, DEMO_VOCAB, bs)

    def make_run(n: int):
        return lambda: llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))

    return make_run


def hf_runs(bs: int):
    from transformers import AutoModelForCausalLM

    from meshserve.demo_model import DEMO_MODEL_DIR

    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    ids = torch.tensor(random_prompts(bs, 64, DEMO_VOCAB, bs))

    def make_run(n: int):
        def run():
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                               min_new_tokens=n, pad_token_id=1)
        return run

    return make_run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--short", type=int, default=10)
    ap.add_argument("--long", type=int, default=40)
    ap.add_argument("--top", type=int, default=15, help="op names listed (by the larger op count)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        ours = per_step(meshserve_runs(bs), args.short, args.long)
        hf = per_step(hf_runs(bs), args.short, args.long)
        print(f"\nbatch {bs}: top-level torch ops per decode step")
        print("| op | meshserve | HF transformers |")
        print("|---|---:|---:|")
        every = ours.pop(ALL), hf.pop(ALL)
        names = sorted(set(ours) | set(hf), key=lambda k: -max(ours[k], hf[k]))
        for k in names[: args.top]:
            print(f"| {k.removeprefix('aten::')} | {ours[k]:.0f} | {hf[k]:.0f} |")
        rest = names[args.top:]
        print(f"| {len(rest)} others | {sum(ours[k] for k in rest):.0f} | {sum(hf[k] for k in rest):.0f} |")
        print(f"| **all top-level** | **{sum(ours.values()):.0f}** | **{sum(hf.values()):.0f}** |")
        print(f"| **{ALL}** (nested too) | **{every[0]:.0f}** | **{every[1]:.0f}** |")


if __name__ == "__main__":
    main()
