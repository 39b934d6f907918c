"""Where a CPU decode step of the engine goes: the bundled demo model, one batch of decodes.

Per batch size: `bs` random 64-token prompts are prefilled, then the engine's decode steps
(`LLM.core.step()`: schedule, metadata, plan, forward, sample, update, outputs) are timed in
CPU seconds of this process (`time.process_time`, one torch thread), which a busy shared machine
disturbs far less than wall time; the step figure is the lowest mean over --blocks blocks of
--steps steps. A cProfile run of --steps more steps splits the step into its parts (cProfile's
own cost inflates the parts that make many Python calls; compare parts between trees, not with
the unprofiled step).

    python -m bench.cpu_step                       # batch 1, 16, 64
    PYTHONPATH=OLD_TREE python bench/cpu_step.py   # the same on another tree's meshserve
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

import torch

PARTS = (  # (label, file fragment, function): cumulative time per step
    ("scheduler.schedule", "engine/scheduler.py", "schedule"),
    ("AttentionMetadata.build", "attention/metadata.py", "build"),
    ("backend plan", "attention/backends/", "plan"),
    ("model forward", "workers/models/transformer.py", "forward"),
    ("logits", "workers/models/transformer.py", "compute_logits"),
    ("sampler (runner._draw)", "workers/runner.py", "_draw"),
    ("scheduler.update", "engine/scheduler.py", "update"),
    ("outputs (detokenize, deltas)", "engine/engine_core.py", "_apply"),
)


def profile(bs: int, args: argparse.Namespace) -> dict[str, float]:
    from bench.common import random_prompts
    from meshserve import LLM, SamplingParams
    from meshserve.demo_model import DEMO_MODEL_DIR

    llm = LLM(DEMO_MODEL_DIR, dtype="float32", device="cpu", max_num_seqs=max(bs, 2), max_model_len=512,
              progress=False)
    steps = args.steps * (args.blocks + 1)
    params = SamplingParams(temperature=0, max_tokens=steps + 16, ignore_eos=True)
    core = llm.core
    reqs = [core.add_request(p, params) for p in random_prompts(bs, 64, 4096, bs)]
    while any(not r.output_ids for r in reqs):
        core.step()
    for _ in range(3):
        core.step()
    best = float("inf")
    for _ in range(args.blocks):
        t0 = time.process_time()
        for _ in range(args.steps):
            core.step()
        best = min(best, (time.process_time() - t0) / args.steps)
    prof = cProfile.Profile(time.process_time)
    prof.enable()
    for _ in range(args.steps):
        core.step()
    prof.disable()
    llm.shutdown()
    stats = pstats.Stats(prof).stats  # (file, line, function) -> (calls, primitive, tottime, cumtime, callers)

    def cum(fragment: str, function: str, pick=sum) -> float:
        return pick([v[3] for k, v in stats.items() if fragment in k[0] and k[2] == function] or [0.0]) / args.steps

    out = {"step (unprofiled)": best, "step (profiled)": cum("engine/engine_core.py", "step")}
    for label, fragment, function in PARTS:  # the model's forward: its outermost call (the largest)
        out[label] = cum(fragment, function, max if label == "model forward" else sum)
    # The runner's own work: _run less the forward, the logits and the draw (metadata and plan included).
    out["runner host work (incl. metadata, plan)"] = (cum("workers/runner.py", "_run") - out["model forward"]
                                                      - out["logits"] - out["sampler (runner._draw)"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--steps", type=int, default=20, help="steps per timed block (and profiled)")
    ap.add_argument("--blocks", type=int, default=5, help="timed blocks; the lowest is kept")
    ap.add_argument("--json", default=None, help="write the figures (ms per step) here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    res = {bs: profile(bs, args) for bs in sizes}
    print("| ms per decode step | " + " | ".join(f"batch {bs}" for bs in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for label in res[sizes[0]]:
        print(f"| {label} | " + " | ".join(f"{res[bs][label] * 1e3:.2f}" for bs in sizes) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({bs: {k: v * 1e3 for k, v in r.items()} for bs, r in res.items()}, f, indent=1)


if __name__ == "__main__":
    main()
