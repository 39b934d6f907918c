"""Chaos figures (issue 23): a hung rank detected, migrated streams resuming, a running stream's
gaps while a 15 MiB prompt arrives, capacity back after a crash loop.

The bundled demo model (float32, CPU, TORCH attention) in a unified pool of two replicas whose
ranks are subprocesses (`runtime="processes"`, tp=1), so that faults are real signals:
- hang (`--trials` times): greedy streams run on both replicas; SIGSTOP on the rank of the
  replica holding most of them. Measured: fault -> replica declared hung (the step deadline is
  `--step-timeout` s), detection -> first new token of each migrated stream, the longest pause a
  migrated stream showed, and whether every stream equals its unfaulted run (token ids).
- kill: the same with SIGKILL (found by the launcher, no deadline involved).
- crash loop: the slot's rank is SIGKILLed, then each rank process its rebuild starts is killed
  as soon as it appears (`--crash-loop` kills in all, the back-off growing), then quiet: the time
  from the last kill to both replicas serving again.
- flood: bench/prompt_flood.py's `cap` case (a fresh in-process server; one 15 MiB prompt).
Prints a table; writes bench/results/chaos.json and chaos.png (stream timelines, healthy
replicas over the crash loop, the flood's inter-token gaps).

    python -m bench.chaos                  # everything, ~2-3 min on 2 cores
    python -m bench.chaos --trials 1 --no-flood
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import time
from pathlib import Path

from meshserve.cluster.coordinator import ClusterConfig, Coordinator
from meshserve.cluster.replica import ReplicaState
from meshserve.config import AttentionConfig, CacheConfig, ModelConfig, PoolConfig, SchedulerConfig
from meshserve.core.sampling_params import SamplingParams
from meshserve.demo_model import DEMO_MODEL_DIR
from meshserve.engine.engine_config import EngineConfig

PROMPTS = [[5, 6, 7, 8 + i] for i in range(6)]


def _config(args: argparse.Namespace) -> ClusterConfig:
    engine = EngineConfig(model=ModelConfig(model=str(DEMO_MODEL_DIR), dtype="float32", max_model_len=1024),
                          cache=CacheConfig(block_size=16, num_kv_blocks=400),
                          scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512),
                          attention=AttentionConfig(backend="TORCH"))
    pools = PoolConfig(replicas=2, step_timeout_base_s=args.step_timeout, step_timeout_per_token_s=0.005)
    return ClusterConfig(engine=engine, pools=pools, runtime="processes", device="cpu", health_period_s=0.5)


async def _stream(c: Coordinator, rid: str, prompt: list[int], params: SamplingParams, log: list) -> list[int]:
    """The stream's token ids; appends (time, tokens so far) to log at each delta."""
    tokens: list[int] = []
    async for d in c.generate(prompt, params, request_id=rid):
        tokens += d.token_ids
        log.append((time.perf_counter(), len(tokens)))
    return tokens


async def _until(cond, what: str, timeout_s: float = 300.0, poll_s: float = 0.005) -> float:
    deadline = time.perf_counter() + timeout_s
    while not cond():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(poll_s)
    return time.perf_counter()


async def fault_trial(c: Coordinator, sig: signal.Signals, want: dict[str, list[int]], params: SamplingParams,
                      tag: str) -> dict:
    logs = {f"{tag}-{i}": [] for i in range(len(PROMPTS))}
    tasks = {rid: asyncio.ensure_future(_stream(c, rid, p, params, logs[rid])) for rid, p in zip(logs, PROMPTS)}
    await _until(lambda: all(len(v) >= 5 for v in logs.values()), "every stream's fifth delta")
    victim = max(c.replicas(), key=lambda r: r.load)
    moving = [t.client_id for t in victim._held.values()]
    (proc,) = victim.executor.ranks.procs
    t_fault = time.perf_counter()
    os.kill(proc.pid, sig)
    t_detect = await _until(lambda: victim.state is ReplicaState.FAILED, "the replica to fail")
    got = {rid: await t for rid, t in tasks.items()}
    resume = []
    for rid in moving:
        after = [t for t, _ in logs[rid] if t > t_detect]
        if after:
            resume.append(after[0] - t_detect)
    pauses = {rid: max(b[0] - a[0] for a, b in zip(logs[rid], logs[rid][1:])) for rid in logs}
    identical = sum(got[rid] == want[rid.split("-", 1)[1]] for rid in got)
    await _until(lambda: c.health().healthy_replicas == 2, "the slot to be rebuilt", poll_s=0.05)
    return {"signal": sig.name, "detect_s": t_detect - t_fault, "migrated": len(moving), "resume_s": resume,
            "max_pause_migrated_s": max((pauses[r] for r in moving), default=0.0),
            "max_pause_others_s": max((p for r, p in pauses.items() if r not in moving), default=0.0),
            "identical": identical, "streams": len(got),
            "timeline": {rid: [(t - t_fault, n) for t, n in v] for rid, v in logs.items()},
            "moving": moving, "t_detect": t_detect - t_fault}


def _rank_pids(exclude: set[int]) -> list[int]:
    """This process's rank subprocesses (meshserve.cluster.executors.multiproc), less `exclude`."""
    me, out = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in exclude:
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == me and b"meshserve.cluster.executors.multiproc" in cmd:
            out.append(int(entry))
    return out


async def crash_loop(c: Coordinator, kills: int) -> dict:
    healthy: list[tuple[float, int]] = []
    t0 = time.perf_counter()

    async def watch() -> None:
        while True:
            healthy.append((time.perf_counter() - t0, c.health().healthy_replicas))
            await asyncio.sleep(0.05)

    watcher = asyncio.ensure_future(watch())
    victim, other = c.replicas()
    seen = {proc.pid for proc in other.executor.ranks.procs}
    kill_times = []
    (proc,) = victim.executor.ranks.procs
    os.kill(proc.pid, signal.SIGKILL)
    seen.add(proc.pid)
    kill_times.append(time.perf_counter() - t0)
    found: list[int] = []

    def appeared() -> bool:
        found[:] = _rank_pids(seen)
        return bool(found)

    for _ in range(kills - 1):  # each rank process the rebuild starts dies as it appears
        await _until(appeared, "the rebuild's rank process", poll_s=0.01)
        for pid in found:
            seen.add(pid)
            os.kill(pid, signal.SIGKILL)
        kill_times.append(time.perf_counter() - t0)
    t_back = await _until(lambda: c.health().healthy_replicas == 2, "full capacity", poll_s=0.05)
    watcher.cancel()
    h = c.health()
    healthy.append((t_back - t0, h.healthy_replicas))
    return {"kills": kills, "restored_s": t_back - t0 - kill_times[-1], "kill_times": kill_times,
            "healthy": healthy, "rebuilds": h.num_rebuilds, "rebuild_failures": h.num_rebuild_failures}


async def cluster_figures(args: argparse.Namespace) -> dict:
    c = await Coordinator(_config(args)).start()
    try:
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        want = dict(zip([str(i) for i in range(len(PROMPTS))],
                        await asyncio.gather(*(_stream(c, f"ref-{i}", p, params, []) for i, p in enumerate(PROMPTS)))))
        hangs = [await fault_trial(c, signal.SIGSTOP, want, params, f"hang{k}") for k in range(args.trials)]
        kills = [await fault_trial(c, signal.SIGKILL, want, params, f"kill{k}") for k in range(args.trials)]
        loop = await crash_loop(c, args.crash_loop)
        s = c.stats()
        return {"hang": hangs, "kill": kills, "crash_loop": loop,
                "stats": {"migrations": s.num_migrations, "hung": s.num_hung_replicas,
                          "hung_detection_s": s.hung_detection_s}}
    finally:
        await c.shutdown(drain=False)


def flood_figures(args: argparse.Namespace) -> dict:
    from bench.prompt_flood import run_case
    from meshserve.api.convert import ApiLimits

    ns = argparse.Namespace(prompts=1, mib=args.flood_mib, stream_tokens=400, max_model_len=2048)
    return run_case("cap", ApiLimits(), ns)


def _med(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f}, n={len(values)})"


def table(r: dict, args: argparse.Namespace) -> list[str]:
    rows = ["| figure | measured | target |", "| --- | --- | --- |"]
    for kind in ("hang", "kill"):
        trials = r[kind]
        what = f"SIGSTOP, deadline {args.step_timeout:g} s + 5 ms/token" if kind == "hang" else "SIGKILL"
        rows.append(f"| fault -> replica failed ({what}) | {_med([t['detect_s'] for t in trials])} | "
                    f"{'deadline + 0.1 s' if kind == 'hang' else '0.1 s + a step'} |")
        resume = [x for t in trials for x in t["resume_s"]]
        if resume:
            rows.append(f"| {kind}: detection -> migrated stream's next token | {_med(resume)} | "
                        "a pause, not an error |")
        rows.append(f"| {kind}: longest pause of a migrated stream / of the others | "
                    f"{max(t['max_pause_migrated_s'] for t in trials):.2f} s / "
                    f"{max(t['max_pause_others_s'] for t in trials):.2f} s | |")
        rows.append(f"| {kind}: streams migrated; greedy streams identical to unfaulted | "
                    f"{sum(t['migrated'] for t in trials)}; {sum(t['identical'] for t in trials)} of "
                    f"{sum(t['streams'] for t in trials)} | all identical |")
    loop = r["crash_loop"]
    rows.append(f"| crash loop ({loop['kills']} kills, {loop['rebuild_failures']} failed rebuilds): last kill -> "
                f"2 of 2 replicas | {loop['restored_s']:.1f} s | <= 30 s |")
    if r.get("flood"):
        f = r["flood"]
        rows.append(f"| running stream's max inter-token gap while a {args.flood_mib} MiB prompt arrives "
                    f"(median gap) | {f['max_gap_s'] * 1e3:.0f} ms ({f['median_gap_s'] * 1e3:.0f} ms); refused "
                    f"{', '.join(f['codes'])} in {f['per_prompt_s'] * 1e3:.0f} ms | <= 500 ms |")
    return rows


def plot(r: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return
    panels = 3 if r.get("flood") else 2
    fig, axes = plt.subplots(panels, 1, figsize=(8, 2.8 * panels))
    hang = r["hang"][0]
    for rid, points in hang["timeline"].items():
        migrated = rid in hang["moving"]
        axes[0].plot([t for t, _ in points], [n for _, n in points], "-", lw=1.2 if migrated else 0.8,
                     color="tab:red" if migrated else "tab:gray", label=None)
    axes[0].axvline(0, color="k", ls=":", lw=1)
    axes[0].axvline(hang["t_detect"], color="tab:red", ls="--", lw=1)
    axes[0].set_title(f"SIGSTOP at 0 (dotted), declared hung at {hang['t_detect']:.2f} s (dashed); "
                      "red: migrated streams", fontsize=9)
    axes[0].set_xlabel("seconds since the fault")
    axes[0].set_ylabel("tokens streamed")
    loop = r["crash_loop"]
    axes[1].step([t for t, _ in loop["healthy"]], [n for _, n in loop["healthy"]], where="post")
    for t in loop["kill_times"]:
        axes[1].axvline(t, color="tab:red", ls=":", lw=1)
    axes[1].set_ylim(-0.1, 2.3)
    axes[1].set_title(f"crash loop: healthy replicas (kills dotted); back to 2 of 2 {loop['restored_s']:.1f} s "
                      "after the last", fontsize=9)
    axes[1].set_xlabel("seconds")
    if r.get("flood"):
        from bench.prompt_flood import plot_gaps

        f = r["flood"]
        plot_gaps(axes[2], f, f"a running stream's inter-token gaps, a {f['prompt_chars'] / 2**20:.0f} MiB prompt "
                              f"in flight shaded: max {f['max_gap_s'] * 1e3:.0f} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=3, help="hang and kill trials each")
    p.add_argument("--tokens", type=int, default=200, help="tokens per stream")
    p.add_argument("--step-timeout", type=float, default=2.0, help="--step-timeout-base of the replicas, seconds")
    p.add_argument("--crash-loop", type=int, default=4, help="kills in the crash loop")
    p.add_argument("--flood-mib", type=int, default=15, help="MiB of the huge text prompt")
    p.add_argument("--no-flood", action="store_true", help="skip the prompt-flood case")
    p.add_argument("--out", default="bench/results", help="folder for the JSON and the PNG")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = asyncio.run(cluster_figures(args))
    result["flood"] = None if args.no_flood else flood_figures(args)
    print("\n".join(table(result, args)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(result, out / "chaos.png")
    slim = json.loads(json.dumps(result))
    for trial in slim["hang"] + slim["kill"]:
        trial.pop("timeline")
    if slim["flood"]:
        slim["flood"].pop("gaps")
    (out / "chaos.json").write_text(json.dumps({"args": vars(args), "results": slim}, indent=1))


if __name__ == "__main__":
    main()
