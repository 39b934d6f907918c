"""`python -m bench.e2e --device cpu`: the bundled demo model, meshserve against HF transformers.

Both engines run in the same process, in alternating rounds (meshserve, HF, meshserve, HF, ...),
so that a burst of load from other jobs on a shared machine hits both; each engine's figure per
batch size is its best round. meshserve runs at the thread count its LLM chooses
(meshserve/core/cpu_threads.py), HF at torch's own (what each user gets without flags);
--threads N (or OMP_NUM_THREADS) pins both. The measurement itself is bench/cpu_generate.py's (one warm-up per
engine and round, then `generate` of --output-len greedy tokens after --prompt-len random
tokens, EOS ignored, float32; tok/s = output tokens / wall seconds, or CPU seconds with --clock
cpu, prefill included). The load average is read before and after each round and reported beside
the numbers, and the CPU's model and one-thread GEMM rate above them (bench/cpu_machine.py: the
development VM's host changes under one name). Table + JSON + PNG.

    python -m bench.e2e --device cpu                                   # batch 1, 16, 64; 3 rounds
    python -m bench.e2e --device cpu --rounds 5 --out bench/results --write docs/performance.md
    python -m bench.e2e --device cpu --threads 1 --clock cpu    # steadier on a shared machine
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from pathlib import Path

import torch

from bench.cpu_generate import hf_tok_s, meshserve_tok_s
from bench.cpu_machine import fingerprint
from bench.report import pyplot, write_section

BEGIN, END = "<!-- bench/e2e.py --device cpu:begin -->", "<!-- bench/e2e.py --device cpu:end -->"
DEMO_VOCAB = 4096  # the demo model's vocabulary (random prompt tokens are drawn below it)


def run(args: argparse.Namespace) -> dict:
    """Alternating rounds; per engine and batch size the best tok/s and every round's figure."""
    args.vocab, args.repeats = DEMO_VOCAB, 1
    backend = args.attention_backend or "auto"
    hf_threads = torch.get_num_threads()  # torch's own count (or --threads): what an HF user runs with
    cpu = fingerprint()  # absolute figures compare only on the same CPU (bench/cpu_machine.py)
    rounds: list[dict] = []
    for r in range(args.rounds):
        load_before = os.getloadavg()[0]
        ours = meshserve_tok_s(None if backend == "auto" else backend, args.batch_sizes, args)
        meshserve_threads = torch.get_num_threads()  # what the LLM chose (core/cpu_threads.py)
        torch.set_num_threads(hf_threads)
        hf = {} if args.no_baseline else hf_tok_s(args.batch_sizes, args)
        rounds.append({"meshserve": ours, "hf": hf, "load": [load_before, os.getloadavg()[0]],
                       "threads": {"meshserve": meshserve_threads, "hf": hf_threads}})
        print(f"round {r + 1}/{args.rounds}: load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}", flush=True)
    best = {name: {bs: max(rd[name][bs] for rd in rounds) for bs in args.batch_sizes}
            for name in ("meshserve", "hf") if rounds[0][name]}
    return {"backend": backend, "best": best, "rounds": rounds, "threads": rounds[-1]["threads"],
            "omp_env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
                        if k in os.environ},
            "date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "torch": torch.__version__, "prompt_len": args.prompt_len, "output_len": args.output_len,
            "clock": args.clock, "cpu": cpu}


def table(res: dict, batch_sizes: list[int]) -> str:
    best, hf = res["best"], res["best"].get("hf")
    loads = [x for rd in res["rounds"] for x in rd["load"]]
    lines = [
        BEGIN,
        f"Demo model, float32, {res['prompt_len']} in / {res['output_len']} out, greedy; {res['machine']}, "
        f"torch threads meshserve {res['threads']['meshserve']} / HF {res['threads']['hf']}, torch {res['torch']}; "
        f"meshserve backend {res['backend']}; "
        f"{'CPU' if res.get('clock') == 'cpu' else 'wall'} seconds; best of "
        f"{len(res['rounds'])} alternating rounds; load average {min(loads):.1f} to {max(loads):.1f} "
        f"({res['date']}).",
        *([f"CPU: {res['cpu']['cpu']}; one-thread float32 GEMM {res['cpu']['gemm_gflops_1thread']:.0f} "
           "GFLOP/s (bench/cpu_machine.py)."] if res.get("cpu") else []),
        "",
        "| batch | meshserve tok/s | HF tok/s | meshserve / HF | rounds (meshserve / HF) |",
        "| ---: | ---: | ---: | ---: | --- |",
    ]
    for bs in batch_sizes:
        ours = best["meshserve"][bs]
        per_round = ", ".join(f"{rd['meshserve'][bs]:.0f} / {rd['hf'][bs]:.0f}" if hf else f"{rd['meshserve'][bs]:.0f}"
                              for rd in res["rounds"])
        ratio = f"{ours / hf[bs]:.2f}x" if hf else "-"
        lines.append(f"| {bs} | {ours:.0f} | {hf[bs]:.0f} | {ratio} | {per_round} |" if hf else
                     f"| {bs} | {ours:.0f} | - | - | {per_round} |")
    lines.append(END)
    return "\n".join(lines)


def plot(res: dict, batch_sizes: list[int], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    names = [n for n in ("meshserve", "hf") if n in res["best"]]
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(batch_sizes))]
        ax.bar(xs, [res["best"][name][bs] for bs in batch_sizes], width,
               label="meshserve " + res["backend"] if name == "meshserve" else "HF transformers")
    ax.set_xticks(range(len(batch_sizes)), [str(b) for b in batch_sizes])
    ax.set_xlabel("batch size")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"demo model on CPU (threads: meshserve {res['threads']['meshserve']}, HF {res['threads']['hf']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", flush=True)


def main(args: argparse.Namespace) -> int:
    """args: bench/e2e.py's, with batch_sizes parsed; the CPU defaults filled in here."""
    args.prompt_len = args.prompt_len or 64
    args.output_len = args.output_len or 100
    if args.threads:  # the user's explicit choice, which meshserve then keeps (core/cpu_threads.py)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    res = run(args)
    section = table(res, args.batch_sizes)
    print(section)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "e2e-cpu.json").write_text(json.dumps(res, indent=1))
        plot(res, args.batch_sizes, out / "e2e-cpu.png")
    if args.write:
        write_section(Path(args.write), section, BEGIN, END)
    return 0
