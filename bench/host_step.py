"""The HOST cost of one decode step, split by stage, with a device side that costs ~nothing.

The engine runs as it serves (EngineCore with overlap scheduling, the scheduler and KV
manager, the detokenizer of the demo model's tokenizer, a ModelRunner whose decode steps go
through DecodeGraphs' static buffers with capture=False), with three stand-ins so that only the
host's work is left, all of them in this file only:
- the model: a forward that returns zeros and logits from a fixed random bank (no matmul);
- the attention backend: FlashInfer's host work (its page lists for every plan and replay) and
  nothing else (no kernel runs: the stand-in model calls no attention);
- the executor: the plan goes through msgpack both ways, as remote ranks get it.
Per batch size, `bs` requests with long prompts (--prompt tokens, so the block tables are
--prompt/16 blocks wide) are prefilled, then --steps decode steps are timed (process CPU time,
median over steps of each stage), after --warmup steps. Times are CPU seconds of this
process (`time.process_time`), which other jobs on a shared machine disturb far less than wall time.

Stages (per step):
  schedule       Scheduler.schedule (admission, slots, the plan's table changes)
  plan wire      StepPlan to/from msgpack, StepOutput to/from msgpack
  worker inputs  ModelRunner.submit less the stages below (table deltas, packed batch,
                 DecodeGraphs' static-buffer fill)
  page lists     the attention backend's host plan (FlashInfer's page lists)
  sample         the runner's draw (greedy, on the fixed logits) and reading the tokens back,
                 less the greedy pick (device work on a GPU: timed alone on the same logits and
                 moved to "device stub")
  update         Scheduler.update (tokens, stop rules)
  deltas         the engine's per-request deltas and incremental detokenisation
  device stub    the stand-in forward and the greedy pick (not host work of the engine)
  total          EngineCore.step less the device stub
  gc             of the total, the garbage collector's passes (counted in whichever stage they fall)
Medians over steps, and the means of total and gc (a collection falls in some steps only).

    python -m bench.host_step                      # bs 1, 16, 64, 256
    python -m bench.host_step --batch-sizes 256 --steps 50 --out /tmp/hs
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

STAGES = ("schedule", "plan wire", "worker inputs", "page lists", "sample", "update", "deltas")
BLOCK = 16


class _Timers:
    """Seconds per stage within the current step; wraps methods with `clock` (CPU time by default)."""

    def __init__(self, clock=time.process_time) -> None:
        self.now: dict[str, float] = defaultdict(float)
        self.clock = clock

    def wrap(self, owner, name: str, stage: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = self.clock()
            try:
                return inner(*args, **kwargs)
            finally:
                self.now[stage] += self.clock() - t0

        setattr(owner, name, timed)


TIMERS = _Timers()


def _wrap_classes() -> None:
    """Class-level timers, once per process."""
    from meshserve.engine.scheduler import Scheduler
    from meshserve.workers.step import StepOutput, StepPlan

    TIMERS.wrap(Scheduler, "schedule", "schedule")
    TIMERS.wrap(Scheduler, "update", "update")
    for cls in (StepPlan, StepOutput):
        TIMERS.wrap(cls, "to_msgpack", "plan wire")
        TIMERS.wrap(cls, "from_msgpack", "plan wire")


def _stub_backend_class():
    from meshserve.attention.backend import AttentionBackend
    from meshserve.attention.backends.flashinfer import _page_lists
    from meshserve.attention.backends.triton_paged import TritonBackend

    class HostOnlyFlashInfer(AttentionBackend):
        """FlashInfer's host planning (page lists) without FlashInfer: no kernel ever runs here."""

        name = "HOST_ONLY"
        capabilities = TritonBackend.capabilities  # any CPU-valid record that declares cuda_graphs

        def plan(self, metadata):
            tables = metadata.block_tables_host
            if tables is None:  # an older tree's metadata
                tables = metadata.block_table.tolist()
            _page_lists(tables, metadata.seq_lens_host, metadata.block_size)
            return metadata

        def plan_for_graph(self, metadata):
            return metadata

        def prepare_replay(self, plan, seq_lens, block_tables):
            _page_lists(block_tables, seq_lens, plan.block_size)  # FlashInfer's host work before a replay

        def write_kv(self, key, value, kv_cache, slot_mapping, *, plan=None):
            raise NotImplementedError("bench stand-in: no K/V is written")

        def forward(self, *args, **kwargs):
            raise NotImplementedError("bench stand-in: no attention runs")

    return HostOnlyFlashInfer


class _StubModel(torch.nn.Module):
    """Zeros for hidden states, logits from a fixed random bank (rows rotate every call)."""

    def __init__(self, vocab: int, rows: int) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Identity()])
        self.bank = torch.randn(rows + 7, vocab, generator=torch.Generator().manual_seed(0))
        self.calls = 0

    def forward(self, input_ids, positions, ctx):
        return torch.zeros(input_ids.shape[0], 1)

    def compute_logits(self, hidden):
        self.calls += 1
        k = self.calls % 7
        return self.bank[k: k + hidden.shape[0]]


class _WireExecutor:
    """One in-process ModelRunner; plans and outputs cross msgpack as they do between processes."""

    def __init__(self, runner, info) -> None:
        self.runner, self.info = runner, info

    def start(self):
        return self.info

    def execute_step(self, plan):
        self.submit_step(plan)
        return self.collect_step()

    def submit_step(self, plan) -> None:
        from meshserve.workers.step import StepPlan

        self.runner.submit(StepPlan.from_msgpack(plan.to_msgpack()))

    def collect_step(self):
        from meshserve.workers.step import StepOutput

        return StepOutput.from_msgpack(self.runner.collect().to_msgpack())

    def shutdown(self) -> None:
        pass


def measure(bs: int, args: argparse.Namespace) -> dict[str, float]:
    from meshserve.attention.backend import AttentionProblem
    from meshserve.attention.spec import AttentionSpec
    from meshserve.config import CacheConfig, ModelConfig, SchedulerConfig
    from meshserve.core.sampling_params import SamplingParams
    from meshserve.demo_model import DEMO_MODEL_DIR
    from meshserve.engine.engine_config import EngineConfig
    from meshserve.engine.engine_core import EngineCore
    from meshserve.workers.decode_graphs import DecodeGraphs
    from meshserve.workers.runner import ModelRunner
    from meshserve.workers.worker import WorkerInfo

    max_len = args.prompt + args.warmup + args.steps + 64
    max_len = -(-max_len // BLOCK) * BLOCK
    num_blocks = bs * (max_len // BLOCK) + 1
    problem = AttentionProblem(spec=AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128), dtype="float32",
                               block_size=BLOCK, max_model_len=max_len, device="cpu")
    backend = _stub_backend_class()(problem)
    model = _StubModel(args.vocab, bs)
    runner = ModelRunner(model, backends=[backend], kv_caches=[None], block_size=BLOCK, device="cpu")
    runner.decode_graphs = DecodeGraphs(model, backends=[backend], kv_caches=[None], layer_groups=[0],
                                        block_size=BLOCK, max_local_len=max_len, max_batch=bs,
                                        device=torch.device("cpu"), capture=False)
    info = WorkerInfo(rank=0, num_kv_blocks=num_blocks, block_size=BLOCK, max_model_len=max_len,
                      vocab_size=args.vocab, eos_token_ids=(0,), backend="HOST_ONLY", dtype="float32")
    config = EngineConfig(model=ModelConfig(model=str(DEMO_MODEL_DIR), max_model_len=max_len),
                          cache=CacheConfig(block_size=BLOCK, num_kv_blocks=num_blocks),
                          scheduler=SchedulerConfig(max_num_seqs=bs, max_num_batched_tokens=max(8192, bs)))
    core = EngineCore(config, executor=_WireExecutor(runner, info))

    timers = TIMERS
    timers.wrap(runner, "submit", "submit")
    timers.wrap(runner, "_draw", "draw")
    timers.wrap(runner, "collect", "collect")
    timers.wrap(runner.decode_graphs, "_forward", "forward")
    real_draw = runner.sampler.draw
    try:  # the sampler's own greedy pick (on CPU max(dim).indices, cheaper than argmax)
        from meshserve.workers.sampler import first_max_index
    except ImportError:  # an older tree: argmax
        def first_max_index(x):
            return x.argmax(dim=-1)

    def draw(logits, rows, **kwargs):  # the greedy pick alone, once more: device work on a GPU, subtracted below
        t0 = time.process_time()
        first_max_index(logits)
        timers.now["argmax"] += time.process_time() - t0
        return real_draw(logits, rows, **kwargs)

    runner.sampler.draw = draw
    timers.wrap(backend, "prepare_replay", "page lists")
    timers.wrap(backend, "plan", "page lists")
    timers.wrap(core, "_apply", "apply")
    timers.wrap(core, "step", "step")

    rng = np.random.default_rng(bs)
    params = SamplingParams(temperature=0, max_tokens=max_len, ignore_eos=True)
    for _ in range(bs):
        core.add_request(rng.integers(300, args.vocab, args.prompt).tolist(), params)  # word tokens
    while core.scheduler.waiting or any(not r.output_ids for r in core.scheduler.running):
        core.step()
    for _ in range(args.warmup):
        core.step()
    gc.collect()
    gc.freeze()  # as the worker does on CUDA after start-up (workers/worker.py)
    gc_started = [0.0]

    def gc_pass(phase: str, info: dict) -> None:  # the collector's time, whichever stage it interrupts
        if phase == "start":
            gc_started[0] = time.process_time()
        else:
            timers.now["gc"] += time.process_time() - gc_started[0]

    gc.callbacks.append(gc_pass)
    rows: dict[str, list[float]] = defaultdict(list)
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile(time.process_time)
        prof.enable()
    for _ in range(args.steps):
        timers.now.clear()
        core.step()
        t = dict(timers.now)
        argmax, forward = t.get("argmax", 0.0), t.get("forward", 0.0)
        stage = {
            "schedule": t.get("schedule", 0.0),
            "plan wire": t.get("plan wire", 0.0),
            "page lists": t.get("page lists", 0.0),
            "sample": t.get("draw", 0.0) - 2 * argmax + t.get("collect", 0.0),
            "update": t.get("update", 0.0),
            "deltas": t.get("apply", 0.0) - t.get("update", 0.0),
            "device stub": forward + argmax,
            "gc": t.get("gc", 0.0),
            # submit holds the page lists, the stand-in forward and the draw
            "worker inputs": t["submit"] - t.get("page lists", 0.0) - forward - t.get("draw", 0.0),
            "total": t["step"] - forward - 2 * argmax,
        }
        for k, v in stage.items():
            rows[k].append(v * 1e3)
    if prof is not None:
        import pstats

        prof.disable()
        print(f"--- bs {bs}: cProfile of {args.steps} steps (the profiler inflates the timings above)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    core.shutdown()
    gc.callbacks.remove(gc_pass)
    gc.unfreeze()
    out = {k: statistics.median(v) for k, v in rows.items()}
    out["total mean"], out["gc mean"] = statistics.fmean(rows["total"]), statistics.fmean(rows["gc"])
    return out


def plot(results: dict[int, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(results)
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = np.zeros(len(sizes))
    x = np.arange(len(sizes))
    for stage in STAGES:
        vals = np.array([results[b][stage] for b in sizes])
        ax.bar(x, vals, bottom=bottom, label=stage)
        bottom += vals
    ax.set_xticks(x, [str(b) for b in sizes])
    ax.set_xlabel("batch (running decodes)")
    ax.set_ylabel("host ms per decode step (median)")
    ax.set_title("Host cost of one decode step by stage (2-core CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="1,16,64,256")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens per request (table width x 16)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--vocab", type=int, default=4096, help="logit columns of the stand-in model (the demo "
                    "tokenizer's 4096: prompts and outputs detokenise like text)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also print the N costliest functions of the timed steps (cProfile)")
    ap.add_argument("--out", default="bench/results", help="folder for host-step.json and host-step.png")
    args = ap.parse_args()
    torch.set_num_threads(1)
    _wrap_classes()
    results = {}
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        results[bs] = measure(bs, args)
    cols = (*STAGES, "total", "total mean", "gc mean", "device stub")
    print("| bs | " + " | ".join(cols) + " |")
    print("| ---: | " + " | ".join("---:" for _ in cols) + " |")
    for bs, r in results.items():
        print(f"| {bs} | " + " | ".join(f"{r[c]:.3f}" for c in cols) + " |")
    print("(host ms per decode step: medians over steps, and the means of total and gc)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "host-step.json").write_text(json.dumps({"args": vars(args), "ms": results}, indent=1))
    plot(results, out / "host-step.png")
    print(f"wrote {out / 'host-step.json'} and {out / 'host-step.png'}")


if __name__ == "__main__":
    main()
