"""TTFT of disaggregated pools against a unified pool (issue 37: "within 5% of unified at 8k tokens").

The same checkpoint is served twice, one server after the other, with the same engine settings
and the same KV budget per replica (serve's --kv-cache-memory-bytes, per rank; every replica
here is one rank):

- unified: `meshserve serve` as it defaults, one replica that prefills and decodes;
- disaggregated: `meshserve serve --pools disaggregated`, one prefill and one decode replica;
  the prefill replica sends the first token and offers the prompt's KV, the decode replica
  pulls it (--kv-transport, default auto: NIXL where both ends have it) and goes on.

Workload: N = --prompts-per-stream x C prompts of --input-len random token ids, --output-len
tokens each (greedy, EOS ignored, prefix caching off), at most C in flight, at each concurrency
C; a wave of C warm-up requests first (not counted: one-time costs such as CUDA graphs and the
first NIXL connection land there). Loaded over gRPC (or --face http) by meshserve bench's client
code (api/bench/loadgen.py, through bench/served.py).

Per path and C: TTFT and TPOT p50/p99, output tok/s, the gap between the first and the second
token (disaggregated: the hand-over and the decode replica's first step), whether each request's
tokens equal unified's, and from the server's /metrics, read before and after the measured
requests: KV imports by transport (`meshserve_kv_imports_total{transport=}`), recomputes by
reason, bytes pulled and the pull time per request (`meshserve_kv_transfer_seconds`), so that a
fallback to zmq or to recomputing the prompt shows. A table, JSON and PNG go to --out (the
servers' logs to --logs).

On a machine with one GPU the disaggregated server gets --gpus-per-rank 0.5 (--gpus-per-rank
auto): its prefill and decode replicas, Ray actors, each reserve half of the GPU and share it
(with whole-GPU ranks the decode replica could never be placed: serve refuses that layout at
start-up), and auto moves their KV by CUDA IPC (both actors see the one GPU). Every replica's KV
budget is the same --kv-cache-memory-bytes, so the unified replica does not get more KV than each
of the disaggregated ones. A server that does not start gives "skipped" rows with its error.

    python -m bench.disagg_ttft --shape tiny-llama                          # CPU, ~1-2 min
    python -m bench.disagg_ttft --device cuda --shape llama3-8b --deadline 300   # one GPU call
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bench.common import int_list
from bench.report import pyplot
from bench.served import EngineSettings, Server, device_name, load_server, model_for_shape
from meshserve.api.bench.loadgen import LoadSpec, Sample
from meshserve.api.bench.report import summarize

PATHS = ("unified", "disaggregated")


@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int
    prompts_per_stream: int
    num_warmups: int | None = None  # None: one wave of C
    seed: int = 0

    def spec(self, concurrency: int) -> LoadSpec:
        """The measured requests at concurrency C (the same prompts on both paths)."""
        return LoadSpec(num_prompts=self.prompts_per_stream * concurrency, input_len=self.input_len,
                        output_len=self.output_len, max_concurrency=concurrency, num_warmups=0, seed=self.seed)

    def warmup_spec(self, concurrency: int) -> LoadSpec | None:
        """Warm-up requests, other prompts than the measured ones (None: no warm-up)."""
        n = concurrency if self.num_warmups is None else self.num_warmups
        if n == 0:
            return None
        return LoadSpec(num_prompts=n, input_len=self.input_len, output_len=self.output_len,
                        max_concurrency=concurrency, num_warmups=0, seed=self.seed + 7_919)


# -- what /metrics says of the hand-overs -------------------------------------------------------


@dataclass
class HandoverCounters:
    """The hand-over counters of a server's /metrics, summed over its decode replicas (a unified
    server has none: every field stays empty)."""

    imports: Counter = field(default_factory=Counter)  # successful imports by transport
    recomputes: Counter = field(default_factory=Counter)  # adopted requests recomputed, by reason
    kv_bytes: float = 0.0  # bytes pulled by successful imports (any transport: not labelled by it)
    pull_seconds: float = 0.0  # sum of the successful pulls' times
    pulls: float = 0.0
    pull_buckets: Counter = field(default_factory=Counter)  # le (seconds, inf last) -> pulls at most that long
    resolved: str = ""  # meshserve_kv_transport_info: the transport as configured and resolved at start

    @classmethod
    def parse(cls, text: str) -> HandoverCounters:
        from prometheus_client.parser import text_string_to_metric_families

        out = cls()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "meshserve_kv_imports_total":
                    out.imports[s.labels["transport"]] += s.value
                elif s.name == "meshserve_kv_recomputes_total":
                    out.recomputes[s.labels["reason"]] += s.value
                elif s.name == "meshserve_kv_imported_bytes_total":
                    out.kv_bytes += s.value
                elif s.name == "meshserve_kv_transfer_seconds_sum":
                    out.pull_seconds += s.value
                elif s.name == "meshserve_kv_transfer_seconds_count":
                    out.pulls += s.value
                elif s.name == "meshserve_kv_transfer_seconds_bucket":
                    out.pull_buckets[float(s.labels["le"])] += s.value
                elif s.name == "meshserve_kv_transport_info" and s.value:
                    out.resolved = s.labels["transport"]
        return out

    def since(self, before: HandoverCounters) -> HandoverCounters:
        """What happened between the snapshot `before` and this one."""
        return HandoverCounters(self.imports - before.imports, self.recomputes - before.recomputes,
                                self.kv_bytes - before.kv_bytes, self.pull_seconds - before.pull_seconds,
                                self.pulls - before.pulls, self.pull_buckets - before.pull_buckets, self.resolved)

    def pull_ms_p50_bound(self) -> float | None:
        """The upper bound (ms) of the histogram bucket holding the median pull (None: no pull)."""
        for le in sorted(self.pull_buckets):
            if self.pull_buckets[le] >= self.pulls / 2 > 0:
                return le * 1e3
        return None

    def to_json(self) -> dict:
        return {"imports": dict(self.imports), "recomputes": {k: v for k, v in self.recomputes.items() if v},
                "kv_bytes": self.kv_bytes, "pull_seconds": self.pull_seconds, "pulls": self.pulls,
                "pull_ms_mean": 1e3 * self.pull_seconds / self.pulls if self.pulls else None,
                "pull_ms_p50_at_most": self.pull_ms_p50_bound(), "transport_info": self.resolved}

    def moved_by(self) -> str:
        """One line: which transport moved how much, and what was recomputed instead."""
        if not self.imports and not +self.recomputes:
            return "no hand-over"
        used = [t for t, n in self.imports.items() if n]
        mib = self.kv_bytes / (1 << 20)
        if len(used) == 1:
            parts = [f"{used[0]}: {self.imports[used[0]]:.0f} pulls, {mib:.1f} MiB"]
        else:  # the bytes are not labelled by transport
            parts = [", ".join(f"{t}: {self.imports[t]:.0f} pulls" for t in used) + f" ({mib:.1f} MiB in all)"]
        if self.pulls:
            parts.append(f"pull {1e3 * self.pull_seconds / self.pulls:.2f} ms mean "
                         f"(p50 <= {self.pull_ms_p50_bound():g} ms)")
        recomputed = +self.recomputes
        parts.append("recomputed: " + (", ".join(f"{n:.0f} ({r})" for r, n in recomputed.items())
                                       if recomputed else "0"))
        return "; ".join(parts)


# -- one server, every concurrency --------------------------------------------------------------


@dataclass
class PathRun:
    path: str
    concurrency: int
    summary: dict | None = None
    second_token_ms: dict = field(default_factory=dict)  # p50, p99 of first -> second token
    handover: HandoverCounters = field(default_factory=HandoverCounters)
    outputs: list = field(default_factory=list)  # each request's token ids (grpc) or text (http)
    skipped: str = ""  # why it did not run


def second_token_gaps(samples: list[Sample]) -> dict:
    """p50/p99 (ms) of the gap between a request's first and second piece of output."""
    gaps = [1e3 * (s.arrivals[1] - s.arrivals[0]) for s in samples if not s.error and len(s.arrivals) > 1]
    if not gaps:
        return {"p50": None, "p99": None}
    return {"p50": float(np.percentile(gaps, 50)), "p99": float(np.percentile(gaps, 99))}


def path_flags(path: str, *, kv_transport: str, placement_timeout: float, gpus_per_rank: float = 1.0) -> list[str]:
    if path == "unified":
        return []
    return ["--pools", "disaggregated", "--kv-transport", kv_transport, "--placement-timeout", f"{placement_timeout:g}",
            "--gpus-per-rank", f"{gpus_per_rank:g}"]


def gpus_per_rank_for(setting: str, device: str) -> float:
    """--gpus-per-rank of the disaggregated server: auto is 0.5 on a CUDA machine with one GPU (the
    prefill and the decode replica share it), else 1 (a GPU each); a number is taken as given."""
    if setting != "auto":
        return float(setting)
    if device != "cuda":
        return 1.0
    import torch

    return 0.5 if torch.cuda.device_count() == 1 else 1.0


def run_path(server: Server, path: str, workload: Workload, concurrencies: list[int], *, face: str,
             vocab_size: int, deadline: float | None) -> list[PathRun]:
    runs = []
    for c in concurrencies:
        if deadline is not None and time.monotonic() > deadline:
            runs.append(PathRun(path, c, skipped="past --deadline"))
            print(f"  {path:<13} C={c:<3} skipped: past --deadline", flush=True)
            continue
        warm = workload.warmup_spec(c)
        if warm is not None:
            asyncio.run(load_server(server, face, warm, vocab_size=vocab_size))
        before = HandoverCounters.parse(server.metrics_text())
        samples, wall, outputs = asyncio.run(load_server(server, face, workload.spec(c), vocab_size=vocab_size))
        moved = HandoverCounters.parse(server.metrics_text()).since(before)
        run = PathRun(path, c, summarize(samples, wall), second_token_gaps(samples), moved, outputs)
        runs.append(run)
        s = run.summary
        print(f"  {path:<13} C={c:<3} TTFT p50 {s['ttft_ms']['p50'] or 0:8.1f} ms  {s['output_throughput']:8.1f} "
              f"output tok/s ({s['completed']} ok, {s['failed']} failed)"
              + (f"  KV {moved.moved_by()}" if path != "unified" else ""), flush=True)
    return runs


def run_all(settings: EngineSettings, workload: Workload, concurrencies: list[int], paths: tuple[str, ...], *,
            face: str, vocab_size: int, log_dir: Path, kv_transport: str = "auto",
            placement_timeout: float = 120.0, gpus_per_rank: float = 1.0, deadline: float | None = None,
            start_timeout: float = 600.0) -> tuple[list[PathRun], dict]:
    """Each path's server in turn (one at a time: on one GPU two would not fit), every concurrency
    on it. A server that does not start, or starts past `deadline` (time.monotonic()), gives
    skipped rows that say why. Returns the runs and each started server's start-up seconds."""
    runs: list[PathRun] = []
    started: dict[str, float] = {}
    for path in paths:
        why = "past --deadline" if deadline is not None and time.monotonic() > deadline else ""
        if not why:
            flags = path_flags(path, kv_transport=kv_transport, placement_timeout=placement_timeout,
                               gpus_per_rank=gpus_per_rank)
            try:
                with Server(settings, log_path=log_dir / f"server-{path}.log", flags=flags, name=path,
                            start_timeout=start_timeout) as server:
                    started[path] = server.started_in_s
                    print(f"{path}: serving after {server.started_in_s:.0f} s", flush=True)
                    runs += run_path(server, path, workload, concurrencies, face=face, vocab_size=vocab_size,
                                     deadline=deadline)
                continue
            except RuntimeError as exc:  # the server's own words, its log's last lines
                why = str(exc)
        print(f"{path}: skipped: {why}", flush=True)
        runs += [PathRun(path, c, skipped=why.splitlines()[0] + _error_line(why)) for c in concurrencies]
    return runs, started


def _error_line(text: str) -> str:
    """The `meshserve: error:` line of a server's log tail, if there is one."""
    lines = [line for line in text.splitlines() if "error" in line.lower()]
    return f" ({lines[-1].strip()})" if lines else ""


# -- the report ---------------------------------------------------------------------------------


def same_tokens(run: PathRun, base: PathRun | None) -> str:
    if run.path == "unified" or base is None or base.summary is None or run.summary is None:
        return "-"
    return "yes" if run.summary["failed"] == 0 and run.outputs == base.outputs else "NO"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def table(runs: list[PathRun]) -> str:
    base = {r.concurrency: r for r in runs if r.path == "unified" and r.summary}
    lines = ["| path | C | TTFT p50 ms | TTFT p99 ms | TTFT p50 / unified | TPOT p50 ms | TPOT p99 ms | "
             "2nd token p50 ms | output tok/s | KV moved by | pull ms mean | recomputed | same tokens | ok/failed |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- | ---: |"]
    for r in sorted(runs, key=lambda r: (r.concurrency, PATHS.index(r.path))):
        if r.summary is None:
            lines.append(f"| {r.path} | {r.concurrency} | skipped: {r.skipped[:160]} |" + " |" * 11)
            continue
        s, b, h = r.summary, base.get(r.concurrency), r.handover
        ratio = (f"{s['ttft_ms']['p50'] / b.summary['ttft_ms']['p50']:.3f}" if b and s["ttft_ms"]["p50"]
                 and b.summary["ttft_ms"]["p50"] else "-")
        used = ", ".join(f"{t} x{n:.0f}" for t, n in h.imports.items() if n) or "-"
        recomputed = f"{sum(h.recomputes.values()):.0f}" if r.path != "unified" else "-"
        pull = _ms(1e3 * h.pull_seconds / h.pulls) if h.pulls else "-"
        lines.append(f"| {r.path} | {r.concurrency} | {_ms(s['ttft_ms']['p50'])} | {_ms(s['ttft_ms']['p99'])} | "
                     f"{ratio} | {_ms(s['tpot_ms']['p50'])} | {_ms(s['tpot_ms']['p99'])} | "
                     f"{_ms(r.second_token_ms.get('p50'))} | {s['output_throughput']:.1f} | {used} | {pull} | "
                     f"{recomputed} | {same_tokens(r, b)} | {s['completed']}/{s['failed']} |")
    return "\n".join(lines)


def plot(runs: list[PathRun], path: Path, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    done = [r for r in runs if r.summary]
    concurrencies = sorted({r.concurrency for r in done})
    by = {(r.path, r.concurrency): r for r in done}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    x = np.arange(len(concurrencies))
    width = 0.4
    panels = (("TTFT (ms): bar p50, line p99", "ttft_ms"), ("TPOT (ms): bar p50, line p99", "tpot_ms"),
              ("first -> second token (ms): p50", None))
    for k, p in enumerate(PATHS):
        rows = [by.get((p, c)) for c in concurrencies]
        for ax, (_, key) in zip(axes, panels):
            if key is None:
                ax.bar(x + k * width, [r.second_token_ms.get("p50") or 0 if r else 0 for r in rows], width, label=p)
                continue
            ax.bar(x + k * width, [r.summary[key]["p50"] or 0 if r else 0 for r in rows], width, label=p)
            ax.errorbar(x + k * width, [r.summary[key]["p99"] or 0 if r else math.nan for r in rows], fmt="_",
                        color="black", markersize=14)
    for ax, (label, _) in zip(axes, panels):
        ax.set_xticks(x + width / 2, [str(c) for c in concurrencies])
        ax.set(xlabel="concurrent requests", ylabel=label)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shape", default="tiny-llama", choices=["demo", "llama3-8b", "tiny-llama"],
                    help="llama3-8b: random bf16 weights written to a temp dir; tiny-llama: the same path with a "
                         "tiny shape (the CPU check); demo: the bundled demo model")
    ap.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 8192 cuda, 256 CPU)")
    ap.add_argument("--output-len", type=int, default=None, help="output tokens (default 32 cuda, 16 CPU)")
    ap.add_argument("--concurrency", type=int_list, default=[1, 4], help="requests in flight (default '1 4')")
    ap.add_argument("--prompts-per-stream", type=int, default=None, help="N = this x C (default 4)")
    ap.add_argument("--num-warmups", type=int, default=None, help="warm-up requests per C (default C)")
    ap.add_argument("--paths", default="unified,disaggregated", help="comma-separated, of " + ", ".join(PATHS))
    ap.add_argument("--face", default="grpc", choices=["grpc", "http"], help="gRPC Generate or HTTP SSE")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 (llama3-8b), float32 (tiny-llama), auto")
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                    help="KV budget of every replica (default 8 GiB cuda: two replicas and two copies of the "
                         "weights share one 80 GB card; 64 MiB CPU)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--kv-transport", default="auto", help="the disaggregated server's --kv-transport")
    ap.add_argument("--placement-timeout", type=float, default=120.0, metavar="SECONDS",
                    help="the disaggregated server's --placement-timeout (a replica Ray cannot place fails the "
                         "start within this time instead of waiting for nodes)")
    ap.add_argument("--gpus-per-rank", default="auto", metavar="auto|FRACTION",
                    help="the disaggregated server's --gpus-per-rank (default auto: 0.5 on a machine with one GPU, "
                         "so that both replicas share it; else 1)")
    ap.add_argument("--start-timeout", type=float, default=None, metavar="SECONDS",
                    help="give up on a server not serving after this long (default 200 cuda, 120 CPU)")
    ap.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                    help="start no server and no run after this many seconds from the start (default 300 cuda: "
                         "with --start-timeout 200 the bench ends within ~9 minutes; none CPU): the table of what "
                         "ran still prints")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the servers")
    ap.add_argument("--out", default="bench/results", help="folder for the JSON and PNG")
    ap.add_argument("--logs", default=None, metavar="DIR", help="copy the servers' logs here (default: not kept)")
    args = ap.parse_args(argv)
    gpu = args.device == "cuda"
    if args.deadline is None and gpu:
        args.deadline = 300.0
    paths = tuple(p.strip() for p in args.paths.split(",") if p.strip())
    if bad := [p for p in paths if p not in PATHS]:
        ap.error(f"--paths: {bad} not among {list(PATHS)}")
    if not args.concurrency or min(args.concurrency) < 1:
        ap.error(f"--concurrency: {args.concurrency} must be integers >= 1")
    try:
        gpus_per_rank = gpus_per_rank_for(args.gpus_per_rank, args.device)
    except ValueError:
        ap.error(f"--gpus-per-rank: {args.gpus_per_rank!r} is not auto or a number")
    workload = Workload(input_len=args.input_len or (8192 if gpu else 256),
                        output_len=args.output_len or (32 if gpu else 16),
                        prompts_per_stream=args.prompts_per_stream or 4, num_warmups=args.num_warmups)
    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="meshserve-disagg-ttft-"))
    t_start, started_mono = time.perf_counter(), time.monotonic()
    try:
        model = model_for_shape(tmp, args.shape)
        print(f"checkpoint ready in {time.perf_counter() - t_start:.0f} s", flush=True)
        vocab_size = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        dtype = args.dtype or {"llama3-8b": "bfloat16", "tiny-llama": "float32"}.get(args.shape, "auto")
        settings = EngineSettings(
            model=model, device=args.device, dtype=dtype, max_num_seqs=max(args.concurrency),
            max_model_len=workload.input_len + workload.output_len + 16,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes or ((8 << 30) if gpu else (64 << 20)),
            max_num_batched_tokens=args.max_num_batched_tokens)
        deadline = started_mono + args.deadline if args.deadline else None
        runs, startup = run_all(settings, workload, args.concurrency, paths, face=args.face, vocab_size=vocab_size,
                                log_dir=tmp, kv_transport=args.kv_transport,
                                placement_timeout=args.placement_timeout, gpus_per_rank=gpus_per_rank,
                                deadline=deadline,
                                start_timeout=args.start_timeout or (200.0 if gpu else 120.0))
        if args.logs:
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            for log in tmp.glob("server-*.log"):
                shutil.copy(log, Path(args.logs) / f"disagg-ttft-{args.device}-{log.name}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    where = device_name(args.device)
    title = (f"disaggregated vs unified TTFT: {args.shape} on {where}, {workload.input_len} in / "
             f"{workload.output_len} out, {workload.prompts_per_stream} x C requests over {args.face}"
             + (f", disaggregated ranks on {gpus_per_rank:g} GPU each" if gpu and gpus_per_rank < 1 else ""))
    stamp = time.strftime("%Y-%m-%d")
    stem = f"disagg-ttft-{args.device}-{args.shape}-{stamp}"
    (out / f"{stem}.json").write_text(json.dumps({
        "title": title, "date": stamp, "device": where,
        "command": "python -m bench.disagg_ttft " + " ".join(sys.argv[1:]),
        "load_average": os.getloadavg(), "settings": asdict(settings), "workload": asdict(workload),
        "face": args.face, "kv_transport": args.kv_transport, "gpus_per_rank": gpus_per_rank,
        "server_startup_s": startup,
        "runs": [{"path": r.path, "concurrency": r.concurrency, "skipped": r.skipped, "summary": r.summary,
                  "second_token_ms": r.second_token_ms, "handover": r.handover.to_json(),
                  "same_tokens_as_unified": same_tokens(r, next((b for b in runs if b.path == "unified"
                                                                 and b.concurrency == r.concurrency), None))}
                 for r in runs]}, indent=1, default=str) + "\n")
    plot(runs, out / f"{stem}.png", title)
    print(f"\nwrote {out / stem}.json and .png ({time.perf_counter() - t_start:.0f} s in all; server start-up "
          + ", ".join(f"{p} {s:.0f} s" for p, s in startup.items()) + ")\n")
    print(title)
    print(table(runs))
    for r in runs:
        if r.path != "unified" and r.summary:
            print(f"C={r.concurrency} {r.path}: KV {r.handover.moved_by()} (transport_info: "
                  f"{r.handover.resolved or '-'})")
    return 0 if all(r.summary and r.summary["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
