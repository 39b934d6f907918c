"""Where a CPU `generate` spends its time, by part: wall-clock timers around the model forward,
the attention backend, the MLP, the K/V write, the logits and the sampler (demo model, float32).

    python -m bench.cpu_profile                      # batch 1, 16, 64; one thread
    python -m bench.cpu_profile --batch-sizes 16 --threads 2 --output-len 1   # the prompt alone

Each figure is milliseconds of one `generate` call (--prompt-len random tokens, --output-len
greedy tokens, EOS ignored) after a warm-up call of the same batch. Nested parts are included
in their parents (attention, MLP and K/V write inside the forward).
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import random_prompts
from bench.host_step import _Timers

DEMO_VOCAB = 4096


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from meshserve import LLM, SamplingParams
    from meshserve.attention.backends.cpu_sdpa import CpuSdpaBackend
    from meshserve.demo_model import DEMO_MODEL_DIR
    from meshserve.workers.models.transformer import MLP, CausalLM
    from meshserve.workers.sampler import Sampler

    timers = _Timers(clock=time.perf_counter)  # wall clock: the forward's own threads count too
    totals = timers.now
    parts = [(CausalLM, "forward", "forward"), (CpuSdpaBackend, "forward", "attention"), (MLP, "forward", "mlp"),
             (CpuSdpaBackend, "write_kv", "kv write"), (CpuSdpaBackend, "plan", "attention plan"),
             (CausalLM, "compute_logits", "logits"), (Sampler, "draw", "sampler")]
    for cls, method, part in parts:
        timers.wrap(cls, method, part)
    llm = LLM(DEMO_MODEL_DIR, dtype="float32", device="cpu", attention_backend="CPU_SDPA",
              max_num_seqs=max(int(b) for b in args.batch_sizes.split(",")), max_model_len=512, progress=False)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    rows = {}
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        prompts = random_prompts(bs, args.prompt_len, DEMO_VOCAB, bs)
        # warm-up on other prompts: the same ones would hit the prefix cache and skip the prefill
        llm.generate(random_prompts(bs, args.prompt_len, DEMO_VOCAB, bs + 1000), params)
        totals.clear()
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        rows[bs] = {"whole call": time.perf_counter() - t0, **totals}
    llm.shutdown()
    sizes = list(rows)
    print(f"ms per generate call ({args.prompt_len} in / {args.output_len} out, {args.threads} threads)")
    print("| part | " + " | ".join(f"batch {bs}" for bs in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for part in ["whole call"] + [p for _, _, p in parts]:
        print(f"| {part} | " + " | ".join(f"{rows[bs].get(part, 0.0) * 1e3:.0f}" for bs in sizes) + " |")


if __name__ == "__main__":
    main()
