"""What the serving path adds to one request's time to first token, hop by hop (issue 41).

One request at a time (nothing queues), the same short prompt, max_tokens 1 and 2 (greedy, EOS
ignored), many repetitions, through:

- offline: `LLM` in this process with the server's engine settings: `LLM.generate` (its wall
  time; with max_tokens 1 that is the first token) and the engine stepped as generate steps it,
  timed to the first delta with tokens ("offline TTFT");
- http / grpc: `meshserve serve` in a subprocess as it starts by default (the engine in a
  process of its own, one front-end process), over /v1/completions with SSE and over Generate;
  the layouts of bench/serve_vs_offline.py (-inproc, -x2) too.

Printed: TTFT p50 / p90 per path and max_tokens, and the served excess over offline. Then, with
a second server started with MESHSERVE_HOP_TRACE (core/hop_trace.py: every process of the
server appends a time stamp where a request crosses a hop, on the clock the client reads, keyed
by the ids of the requests it is about), the same requests again, each with a request id of its
own, and the p50 of each interval between consecutive hops of that request (`attribute`: by its
ids, not by the order of other streams' marks): client -> front-end, HTTP body and tokenizing,
the channel to the engine process, admission, the replica's loop and step thread, the steps
until the one that gave its first token, delivery, the BATCH back, the framing and its own
write, the client. JSON + PNG go to --out.

--background N: N streams of long requests keep decoding while the measured requests arrive;
served, they run in a child process (bench/background_streams.py), so that the measured
request's reader is idle as a real client's would be (--background-client loop: in this loop).
Their marks fall inside the measured requests' windows; the attribution by id leaves them out.

    python -m bench.serve_latency                              # CPU, demo model, ~3 min
    python -m bench.serve_latency --paths offline,grpc,grpc-inproc --repeats 50
    python -m bench.serve_latency --device cuda --shape llama3-8b --input-len 512   # the H100/H200 run
    python -m bench.serve_latency --paths offline,http,grpc --background "0 15" --max-tokens 1 --repeats 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import meshserve.core.hop_trace as hop_trace  # imported before MESHSERVE_HOP_TRACE is set: not traced here
from bench.background_streams import BackgroundStreams
from bench.report import pyplot
from bench.serve_vs_offline import LAYOUTS as SERVE_LAYOUTS
from bench.serve_vs_offline import face_of, layout_of
from bench.served import EngineSettings, GreedyGrpc, GreedyOpenAI, Server, device_name, model_for_shape
from meshserve.api.bench.loadgen import BenchRequest, Sample

# -sync: serve --no-async-scheduling (offline-sync: LLM(async_scheduling=False)). On a CPU a step's
# submit computes the whole step, so overlap scheduling delivers each token one step later.
LAYOUTS = {**SERVE_LAYOUTS, "-sync": ["--no-async-scheduling"]}
OFFLINE = ("offline", "offline-sync")
KNOWN = (*OFFLINE, *(face + layout for layout in LAYOUTS for face in ("http", "grpc")))
DEFAULT_PROMPT = "The for statement is used to"
BACKGROUND_TOKENS = 200  # a background request's length (--background): sent again when it ends

# The hops in the order a request crosses them; an interval is named by the hop it ends at. Each is
# the request's first mark of that name (see attribute; step.start is handled apart).
HOPS = [
    ("http.asgi", "client -> HTTP front-end (connection, HTTP parse)"),
    ("http.route", "ASGI middleware, FastAPI routing"),
    ("http.body_parsed", "body: read, JSON + pydantic (worker thread)"),
    ("http.tokenized", "prompt tokenized, its jobs made"),
    ("grpc.handler", "client -> gRPC handler (HTTP/2, protobuf parse)"),
    ("frontend.open", "front-end: checks, prompt params converted, stream opened"),
    ("engine.open_received", "channel: OPEN packed, signed, sent -> engine process, verified, decoded"),
    ("coordinator.submitted", "coordinator: validate, admit, submit to the replica (one process: + the "
                              "front-end's checks)"),
    ("engine.admitted", "endpoint: the stream's sink registered"),
    ("replica.added", "replica loop wakes, request added to the scheduler"),
    ("step.start", "loop -> step thread (to_thread)"),
    ("step.end", "engine steps until the step that gave the token returns"),
    ("replica.delivered", "step thread -> loop, delta to the stream's sink"),
    ("engine.batch", "engine: the pass ends, flush: state snapshot"),
    ("frontend.batch_received", "channel: BATCH packed, signed, sent -> front-end, verified, unpacked"),
    ("frontend.delta_out", "front-end: items routed, the stream's reader wakes (first tokens first), "
                           "its delta decoded"),
    ("http.write", "HTTP: chunk shaped, SSE framed"),
    ("grpc.write", "gRPC: response message built"),
    ("client", "its own write -> client: first token read"),
]
# Marks about a step or a pass of several streams: keyed by the requests whose first token they
# carry. Any other keyed mark is about one request, and one that carries two ids links them.
PER_PASS = ("step.end", "engine.batch", "frontend.batch_received")
STEP_MARKS = ("step.start", "step.end", "step.end_empty")


@dataclass
class PathRun:
    path: str
    max_tokens: int
    background: int = 0  # streams decoding beside the measured requests (--background)
    ttft_ms: list[float] = field(default_factory=list)
    total_ms: list[float] = field(default_factory=list)  # the whole request
    generate_ms: list[float] = field(default_factory=list)  # offline: LLM.generate's wall time
    hops: dict[str, list[float]] = field(default_factory=dict)  # traced: interval (ending at hop) -> ms each
    steps_ms: list[float] = field(default_factory=list)  # traced: the engine's step time within the TTFT
    num_steps: list[int] = field(default_factory=list)  # traced: steps run before the token came back
    step_ms: list[float] = field(default_factory=list)  # with background: the time between its tokens (a step)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


# -- offline ---------------------------------------------------------------------------------------


def run_offline(llm, path: str, prompt, max_tokens: int, repeats: int, warmup: int, background: int = 0,
                background_tokens: int = BACKGROUND_TOKENS) -> PathRun:
    from meshserve.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    run = PathRun(path, max_tokens, background)
    if background:
        return _offline_beside(llm, run, prompt, params, repeats, warmup, background_tokens)
    core = llm.core
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        llm.generate(prompt, params)
        generate = time.perf_counter() - t0
        t0 = time.perf_counter()
        core.add(core.make_request(prompt, params))
        first = None
        while core.has_unfinished():
            for delta in core.step():
                if delta.token_ids and first is None:
                    first = time.perf_counter() - t0
        if i >= warmup:
            run.generate_ms.append(1e3 * generate)
            run.ttft_ms.append(1e3 * first)
            run.total_ms.append(1e3 * (time.perf_counter() - t0))
    return run


def _offline_beside(llm, run: PathRun, prompt, params, repeats: int, warmup: int, background_tokens: int) -> PathRun:
    """The engine stepped with `run.background` long requests decoding: each measured request is
    added between two steps (in one thread nothing arrives mid-step) and timed to its first token."""
    from meshserve.core.sampling_params import SamplingParams

    core = llm.core
    long = SamplingParams(temperature=0.0, max_tokens=background_tokens, ignore_eos=True)
    others: set[str] = set()

    def step() -> list:
        t = time.perf_counter()
        deltas = core.step()
        run.step_ms.append(1e3 * (time.perf_counter() - t))
        for d in deltas:
            if d.finished and d.request_id in others:
                others.discard(d.request_id)
        while len(others) < run.background:
            r = core.make_request(prompt, long)
            core.add(r)
            others.add(r.request_id)
        return deltas

    step()
    for _ in range(3):  # the background decoding
        step()
    run.step_ms.clear()
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        req = core.make_request(prompt, params)
        core.add(req)
        first = None
        while True:
            deltas = [d for d in step() if d.request_id == req.request_id]
            if first is None and any(d.token_ids for d in deltas):
                first = time.perf_counter() - t0
            if any(d.finished for d in deltas):
                break
        if i >= warmup:
            run.ttft_ms.append(1e3 * first)
            run.total_ms.append(1e3 * (time.perf_counter() - t0))
    for rid in list(others):
        core.abort(rid)
    while core.has_unfinished():
        core.step()
    return run


# -- served ----------------------------------------------------------------------------------------


def measured_request_id(path: str, max_tokens: int, background: int, i: int) -> str:
    """The id the i-th measured request of a run is sent with (warm-ups counted)."""
    return f"hop-{path}-mt{max_tokens}-bg{background}-{i}"


async def _served(server: Server, path: str, prompt, max_tokens: int, repeats: int, warmup: int,
                  background: int = 0, background_client: str = "process",
                  background_tokens: int = BACKGROUND_TOKENS) -> tuple[PathRun, list[Window]]:
    """(the run, each measured request's window: its request id, sent and first token). background:
    streams of long requests kept decoding meanwhile (each sent again when it ends), from a
    process of their own (background_client "process": bench/background_streams.py; "loop": from
    this loop, as before 2026-12-06, whose reading of their tokens delays the measured one's);
    the measured requests are then sent at a random moment of a step (a pause of up to two of
    its steps)."""
    face = face_of(path)
    address = server.base_url if face == "http" else server.grpc_address
    backend = GreedyOpenAI(address, token=None, model="") if face == "http" else GreedyGrpc(
        address, token=None, model="")
    run, windows = PathRun(path, max_tokens, background), []
    stop = asyncio.Event()
    in_loop = background and background_client == "loop"
    child = BackgroundStreams(face, address, prompt, background, background_tokens) if (
        background and not in_loop) else None

    async def keep_decoding(k: int) -> None:
        long = BenchRequest(prompt, background_tokens, seed=1 + k)
        while not stop.is_set():
            sample = Sample(0, background_tokens)
            await backend.send(long, sample, 0.0)
            run.step_ms += [1e3 * (b - a) for a, b in zip(sample.arrivals, sample.arrivals[1:])]

    tasks = []
    rng = random.Random(0)
    try:
        backend.model, _, _ = await backend.model_info()
        if in_loop:
            tasks = [asyncio.ensure_future(keep_decoding(k)) for k in range(background)]
            await asyncio.sleep(0.5)  # the background decoding
        elif child is not None:
            run.step_ms += child.start()  # returns once every stream decodes
        request = BenchRequest(prompt, max_tokens, seed=0)
        for i in range(warmup + repeats):
            request_id = measured_request_id(path, max_tokens, background, i)  # the key of its marks (attribute)
            if background:
                if child is not None:
                    run.step_ms += child.drain()  # between requests: nothing wakes this loop meanwhile
                step = pct(run.step_ms, 0.5) or 10.0
                await asyncio.sleep(rng.uniform(0, 2 * step) / 1e3)
            sample = Sample(0, max_tokens)
            sent = time.perf_counter()
            await backend.send(request, sample, 0.0, request_id=request_id)  # arrivals in perf_counter seconds
            done = time.perf_counter()
            if not sample.arrivals:
                raise RuntimeError(f"{path}: a request came back with no token")
            if i >= warmup:
                run.ttft_ms.append(1e3 * (sample.arrivals[0] - sent))
                run.total_ms.append(1e3 * (done - sent))
                windows.append(Window(request_id, int(sent * 1e9), int(sample.arrivals[0] * 1e9)))
    finally:
        stop.set()
        if child is not None:
            run.step_ms += child.stop()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await backend.close()
    return run, windows


class Mark(NamedTuple):
    """One line of the trace (core/hop_trace.py)."""

    ns: int  # perf_counter_ns: CLOCK_MONOTONIC, shared by the machine's processes
    pid: int
    stage: str
    keys: frozenset[str]  # the ids of the requests it is about


class Window(NamedTuple):
    """A measured request as its client saw it (perf_counter_ns)."""

    request_id: str  # the id the client sent (gRPC's request_id, HTTP's x-request-id)
    sent: int
    first: int  # its first token read


def read_trace(path: Path) -> list[Mark]:
    marks = []
    for line in path.read_text().splitlines():
        ns, pid, stage, *keys = line.split(" ")
        marks.append(Mark(int(ns), int(pid), stage, frozenset(keys)))
    marks.sort()
    return marks


def _identity(request_id: str, inside: list[Mark]) -> set[str]:
    """The request's ids: the client's, and those a mark about one request links to it (gRPC's
    scoped id on grpc.write, the service's ids of an HTTP request's prompts on http.tokenized,
    the engine's on coordinator.submitted)."""
    ids = {request_id}
    grown = True
    while grown:
        grown = False
        for m in inside:
            if len(m.keys) > 1 and m.stage not in PER_PASS and ids & m.keys and not m.keys <= ids:
                ids |= m.keys
                grown = True
    return ids


def attribute(run: PathRun, marks: list[Mark], windows: list[Window]) -> None:
    """Each request's marks -> the interval ending at each hop, the step time, the number of steps.

    Exact, by the marks' keys (core/hop_trace.py): within the request's window (its send to its
    first token), a hop is the first mark of its name that names the request, by the id its
    client sent or one linked to it (`_identity`). Per request, that is its own mark — its
    first delta's for the per-delta hops (replica.delivered, frontend.delta_out, the writes),
    so "client" is its own write -> its read; per step or pass (step.end, engine.batch,
    frontend.batch_received), the first that carried its first token. step.start is the first
    step of that thread after the request was added (replica.added), and the steps counted are
    those from there to the step that gave its token. Marks of other streams (--background)
    are never taken, wherever they fall in the window. (Until 2026-12-06 the bench went by
    names and order: step.end was the first step that returned any deltas, with background and
    overlap scheduling often the other streams' with the token a step later, the intervals after
    it shifting into "client"; the per-stream hops were the last of their name in that pass.)"""
    import bisect

    times = [m.ns for m in marks]
    for request_id, sent, first in windows:
        inside = marks[bisect.bisect_left(times, sent):bisect.bisect_right(times, first)]
        ids = _identity(request_id, inside)
        at: dict[str, Mark] = {}
        for m in inside:
            if m.stage not in at and not m.keys.isdisjoint(ids):
                at[m.stage] = m
        token_step = at.get("step.end")
        begin = at["replica.added"].ns if "replica.added" in at else sent
        end = token_step.ns if token_step is not None else first
        steps, step_start = [], None
        for m in inside:  # the steps of the thread that gave the token (one replica per engine process here)
            if m.stage not in STEP_MARKS or (token_step is not None and m.pid != token_step.pid):
                continue
            if m.stage == "step.start" and begin <= m.ns:
                if not steps and step_start is None and token_step is not None:
                    at["step.start"] = m
                step_start = m.ns
            elif m.stage != "step.start" and step_start is not None and m.ns <= end:
                steps.append(m.ns - step_start)
                step_start = None
        prev = sent
        for hop, _what in HOPS[:-1]:
            if hop in at:
                run.hops.setdefault(hop, []).append((at[hop].ns - prev) / 1e6)
                prev = at[hop].ns
        run.hops.setdefault("client", []).append((first - prev) / 1e6)
        run.num_steps.append(len(steps))
        run.steps_ms.append(sum(steps) / 1e6)


# -- the run ---------------------------------------------------------------------------------------


def run_all(settings: EngineSettings, paths: list[str], prompt, max_tokens_list: list[int], *, repeats: int,
            warmup: int, log_dir: Path, trace: bool, backgrounds: tuple[int, ...] = (0,),
            background_client: str = "process", background_tokens: int = BACKGROUND_TOKENS,
            ) -> tuple[list[PathRun], list[PathRun]]:
    """(untraced runs, traced runs). Each background count is a run of its own; background_client:
    where the served paths' background streams run ("process" or "loop", see _served)."""
    runs, traced = [], []
    for path in (p for p in OFFLINE if p in paths):
        from meshserve.api.llm import LLM

        sync = False if path == "offline-sync" else None  # None: LLM's default (overlap where the device runs async)
        llm = LLM(settings.model, progress=False, async_scheduling=sync, **settings.llm_kwargs())
        try:
            for bg in backgrounds:
                for mt in max_tokens_list:
                    runs.append(run_offline(llm, path, prompt, mt, repeats, warmup, bg, background_tokens))
                    print(f"  {path} max_tokens={mt} background={bg}: TTFT p50 {pct(runs[-1].ttft_ms, 0.5):.2f} ms",
                          flush=True)
        finally:
            llm.shutdown()
    served = [p for p in paths if p not in OFFLINE]
    for layout in dict.fromkeys(layout_of(p) for p in served):
        for traced_pass in ((False, True) if trace else (False,)):
            trace_file = log_dir / f"hops{layout}.txt"
            env = {hop_trace.ENV: str(trace_file)} if traced_pass else {}
            with Server(settings, log_path=log_dir / f"server{layout}.log", flags=LAYOUTS[layout], name=layout,
                        env=env) as server:
                for bg in backgrounds:
                    for mt in max_tokens_list:
                        for path in (p for p in served if layout_of(p) == layout):
                            run, windows = asyncio.run(_served(server, path, prompt, mt, repeats, warmup, bg,
                                                               background_client, background_tokens))
                            if traced_pass:
                                attribute(run, read_trace(trace_file), windows)
                            (traced if traced_pass else runs).append(run)
                            print(f"  {path}{' traced' if traced_pass else ''} max_tokens={mt} background={bg}: "
                                  f"TTFT p50 {pct(run.ttft_ms, 0.5):.2f} ms", flush=True)
    return runs, traced


def _f(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def table(runs: list[PathRun]) -> str:
    """One row per background count, max_tokens and path; with background, the step time its
    streams saw (the time between their tokens) beside the TTFT."""
    offline = {(r.path, r.max_tokens, r.background): r for r in runs if r.path in OFFLINE}
    lines = ["| background | max_tokens | path | TTFT p50 ms | TTFT p90 ms | served - offline p50 ms (-sync: - "
             "offline-sync) | whole request p50 ms | LLM.generate p50 ms | background step p50 ms |",
             "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in sorted(runs, key=lambda r: (r.background, r.max_tokens, KNOWN.index(r.path))):
        base = offline.get(("offline-sync" if r.path.endswith("-sync") else "offline", r.max_tokens, r.background))
        extra = (pct(r.ttft_ms, 0.5) - pct(base.ttft_ms, 0.5)) if base is not None and r.path not in OFFLINE else None
        lines.append(f"| {r.background} | {r.max_tokens} | {r.path} | {_f(pct(r.ttft_ms, 0.5))} | "
                     f"{_f(pct(r.ttft_ms, 0.9))} | {_f(extra)} | {_f(pct(r.total_ms, 0.5))} | "
                     f"{_f(pct(r.generate_ms, 0.5))} | {_f(pct(r.step_ms, 0.5))} |")
    return "\n".join(lines)


def _label(r: PathRun, sep: str) -> str:
    return f"{r.path}{sep}mt={r.max_tokens}" + (f" bg={r.background}" if r.background else "")


def hop_table(traced: list[PathRun]) -> str:
    """p50 of each interval (ms), one column per traced path and max_tokens."""
    if not traced:
        return ""
    cols = sorted(traced, key=lambda r: (r.background, KNOWN.index(r.path), r.max_tokens))
    head = "| interval ending at | what it holds | " + " | ".join(_label(r, " ") for r in cols) + " |"
    lines = [head, "| --- | --- |" + " ---: |" * len(cols)]
    for hop, what in HOPS:
        if not any(hop in r.hops for r in cols):
            continue
        cells = [_f(pct(r.hops.get(hop, []), 0.5), 3) for r in cols]
        lines.append(f"| {hop} | {what} | " + " | ".join(cells) + " |")
    lines.append("| (sum of the p50s) | | " + " | ".join(
        _f(sum(pct(v, 0.5) for v in r.hops.values()), 3) for r in cols) + " |")
    lines.append("| TTFT p50 (traced run) | | " + " | ".join(_f(pct(r.ttft_ms, 0.5), 3) for r in cols) + " |")
    lines.append("| of which engine steps | time inside `core.step()` | " + " | ".join(
        _f(pct(r.steps_ms, 0.5), 3) for r in cols) + " |")
    lines.append("| steps before the token | | " + " | ".join(
        _f(pct([float(n) for n in r.num_steps], 0.5), 0) for r in cols) + " |")
    return "\n".join(lines)


def plot(runs: list[PathRun], traced: list[PathRun], path: Path, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(15, 5))
    ordered = sorted(runs, key=lambda r: (r.background, r.max_tokens, KNOWN.index(r.path)))
    labels = [_label(r, "\n") for r in ordered]
    axes[0].bar(labels, [pct(r.ttft_ms, 0.5) for r in ordered], label="p50")
    axes[0].scatter(labels, [pct(r.ttft_ms, 0.9) for r in ordered], color="black", marker="_", s=300, label="p90")
    axes[0].tick_params(axis="x", labelrotation=60, labelsize=8)
    axes[0].set(ylabel="TTFT (ms)", title="time to first token, one request at a time")
    axes[0].legend()
    axes[0].grid(True, axis="y", alpha=0.3)
    cols = sorted(traced, key=lambda r: (r.background, KNOWN.index(r.path), r.max_tokens))
    bottoms = [0.0] * len(cols)
    xs = [_label(r, "\n") for r in cols]
    colors = plt.get_cmap("tab20").colors
    for k, (hop, _what) in enumerate(HOPS):
        heights = [pct(r.hops.get(hop, []), 0.5) or 0.0 for r in cols]
        if any(heights):
            axes[1].bar(xs, heights, bottom=bottoms, label=hop, color=colors[k % len(colors)])
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    axes[1].tick_params(axis="x", labelsize=8)
    axes[1].set(ylabel="ms (p50 of each interval)", title="where the served TTFT goes (traced server)")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[1].grid(True, axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rounded(value):
    """Milliseconds to the microsecond (the JSON stays small)."""
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shape", default="demo", choices=["demo", "llama3-8b", "tiny-llama"])
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help="the text every request sends (unless --input-len)")
    ap.add_argument("--input-len", type=int, default=None,
                    help="send this many fixed random token ids instead of --prompt (the random checkpoints' "
                         "WordLevel vocabulary has no words for text)")
    ap.add_argument("--max-tokens", default="1 2", help="space-separated (default '1 2')")
    ap.add_argument("--paths", default="offline,http,grpc", help=f"comma-separated, of {', '.join(KNOWN)}")
    ap.add_argument("--background", default="0",
                    help="space-separated counts of streams kept decoding while the measured requests arrive "
                         "(default '0': nothing else runs; e.g. '0 4': a request arriving mid-step waits for it)")
    ap.add_argument("--background-client", default="process", choices=["process", "loop"],
                    help="where the served paths' background streams run: 'process' (default), a child process "
                         "of their own (bench/background_streams.py), so that the measured request's reader is "
                         "idle as a real client's is; 'loop': the bench's own asyncio loop, as before 2026-12-06 "
                         "(reading their tokens delays the measured request's: a bench artefact in 'client')")
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--no-trace", action="store_true", help="skip the traced server (the hop breakdown)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads of both sides (OMP_NUM_THREADS)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    bad = [p for p in paths if p not in KNOWN]
    if bad:
        ap.error(f"--paths: {bad} not among {list(KNOWN)}")
    max_tokens_list = [int(x) for x in args.max_tokens.split()]
    if args.threads is not None:
        import torch

        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="meshserve-serve-latency-"))
    started = time.perf_counter()
    try:
        model = model_for_shape(tmp, args.shape)
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        if args.input_len is not None:
            import random

            rng = random.Random(0)
            prompt = [rng.randrange(10, vocab) for _ in range(args.input_len)]
        else:
            prompt = args.prompt
        gpu = args.device == "cuda"
        dtype = args.dtype or {"llama3-8b": "bfloat16", "tiny-llama": "float32"}.get(args.shape, "auto")
        backgrounds = tuple(int(x) for x in args.background.split())
        settings = EngineSettings(model=model, device=args.device, dtype=dtype, max_num_seqs=16 + max(backgrounds),
                                  max_model_len=(args.input_len or 64) + max(*max_tokens_list, BACKGROUND_TOKENS) + 64,
                                  kv_cache_memory_bytes=(4 << 30) if gpu else (64 << 20))
        runs, traced = run_all(settings, paths, prompt, max_tokens_list, repeats=args.repeats, warmup=args.warmup,
                               log_dir=tmp, trace=not args.no_trace, backgrounds=backgrounds,
                               background_client=args.background_client)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    where = device_name(args.device)
    what = f"{args.input_len} random token ids" if args.input_len else f"{args.prompt!r}"
    title = (f"served TTFT, one request at a time: {args.shape} on {where}, prompt {what}, "
             f"{args.repeats} repeats")
    stamp = time.strftime("%Y-%m-%d")
    stem = f"serve-latency-{args.device}-{args.shape}-{stamp}"
    (out / f"{stem}.json").write_text(json.dumps({
        "title": title, "date": stamp, "device": where,
        "command": "python -m bench.serve_latency " + " ".join(sys.argv[1:]),
        "background_client": args.background_client,
        "settings": asdict(settings), "load_average": os.getloadavg(),
        "runs": [_rounded(asdict(r)) for r in runs], "traced": [_rounded(asdict(r)) for r in traced]}) + "\n")
    plot(runs, traced, out / f"{stem}.png", title)
    print(f"\nwrote {out / stem}.json and .png ({time.perf_counter() - started:.0f} s in all)\n")
    print(title)
    print(table(runs))
    if traced:
        print("\nhop by hop (traced server; p50 of each interval, ms):")
        print(hop_table(traced))
    return 0


if __name__ == "__main__":
    sys.exit(main())
