"""What a CPU decode step spends outside its GEMMs and its attention kernel, op by op.

The demo model, one torch thread, `bs` random 64-token prompts prefilled, then the engine's decode
steps (`LLM.core.step()`). First --steps steps without timers (the step figure of bench/cpu_step.py),
then --steps more with a thread-CPU-time timer around each part: the 25 oneDNN linears, the paged
decode kernel, each small op of the layers (residual add + RMSNorm, RoPE, the K/V write, SiLU *
up, the backend's glue around the kernel), the rotary tables and the embedding, the sampler, the
metadata and plan, the engine's scheduler and outputs; "the forward's residual" is the model
forward less its timed parts (module calls, views, and the timers' own cost, about 1-2 us per
timed call) and "other host Python" the step less the forward, the logits and the timed host
parts. The timed steps come after the untimed ones, at longer contexts: read the parts against
each other and between trees, not against the untimed step.

    python -m bench.cpu_step_parts                          # batch 16 and 64
    PYTHONPATH=OLD_TREE python bench/cpu_step_parts.py      # the same on another tree's meshserve
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

CLOCK = time.thread_time  # the step thread's CPU seconds: other jobs on the cores disturb it less


class _Timers:
    """Milliseconds per label; a call inside another of the same label (the torch path's
    add_rms_norm calls rms_norm) counts once."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = defaultdict(float)
        self._open: set[str] = set()

    def around(self, fn, label: str):
        def timed(*args, **kwargs):
            if label in self._open:
                return fn(*args, **kwargs)
            self._open.add(label)
            t0 = CLOCK()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ms[label] += (CLOCK() - t0) * 1e3
                self._open.discard(label)

        return timed

    def wrap(self, owner, name: str, label: str) -> None:
        setattr(owner, name, self.around(getattr(owner, name), label))


def measure(bs: int, steps: int) -> dict[str, float]:
    from bench.common import random_prompts
    from meshserve import LLM, SamplingParams
    from meshserve.attention import metadata
    from meshserve.attention.backends import cpu_sdpa
    from meshserve.demo_model import DEMO_MODEL_DIR
    from meshserve.engine import engine_core, scheduler
    from meshserve.workers import runner
    from meshserve.workers.models import fused_ops
    from meshserve.workers.models import transformer as T

    llm = LLM(DEMO_MODEL_DIR, dtype="float32", device="cpu", max_num_seqs=max(bs, 2), max_model_len=512,
              progress=False)
    core = llm.core
    params = SamplingParams(temperature=0, max_tokens=2 * steps + 16, ignore_eos=True)
    reqs = [core.add_request(p, params) for p in random_prompts(bs, 64, 4096, bs)]
    while any(not r.output_ids for r in reqs):
        core.step()
    for _ in range(3):
        core.step()
    t0 = CLOCK()
    for _ in range(steps):
        core.step()
    untimed = (CLOCK() - t0) * 1e3 / steps

    timers = _Timers()
    model = core.executor.worker.runner.model
    for layer in model.model.layers:
        for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            mod.forward = timers.around(mod.forward, "linears")
    model.lm_head.forward = timers.around(model.lm_head.forward, "lm_head")
    model.model.embed_tokens.forward = timers.around(model.model.embed_tokens.forward, "rotary tables, embedding")
    model.model.rotary.forward = timers.around(model.model.rotary.forward, "rotary tables, embedding")
    kernel = cpu_sdpa.paged_decode_op()
    if kernel is not None:
        timed_kernel = timers.around(kernel, "kernel")
        cpu_sdpa.paged_decode_op = lambda: timed_kernel
    for owner, name, label in [
        (fused_ops, "rms_norm", "norms"), (fused_ops, "add_rms_norm", "norms"), (fused_ops, "act_and_mul", "silu"),
        (T.Attention, "_rotate", "rope"), (fused_ops, "rotary_qk_write_kv", "rope"),
        (cpu_sdpa.CpuSdpaBackend, "write_kv", "kv write"), (cpu_sdpa.CpuSdpaBackend, "forward", "attention"),
        (cpu_sdpa.CpuSdpaBackend, "plan", "metadata, plan"), (metadata.AttentionMetadata, "build", "metadata, plan"),
        (runner.ModelRunner, "_draw", "sampler"), (T.CausalLM, "forward", "forward"),
        (T.CausalLM, "compute_logits", "logits"), (scheduler.Scheduler, "schedule", "engine"),
        (scheduler.Scheduler, "update", "engine"), (engine_core.EngineCore, "_apply", "engine"),
        (engine_core.EngineCore, "step", "step"),
    ]:
        timers.wrap(owner, name, label)
    timers.ms.clear()
    for _ in range(steps):
        core.step()
    llm.shutdown()
    m = defaultdict(float, {k: v / steps for k, v in timers.ms.items()})
    linears = m["linears"] + m["lm_head"]
    in_forward = sum(m[k] for k in ("linears", "attention", "norms", "rope", "kv write", "silu",
                                    "rotary tables, embedding"))
    return {
        "step (no timers)": untimed,
        "step (timed)": m["step"],
        "oneDNN linears (25)": linears,
        "paged decode kernel (6)": m["kernel"],
        "the rest": m["step"] - linears - m["kernel"],
        "- residual add + RMSNorm (13)": m["norms"],
        "- RoPE (6)": m["rope"],
        "- K/V write (6)": m["kv write"],
        "- SiLU * up (6)": m["silu"],
        "- attention glue around the kernel": m["attention"] - m["kernel"],
        "- rotary tables, embedding": m["rotary tables, embedding"],
        "- the forward's residual (module calls, views, timers)": m["forward"] - in_forward,
        "- sampler": m["sampler"],
        "- metadata + backend plan": m["metadata, plan"],
        "- engine: schedule, update, outputs": m["engine"],
        "- other host Python (runner, step)": m["step"] - m["forward"] - m["logits"] - m["sampler"]
        - m["metadata, plan"] - m["engine"],
        "- logits less the LM head": m["logits"] - m["lm_head"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="16,64")
    ap.add_argument("--steps", type=int, default=30, help="decode steps untimed, then timed")
    ap.add_argument("--json", default=None, help="write the figures (ms per step) here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    res = {bs: measure(bs, args.steps) for bs in sizes}
    print("| ms per decode step (thread CPU time) | " + " | ".join(f"batch {bs}" for bs in sizes) + " |")
    print("| --- |" + " ---: |" * len(sizes))
    for label in res[sizes[0]]:
        print(f"| {label} | " + " | ".join(f"{res[bs][label]:.2f}" for bs in sizes) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
