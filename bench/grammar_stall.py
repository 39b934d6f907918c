"""What a slow grammar compile costs the other streams of a replica (docs/structured_outputs.md).

One engine on the bundled demo model (or --model DIR) streams a plain greedy request; after its
10th token a structured-output request arrives whose driver-side compile is slowed by fault
injection (a sleep of `delay` seconds wrapped around GrammarCompiler._compile). Host wall clock
around EngineCore.step(): the plain stream's inter-token gaps (median and largest) and the
constrained request's time to its first token. The scheduler's grammar gate keeps the largest
gap at about one step; an engine whose first draw waits for the compile inside the step shows a
gap of about `delay` (and the same first-token time).

Second table (--runaway-timeout): compiles that never end. An engine with grammar_compile_timeout_s
at that value gets two requests whose compiles block until the end of the run (a pathological
schema, by fault injection), then three ordinary constrained requests one after another: each
one's outcome and time from arrival to its first token (or its error). With the compile threads
held by the runaways they used to fail at their own bound; the written-off threads are replaced
now (workers/grammar.py). Runs against whichever meshserve is imported (PYTHONPATH), for a before/after.

Prints tables, writes JSON and a PNG (bench/results/grammar_stall[-TAG].{json,png}).

    python -m bench.grammar_stall
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

from bench.report import pyplot, save_figure
from meshserve import LLM, SamplingParams
from meshserve.core.structured_outputs import StructuredOutputs
from meshserve.workers.grammar import GrammarCompiler


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    p.add_argument("--delays", type=float, nargs="+", default=[0.25, 1.0, 2.0], help="compile delays in seconds")
    p.add_argument("--tokens", type=int, default=60, help="tokens of the plain stream")
    p.add_argument("--runaway-timeout", type=float, default=1.0,
                   help="grammar_compile_timeout_s of the runaway-compile run (0: skip it)")
    p.add_argument("--tag", default="")
    args = p.parse_args()
    llm = LLM(args.model, dtype="float32", max_model_len=256, num_kv_blocks=64, progress=False)
    real = GrammarCompiler._compile
    rows = []
    try:
        for i, delay in enumerate(args.delays):
            def slow_compile_fault(self, spec, _delay=delay):
                time.sleep(_delay)
                return real(self, spec)

            GrammarCompiler._compile = slow_compile_fault
            rows.append(run(llm, delay, args.tokens, StructuredOutputs.regex(f"(yes|no){{{i + 1}}}")))
    finally:
        GrammarCompiler._compile = real
        llm.shutdown()
    print(f"{'compile delay s':>16}{'plain tokens':>14}{'median gap ms':>15}{'max gap ms':>12}"
          f"{'constrained TTFT s':>20}")
    for r in rows:
        print(f"{r['delay_s']:>16.2f}{r['tokens']:>14}{r['median_gap_ms']:>15.1f}{r['max_gap_ms']:>12.1f}"
              f"{r['constrained_ttft_s']:>20.2f}")
    after = runaways(args.model, args.runaway_timeout) if args.runaway_timeout > 0 else []
    if after:
        print(f"\nafter two runaway compiles (grammar_compile_timeout_s={args.runaway_timeout:g}):")
        print(f"{'request':>9}{'outcome':>10}{'to first token or error s':>27}")
        for r in after:
            print(f"{r['request']:>9}{r['outcome']:>10}{r['seconds']:>27.3f}")
    out = Path(__file__).parent / "results" / f"grammar_stall{'-' + args.tag if args.tag else ''}"
    out.parent.mkdir(exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows, "after_runaways": after},
                                                   indent=1))
    plot(rows, out.with_suffix(".png"))


def run(llm: LLM, delay: float, num_tokens: int, spec: StructuredOutputs) -> dict:
    core = llm.core
    plain = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    core.add_request("The for statement is used to", plain, request_id=f"plain-{delay}")
    stamps, added_at, first = [], None, None
    while core.has_unfinished():
        for d in core.step():
            now = time.perf_counter()
            if d.request_id.startswith("plain") and d.token_ids:
                stamps.append(now)
            elif d.token_ids and first is None:
                first = now - added_at
        if added_at is None and len(stamps) >= 10:
            added_at = time.perf_counter()
            core.add_request("Answer:", SamplingParams(temperature=0, max_tokens=4, structured_outputs=spec),
                             request_id=f"constrained-{delay}")
    gaps = [1e3 * (b - a) for a, b in zip(stamps, stamps[1:])]
    return {"delay_s": delay, "tokens": len(stamps), "median_gap_ms": statistics.median(gaps),
            "max_gap_ms": max(gaps), "constrained_ttft_s": first, "gaps_ms": gaps}


def runaways(model: str | None, timeout_s: float) -> list[dict]:
    from meshserve.config import AttentionConfig, CacheConfig, ModelConfig, SchedulerConfig
    from meshserve.demo_model import DEMO_MODEL_DIR
    from meshserve.engine.engine_config import EngineConfig
    from meshserve.engine.engine_core import EngineCore

    stuck = [StructuredOutputs.regex(f"(runaway){{{i}}}") for i in (1, 2)]
    release = threading.Event()
    real = GrammarCompiler._compile

    def runaway_compile_fault(self, spec):
        if spec in stuck:
            release.wait(600)
        return real(self, spec)

    GrammarCompiler._compile = runaway_compile_fault
    core = EngineCore(EngineConfig(
        model=ModelConfig(model=str(model or DEMO_MODEL_DIR), dtype="float32", max_model_len=256),
        cache=CacheConfig(num_kv_blocks=64), scheduler=SchedulerConfig(grammar_compile_timeout_s=timeout_s),
        attention=AttentionConfig(backend="TORCH")), device="cpu", progress=False)
    rows = []
    try:
        for i, spec in enumerate(stuck):
            core.add_request("Answer:", SamplingParams(temperature=0, max_tokens=4, structured_outputs=spec),
                             request_id=f"runaway-{i}")
        while core.has_unfinished():
            core.step()
        for i in range(3):
            spec = StructuredOutputs.regex(f"(yes|no){{{i + 1}}}")
            added = time.perf_counter()
            core.add_request("Answer:", SamplingParams(temperature=0, max_tokens=4, structured_outputs=spec),
                             request_id=f"after-{i}")
            outcome = None
            while core.has_unfinished():
                for d in core.step():
                    if outcome is None and (d.token_ids or d.finished):
                        outcome = "error" if getattr(d, "error", None) is not None else "ok"
                        rows.append({"request": i + 1, "outcome": outcome, "seconds": time.perf_counter() - added})
    finally:
        release.set()
        GrammarCompiler._compile = real
        core.shutdown()
    return rows


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        ax.plot(range(1, len(r["gaps_ms"]) + 1), r["gaps_ms"], marker=".", label=f"compile {r['delay_s']:g} s")
    ax.axvline(10, color="grey", linestyle=":", label="constrained request arrives")
    ax.set_xlabel("plain stream token")
    ax.set_ylabel("gap to the previous token (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title("a plain stream while a slow grammar compiles")
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
