"""What a client of `meshserve serve` gets, against the same engine driven in process.

One workload — N prompts of random token ids, fixed input and output lengths, greedy, EOS
ignored, prefix caching off on both sides (the paths reuse the same prompts) — at each
concurrency C (N = --prompts-per-stream x C, at most C requests in flight, a new one as soon as
one ends):

- offline: `LLM` in this process; its engine stepped exactly as `LLM.generate` steps it
  (make_request, add, step), keeping C requests in flight and timing every delta;
- http: `meshserve serve` in a subprocess, loaded by `meshserve bench`'s client over
  /v1/completions with SSE (api/bench/loadgen.py's run_load, report.py's summary);
- grpc: the same server over meshserve.v1.Inference/Generate.

Printed last: output tok/s, TTFT and TPOT p50/p99 per path and concurrency, the served/offline
throughput ratio and whether every request produced the same output on every path (greedy:
token ids on gRPC, text over HTTP, against offline). JSON + PNG go to --out.

    python -m bench.serve_vs_offline                                   # CPU, demo model, C = 16 64
    python -m bench.serve_vs_offline --device cuda --shape llama3-8b   # the H200 run (~8 min)

With one round (the GPU default) the offline engine runs first and is released before the server
loads (on one GPU the two would not fit side by side); both get the same KV budget, batch caps
and max_model_len.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.common import int_list
from bench.served import FACES, EngineSettings, Server, device_name, load_server, model_for_shape
from meshserve.api.bench.loadgen import BenchRequest, LoadSpec, Sample, make_requests
from meshserve.api.bench.report import summarize

PATHS = ("offline", "http", "grpc")  # the default run
# A served path is a face and the server's process layout: bare, `meshserve serve` as it defaults;
# -split, with --engine-process (front-ends and engine in two processes); -inproc, without; -x2,
# two front-end processes sharing the ports (--api-server-count 2) over one engine process; -paced,
# with --paced-overlap (an arrival mid-step joins the next step: cluster/replica.py; the default since
# 2026-12-06), -unpaced without it; -uvloop, the event loops on uvloop (serve --uvloop; needs uvloop
# installed), -asyncio, on asyncio's own (--no-uvloop, the default).
LAYOUTS = {"": [], "-split": ["--engine-process"], "-inproc": ["--no-engine-process"],
           "-x2": ["--engine-process", "--api-server-count", "2"], "-paced": ["--paced-overlap"],
           "-unpaced": ["--no-paced-overlap"], "-uvloop": ["--uvloop"], "-asyncio": ["--no-uvloop"]}
KNOWN_PATHS = ("offline", *(face + layout for layout in LAYOUTS for face in FACES))


def face_of(path: str) -> str:
    return path.split("-")[0]


def layout_of(path: str) -> str:
    return path[len(face_of(path)):]


@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int
    prompts_per_stream: int
    num_warmups: int | None = None  # None: a wave of C (every batch shape the run meets is warm)
    seed: int = 0

    def spec(self, concurrency: int) -> LoadSpec:
        """loadgen's spec for concurrency C: the prompts every path sends (same seed, same ids)."""
        warmups = concurrency if self.num_warmups is None else self.num_warmups
        return LoadSpec(num_prompts=self.prompts_per_stream * concurrency, input_len=self.input_len,
                        output_len=self.output_len, max_concurrency=concurrency, num_warmups=warmups,
                        seed=self.seed)


@dataclass
class PathRun:
    """One path at one concurrency: the summary (report.summarize) and each request's output."""

    path: str
    concurrency: int
    summary: dict
    outputs: list = field(default_factory=list)  # token ids (offline, grpc) or text (http), in request order
    texts: list[str] = field(default_factory=list)  # offline: the text too, to compare with http
    round: int = 0
    # CPU seconds (all threads) over the run, warm-up included, and the tokens they made: the
    # engine's process (offline: this one; served: the server) and the client's (served: this one)
    engine_cpu_s: float = 0.0
    frontend_cpu_s: float | None = None  # served with --engine-process: the front-ends' process alone
    client_cpu_s: float = 0.0
    tokens_made: int = 0

    def cpu_us_per_token(self, which: str = "engine") -> float | None:
        cpu = {"engine": self.engine_cpu_s, "client": self.client_cpu_s, "frontend": self.frontend_cpu_s}[which]
        return 1e6 * cpu / self.tokens_made if self.tokens_made and cpu is not None else None


# -- the served paths ----------------------------------------------------------------------------


async def _served(server: Server, path: str, workload: Workload, concurrency: int,
                  vocab_size: int) -> tuple[dict, list]:
    samples, wall, outputs = await load_server(server, face_of(path), workload.spec(concurrency),
                                               vocab_size=vocab_size)
    return summarize(samples, wall), outputs


def run_served(server: Server, path: str, workload: Workload, concurrency: int, vocab_size: int) -> PathRun:
    fronts = frontend_pids(server.pid)
    server_cpu, front_cpu = tree_cpu_seconds(server.pid), sum(map(process_cpu_seconds, fronts))
    client_cpu = time.process_time()
    summary, outputs = asyncio.run(_served(server, path, workload, concurrency, vocab_size))
    server_cpu, client_cpu = tree_cpu_seconds(server.pid) - server_cpu, time.process_time() - client_cpu
    front_cpu = sum(map(process_cpu_seconds, fronts)) - front_cpu
    split = len(_descendants(server.pid)) > 0  # the engine's own process (a child of serve's)
    return PathRun(path, concurrency, summary, outputs, engine_cpu_s=server_cpu, client_cpu_s=client_cpu,
                   frontend_cpu_s=front_cpu if split else None, tokens_made=_tokens_made(workload, concurrency))


def _tokens_made(workload: Workload, concurrency: int) -> int:
    spec = workload.spec(concurrency)
    return (spec.num_prompts + spec.num_warmups) * spec.output_len


def _descendants(pid: int) -> list[int]:
    """The processes below `pid` (Linux /proc: each thread's children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError):
                kids = [int(k) for k in (task / "children").read_text().split()]
                out += kids
                todo += kids
    return out


def frontend_pids(pid: int) -> list[int]:
    """The server's front-end processes: serve's own, and with --api-server-count the others."""
    others = []
    for p in _descendants(pid):
        with contextlib.suppress(OSError):
            if b"meshserve.api.api_server_main" in Path(f"/proc/{p}/cmdline").read_bytes():
                others.append(p)
    return [pid, *others]


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of `pid` and every process below it (the server: front-ends and engine)."""
    total = 0.0
    for p in [pid, *_descendants(pid)]:
        with contextlib.suppress(OSError):
            total += process_cpu_seconds(p)
    return total


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid`, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


# -- the offline path ----------------------------------------------------------------------------


def _closed_loop(llm, requests: list[BenchRequest], concurrency: int) -> tuple[list[Sample], float, list, list]:
    """Step `llm`'s engine as LLM.generate does, at most `concurrency` requests in flight; a
    request is added (its clock starts) as soon as a slot is free, as the served client does."""
    from meshserve.core.sampling_params import SamplingParams

    core = llm.core
    pending = deque(enumerate(requests))
    samples = [Sample(r.num_prompt_tokens, r.max_tokens) for r in requests]
    tokens: list[list[int]] = [[] for _ in requests]
    texts: list[list[str]] = [[] for _ in requests]
    index_of: dict[str, int] = {}
    t0 = time.perf_counter()

    def admit() -> None:
        while pending and len(index_of) < concurrency:
            i, r = pending.popleft()
            req = core.make_request(r.prompt, SamplingParams(temperature=0.0, max_tokens=r.max_tokens,
                                                                 ignore_eos=True))
            samples[i].sent = time.perf_counter() - t0
            core.add(req)
            index_of[req.request_id] = i

    admit()
    while index_of:
        deltas = core.step()
        now = time.perf_counter() - t0
        for delta in deltas:
            i = index_of[delta.request_id]
            if delta.token_ids:
                samples[i].arrivals.append(now)
                samples[i].output_tokens += len(delta.token_ids)
                tokens[i].extend(delta.token_ids)
            texts[i].append(delta.text)
            if delta.finished:
                del index_of[delta.request_id]
        admit()
    return samples, time.perf_counter() - t0, tokens, ["".join(t) for t in texts]


def run_offline(llm, workload: Workload, concurrency: int, vocab_size: int) -> PathRun:
    spec = workload.spec(concurrency)
    cpu = time.process_time()
    warmups = make_requests(spec, vocab_size=vocab_size, count=spec.num_warmups, seed_offset=7_919)
    _closed_loop(llm, warmups, concurrency)
    requests = make_requests(spec, vocab_size=vocab_size, count=spec.num_prompts)
    samples, wall, tokens, texts = _closed_loop(llm, requests, concurrency)
    return PathRun("offline", concurrency, summarize(samples, wall), tokens, texts,
                   engine_cpu_s=time.process_time() - cpu, tokens_made=_tokens_made(workload, concurrency))


# -- the run -------------------------------------------------------------------------------------


def same_work(run: PathRun, offline: PathRun) -> bool:
    """Every request produced offline's output (token ids over gRPC, text over HTTP)."""
    want = offline.texts if face_of(run.path) == "http" else offline.outputs
    return run.summary["failed"] == 0 and run.outputs == want


def agreement(run: PathRun, offline: PathRun) -> tuple[int, int, float]:
    """(requests whose output equals offline's, requests, the mean share of a differing output
    before its first difference: tokens over gRPC, characters over HTTP). On a GPU in bf16 a
    greedy output may part from offline's where another batch composition rounds two nearly
    tied logits the other way (random weights tie often); a bug parts early and everywhere."""
    want = offline.texts if face_of(run.path) == "http" else offline.outputs
    same, shares = 0, []
    for got, ref in zip(run.outputs, want):
        if got == ref:
            same += 1
            continue
        prefix = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
        shares.append(prefix / max(1, len(ref)))
    return same, len(want), statistics.fmean(shares) if shares else 1.0


def run_all(settings: EngineSettings, workload: Workload, concurrencies: list[int], paths: tuple[str, ...], *,
            vocab_size: int, log_dir: Path, rounds: int = 1, profile_server=None,
            deadline: float | None = None, llm=None) -> list[PathRun]:
    """Every path at every concurrency, `rounds` times (a run that would start after the
    time.monotonic() `deadline` is skipped). `llm`: an LLM of `settings` to use for the offline path
    (default: one loaded here, and shut down when done).

    One round: the offline engine runs every concurrency first (the baseline is there even if
    the deadline cuts the served runs short) and is released, then the server starts and runs
    every served path (on one GPU the two would not fit side by side). Several rounds: the server
    and the offline engine are both up and the paths alternate, their order rotating each round,
    so that a machine whose load drifts (a shared CPU) weighs on every path alike."""
    runs: list[PathRun] = []
    served = [p for p in paths if p != "offline"]
    layouts = list(dict.fromkeys(layout_of(p) for p in served))
    offline = "offline" in paths

    def one(path: str, c: int, r: int, server, llm) -> None:
        if deadline is not None and time.monotonic() > deadline:  # the table still comes out in time
            print(f"  round {r} {path:<7} C={c:<4} skipped: past --deadline", flush=True)
            return
        if path == "offline":
            run = run_offline(llm, workload, c, vocab_size)
        else:
            run = run_served(server, path, workload, c, vocab_size)
        run.round = r
        runs.append(run)
        s = run.summary
        print(f"  round {r} {path:<7} C={c:<4} {s['output_throughput']:8.1f} output tok/s "
              f"({s['completed']} ok, {s['failed']} failed)", flush=True)

    def offline_engine(stack: contextlib.ExitStack):
        if llm is not None:
            return llm
        from meshserve.api.llm import LLM

        own = LLM(settings.model, progress=False, **settings.llm_kwargs())
        stack.callback(_release, own)
        return own

    if rounds == 1:
        if offline:
            with contextlib.ExitStack() as stack:
                engine = offline_engine(stack)
                for c in concurrencies:
                    one("offline", c, 0, None, engine)
                del engine
        for layout in layouts:  # one server at a time
            with Server(settings, log_path=log_dir / f"server{layout}.log", flags=LAYOUTS[layout],
                        name=layout) as server:
                profiler = profile_server(server) if profile_server is not None else None
                for c in concurrencies:
                    for path in served:
                        if layout_of(path) == layout:
                            one(path, c, 0, server, None)
                if profiler is not None:
                    profiler.stop()
        return runs
    with contextlib.ExitStack() as stack:
        servers = {layout: stack.enter_context(Server(settings, log_path=log_dir / f"server{layout}.log",
                                                      flags=LAYOUTS[layout], name=layout)) for layout in layouts}
        profilers = [profile_server(s) for s in servers.values()] if profile_server is not None else []
        engine = offline_engine(stack) if offline else None
        for r in range(rounds):
            for c in concurrencies:
                for k in range(len(paths)):
                    path = paths[(k + r) % len(paths)]
                    one(path, c, r, servers.get(layout_of(path)), engine)
        for profiler in profilers:
            profiler.stop()
    return runs


def _release(llm) -> None:
    """Shut `llm` down and hand its accelerator memory back before the server loads its own copy."""
    import gc

    llm.shutdown()
    llm.core = None
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def medians(runs: list[PathRun]) -> list[PathRun]:
    """Per path and concurrency, the round whose output throughput is the median (lower middle)."""
    groups: dict[tuple[str, int], list[PathRun]] = {}
    for r in runs:
        groups.setdefault((r.path, r.concurrency), []).append(r)
    return [sorted(g, key=lambda r: r.summary["output_throughput"])[(len(g) - 1) // 2] for g in groups.values()]


def _ms(summary: dict, name: str, q: str) -> str:
    v = summary[f"{name}_ms"][q]
    return "-" if v is None else f"{v:.1f}"


def _agreement_cell(run: PathRun, offline: PathRun) -> str:
    if same_work(run, offline):
        return "yes"
    same, total, share = agreement(run, offline)
    return f"{same}/{total} (others part at {share:.0%})"


def table(runs: list[PathRun]) -> str:
    """server CPU: CPU time per output token of the processes that run the engine (offline: the
    engine alone; served: engine + front-ends, in one process or two); its excess over offline is
    what serving costs; with --engine-process, the front-ends' process alone in its own column."""
    offline = {r.concurrency: r for r in runs if r.path == "offline"}
    lines = ["| streams | path | output tok/s | served/offline | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
             "TPOT p99 ms | server CPU µs/token | of which serving | front-end process CPU µs/token | "
             "client CPU µs/token | ok/failed | same tokens |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]

    def us(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    for r in sorted(runs, key=lambda r: (r.concurrency, KNOWN_PATHS.index(r.path))):
        s, base = r.summary, offline.get(r.concurrency)
        served = r.path != "offline"
        ratio = f"{s['output_throughput'] / base.summary['output_throughput']:.2f}x" if base and served else (
            "1.00x" if not served else "-")
        same = "-" if not served or base is None else _agreement_cell(r, base)
        cpu, base_cpu = r.cpu_us_per_token(), base.cpu_us_per_token() if base else None
        extra = us(cpu - base_cpu) if served and cpu is not None and base_cpu is not None else "-"
        lines.append(f"| {r.concurrency} | {r.path} | {s['output_throughput']:.1f} | {ratio} | "
                     f"{_ms(s, 'ttft', 'p50')} | {_ms(s, 'ttft', 'p99')} | {_ms(s, 'tpot', 'p50')} | "
                     f"{_ms(s, 'tpot', 'p99')} | {us(cpu)} | {extra} | {us(r.cpu_us_per_token('frontend'))} | "
                     f"{us(r.cpu_us_per_token('client')) if served else '-'} | {s['completed']}/{s['failed']} | "
                     f"{same} |")
    return "\n".join(lines)


def plot(runs: list[PathRun], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    concurrencies = sorted({r.concurrency for r in runs})
    by = {(r.path, r.concurrency): r.summary for r in runs}
    paths = [p for p in KNOWN_PATHS if any(r.path == p for r in runs)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    x = np.arange(len(concurrencies))
    width = 0.8 / len(paths)
    for k, p in enumerate(paths):
        rows = [by.get((p, c)) for c in concurrencies]
        axes[0].bar(x + k * width, [s["output_throughput"] if s else 0 for s in rows], width, label=p)
        axes[1].bar(x + k * width, [s["ttft_ms"]["p50"] or 0 if s else 0 for s in rows], width, label=p)
        axes[2].bar(x + k * width, [s["tpot_ms"]["p50"] or 0 if s else 0 for s in rows], width, label=p)
    for ax, label in zip(axes, ("output tokens/s", "TTFT p50 (ms)", "TPOT p50 (ms)")):
        ax.set_xticks(x + width * (len(paths) - 1) / 2, [str(c) for c in concurrencies])
        ax.set(xlabel="concurrent streams", ylabel=label)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shape", default="demo", choices=["demo", "llama3-8b", "tiny-llama"],
                    help="demo: the bundled demo model; llama3-8b: random bf16 weights written to a temp dir; "
                         "tiny-llama: the same path with a tiny shape (a CPU check of the GPU run)")
    ap.add_argument("--concurrency", type=int_list, default=None, help="concurrent streams (default CPU '16 64', "
                                                                      "cuda '16 64 256')")
    ap.add_argument("--input-len", type=int, default=None, help="default 128 (CPU), 512 (cuda)")
    ap.add_argument("--output-len", type=int, default=None, help="default 64 (CPU), 256 (cuda)")
    ap.add_argument("--prompts-per-stream", type=int, default=None, help="N = this x concurrency (default 1 CPU, "
                                                                          "2 cuda)")
    ap.add_argument("--num-warmups", type=int, default=None,
                    help="requests per path and concurrency sent first and not counted (default: C, one wave: "
                         "the first batches of a shape pay one-time costs, e.g. oneDNN primitives on CPU)")
    ap.add_argument("--paths", default="offline,http,grpc",
                    help="comma-separated, of offline, http, grpc (the server as `serve` defaults), http-split, "
                         "grpc-split (serve --engine-process: front-ends and engine in two processes), http-inproc, "
                         "grpc-inproc (--no-engine-process: one process), http-x2, grpc-x2 (--api-server-count 2: "
                         "two front-end processes on the same ports)")
    ap.add_argument("--dtype", default=None, help="default: auto (demo), bfloat16 (llama3-8b)")
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                    help="KV budget of both sides (default 256 MiB CPU, 32 GiB cuda)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="repeat every path, alternating, and show the median (default 3 on CPU; 1 on cuda, where "
                         "the offline engine runs and is released before the server loads)")
    ap.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                    help="start no run after this many seconds from the start (default: 420 on cuda, none on "
                         "CPU): the table of what ran still prints")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of both sides (OMP_NUM_THREADS of the server; default: torch's own)")
    ap.add_argument("--profile-server", default=None, metavar="PATH",
                    help="record the server's processes with py-spy while the served paths run (.svg: a flame "
                         "graph, else collapsed stacks; the engine process of -split paths to PATH-split-engine)")
    ap.add_argument("--out", default="bench/results", help="folder for the JSON, PNG and server log")
    args = ap.parse_args(argv)
    gpu = args.device == "cuda"
    if args.deadline is None and gpu:
        args.deadline = 420.0
    concurrencies = args.concurrency or ([16, 64, 256] if gpu else [16, 64])
    workload = Workload(input_len=args.input_len or (512 if gpu else 128),
                        output_len=args.output_len or (256 if gpu else 64),
                        prompts_per_stream=args.prompts_per_stream or (2 if gpu else 1),
                        num_warmups=args.num_warmups)
    paths = tuple(p.strip() for p in args.paths.split(",") if p.strip())
    bad = [p for p in paths if p not in KNOWN_PATHS]
    if bad:
        ap.error(f"--paths: {bad} not among {list(KNOWN_PATHS)}")
    if args.threads is not None:  # the server inherits the environment; this process sets its own
        import torch

        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="meshserve-serve-vs-offline-"))
    started, started_mono = time.perf_counter(), time.monotonic()
    try:
        t = time.perf_counter()
        model = model_for_shape(tmp, args.shape)
        if args.shape != "demo":
            print(f"checkpoint written in {time.perf_counter() - t:.0f} s", flush=True)
        vocab_size = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        dtype = args.dtype or {"llama3-8b": "bfloat16", "tiny-llama": "float32"}.get(args.shape, "auto")
        settings = EngineSettings(
            model=model, device=args.device, dtype=dtype,
            max_num_seqs=max(concurrencies), max_model_len=workload.input_len + workload.output_len + 16,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes or ((32 << 30) if gpu else (256 << 20)))
        profile = None
        if args.profile_server:
            profile = lambda server: _PySpies(server, Path(args.profile_server))  # noqa: E731
        rounds = args.rounds or (1 if gpu else 3)
        deadline = started_mono + args.deadline if args.deadline else None
        runs = run_all(settings, workload, concurrencies, paths, vocab_size=vocab_size, log_dir=tmp,
                       rounds=rounds, profile_server=profile, deadline=deadline)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    where = device_name(args.device)
    title = (f"serve vs offline: {args.shape} on {where}, {workload.input_len} in / {workload.output_len} out, "
             f"{workload.prompts_per_stream} x C requests, median of {rounds} round(s)")
    stamp = time.strftime("%Y-%m-%d")
    stem = f"serve-vs-offline-{args.device}-{args.shape}-{stamp}"
    (out / f"{stem}.json").write_text(json.dumps({
        "title": title, "date": stamp, "device": where, "settings": asdict(settings), "workload": asdict(workload),
        "command": "python -m bench.serve_vs_offline " + " ".join(sys.argv[1:]),
        "runs": [{"path": r.path, "concurrency": r.concurrency, "round": r.round, "summary": r.summary,
                  "engine_cpu_s": r.engine_cpu_s, "client_cpu_s": r.client_cpu_s,
                  "frontend_cpu_s": r.frontend_cpu_s, "tokens_made": r.tokens_made,
                  "same_tokens": same_work(r, _offline_of(runs, r)) if r.path != "offline" and _offline_of(runs, r)
                  else None,
                  "agreement": agreement(r, _offline_of(runs, r)) if r.path != "offline" and _offline_of(runs, r)
                  else None} for r in runs]}, indent=1, default=str) + "\n")
    shown = medians(runs)
    plot(shown, out / f"{stem}.png", title)
    print(f"\nwrote {out / stem}.json and .png ({time.perf_counter() - started:.0f} s in all)\n")
    print(title)
    print(table(shown))
    return 0 if all(r.summary["failed"] == 0 for r in runs) else 1


def _offline_of(runs: list[PathRun], run: PathRun) -> PathRun | None:
    return next((r for r in runs if r.path == "offline" and r.concurrency == run.concurrency), None)


class _PySpies:
    """py-spy on every process of a server: serve's (PATH with the layout in its name: -split,
    -inproc) and, with --engine-process, the engine's (-engine added)."""

    def __init__(self, server: Server, path: Path) -> None:
        stem = path.with_name(f"{path.stem}{server.name}")
        pids = [server.pid, *_descendants(server.pid)]
        self.spies = [_PySpy(pid, stem.with_name(stem.name + ("-engine" if k else "") + path.suffix))
                      for k, pid in enumerate(pids)]

    def stop(self) -> None:
        for spy in self.spies:
            spy.stop()


class _PySpy:
    """py-spy record of a process, every thread, idle samples included, until stop(): a flame
    graph for an .svg path, else collapsed stacks."""

    def __init__(self, pid: int, path: Path) -> None:
        exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        fmt = "flamegraph" if path.suffix == ".svg" else "raw"  # raw: collapsed stacks, one per line
        self.proc = subprocess.Popen([exe, "record", "--pid", str(pid), "--output", str(path), "--rate", "200",
                                      "--threads", "--idle", "--format", fmt], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        self.proc.send_signal(2)  # SIGINT: py-spy writes the SVG and exits
        self.proc.wait(60)


if __name__ == "__main__":
    sys.exit(main())
