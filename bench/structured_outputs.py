"""Decode-step cost of structured outputs: a batch of json_schema requests against the same batch free.

On the bundled demo model (or --model DIR), one engine, the two batches run alternately
(--rounds times each, so that drift hits both alike): `batch` requests on the same prompt,
ignore_eos, max_tokens new tokens each; every engine step is timed (host wall clock around
EngineCore.step(), synchronized on CUDA) and only steps where the whole batch decodes count
(one computed token per request). The grammar is a JSON schema whose output cannot end
early (an array of at least `min_items` objects of three typed fields), so every row is
masked on every step. Reports the median and 10th-percentile step of each (the low percentile
says more on a loaded machine), their ratios, the median over rounds of each round's ratio
(the two batches of a round run back to back, so slow drift of the machine's load cancels),
and the parts of a constrained step spent in
the sampler's constraint path (apply_constraints, host time: on CUDA its kernels are queued,
not waited for) and, inside it, filling masks.

Prints a table, writes JSON and a PNG (bench/results/structured_outputs[-TAG].{json,png}).

    python -m bench.structured_outputs                                   # CPU, demo model
    python -m bench.structured_outputs --device cuda --dtype bfloat16    # the H200
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.report import pyplot, save_figure
from meshserve import LLM, SamplingParams
from meshserve.core.structured_outputs import StructuredOutputs
from meshserve.workers import constraints, sampler

SCHEMA = {"type": "array", "minItems": 200, "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16},
                                     "ok": {"type": "boolean"}},
    "required": ["id", "name", "ok"], "additionalProperties": False}}


class FillTimer:
    """Wraps the matchers' mask fill and the sampler's apply_constraints to add up their host time."""

    def __init__(self) -> None:
        self.seconds = self.apply_seconds = 0.0
        self._fill = constraints.fill_masks
        self._apply = sampler.apply_constraints

        def timed(states, bitmask, rows, _fill=self._fill):
            t = time.perf_counter()
            _fill(states, bitmask, rows)
            self.seconds += time.perf_counter() - t

        def timed_apply(logits, rows, _apply=self._apply):
            t = time.perf_counter()
            out = _apply(logits, rows)
            self.apply_seconds += time.perf_counter() - t
            return out

        constraints.fill_masks = timed
        sampler.apply_constraints = timed_apply

    def restore(self) -> None:
        constraints.fill_masks = self._fill
        sampler.apply_constraints = self._apply


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_batch(llm: LLM, prompt: list[int], params: SamplingParams, batch: int, fills: FillTimer) -> dict:
    core = llm.core
    for _ in range(batch):
        core.add_request(prompt, params)
    steps, fill_share, apply_share = [], [], []
    stats = core.scheduler.stats
    while core.has_unfinished():
        computed, fills.seconds, fills.apply_seconds = stats.num_computed_tokens, 0.0, 0.0
        _sync()
        t = time.perf_counter()
        core.step()
        _sync()
        dt = time.perf_counter() - t
        if stats.num_computed_tokens - computed == batch and len(core.scheduler.running) == batch:
            steps.append(dt)
            fill_share.append(fills.seconds / dt)
            apply_share.append(fills.apply_seconds / dt)
    return {"steps": len(steps), "median_ms": 1e3 * statistics.median(steps),
            "p10_ms": 1e3 * statistics.quantiles(steps, n=10)[0],
            "fill_share": statistics.median(fill_share), "apply_share": statistics.median(apply_share)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the bundled demo model)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--tag", default="", help="suffix of the result files (e.g. h200)")
    args = p.parse_args()
    llm = LLM(args.model, dtype=args.dtype, device=args.device, num_kv_blocks=args.num_kv_blocks,
              max_model_len=1024, max_num_seqs=max(args.batch, 8), enable_prefix_caching=True, progress=False)
    prompt = llm.tokenizer.encode("Write the list of records as JSON:").ids
    base = dict(temperature=0.8, seed=1, max_tokens=args.max_tokens, ignore_eos=True)
    free = SamplingParams(**base)
    grammar = SamplingParams(**base, structured_outputs=StructuredOutputs.json_schema(SCHEMA))
    fills = FillTimer()
    run_batch(llm, prompt, grammar, 4, fills)  # warm-up: compiles the grammar (cached), builds the vocabulary table
    run_batch(llm, prompt, free, 4, fills)
    rows = []
    for r in range(args.rounds):
        for name, params in (("no grammar", free), ("json_schema", grammar)):
            rows.append({"round": r, "mode": name, **run_batch(llm, prompt, params, args.batch, fills)})
    fills.restore()
    summary = {}
    for mode in ("no grammar", "json_schema"):
        mine = [x for x in rows if x["mode"] == mode]
        summary[mode] = {"median_ms": statistics.median(x["median_ms"] for x in mine),
                         "p10_ms": statistics.median(x["p10_ms"] for x in mine),
                         "fill_share": statistics.median(x["fill_share"] for x in mine),
                         "apply_share": statistics.median(x["apply_share"] for x in mine),
                         "steps": sum(x["steps"] for x in mine)}
    ratio = summary["json_schema"]["median_ms"] / summary["no grammar"]["median_ms"]
    ratio_p10 = summary["json_schema"]["p10_ms"] / summary["no grammar"]["p10_ms"]
    pairs = [(x, y) for x, y in zip(rows[::2], rows[1::2])]  # (no grammar, json_schema) of each round
    paired = statistics.median(y["median_ms"] / x["median_ms"] for x, y in pairs)
    where = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"decode step, batch {args.batch}, {where}, {args.dtype}, torch threads {torch.get_num_threads()}")
    print(f"{'mode':<14}{'median step ms':>16}{'p10 step ms':>13}{'steps':>8}{'constraints':>13}{'mask fill':>11}")
    for mode, s in summary.items():
        print(f"{mode:<14}{s['median_ms']:>16.3f}{s['p10_ms']:>13.3f}{s['steps']:>8}{100 * s['apply_share']:>12.1f}%"
              f"{100 * s['fill_share']:>10.1f}%")
    print(f"json_schema / no grammar: {ratio:.3f}x (median), {ratio_p10:.3f}x (p10), "
          f"{paired:.3f}x (median of the rounds' ratios)")
    out = Path(__file__).parent / "results" / f"structured_outputs{'-' + args.tag if args.tag else ''}"
    out.parent.mkdir(exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "device": where, "rows": rows,
                                                    "summary": summary, "ratio": ratio,
                                                    "ratio_p10": ratio_p10, "paired_ratio": paired}, indent=1))
    plot(rows, out.with_suffix(".png"), title=f"decode step, batch {args.batch}, {where}")
    llm.shutdown()


def plot(rows: list[dict], path: Path, *, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in ("no grammar", "json_schema"):
        pts = [(x["round"], x["median_ms"]) for x in rows if x["mode"] == mode]
        ax.plot([q[0] for q in pts], [q[1] for q in pts], marker="o", label=mode)
    ax.set_xlabel("round")
    ax.set_ylabel("median decode step (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
