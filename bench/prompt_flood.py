"""A running stream's inter-token gaps while huge text prompts arrive (issue 23, item 1).

The bundled demo model (float32, CPU, TORCH attention) behind a real gRPC server on 127.0.0.1.
Greedy streams of `--stream-tokens` tokens run back to back (gaps measured within each);
meanwhile `--prompts` text prompts of `--mib` MiB each are sent one after the other. Two cases, each on a fresh server:
- `cap`: the server's character cap (max_model_len x 32 characters): refused before tokenizing;
- `no-cap`: the cap lifted (ApiLimits.max_chars_per_token huge): the text is tokenized (in a
  thread, with the GIL released) and then refused by its token count, as before the cap.
Printed: time per huge prompt, the stream's max and median inter-token gap, the refusals' code.
A PNG plots every gap against time since the stream started, with the huge prompts' spans.

    python -m bench.prompt_flood                     # 4 prompts of 15 MiB, table + PNG in bench/results
    python -m bench.prompt_flood --prompts 1 --mib 2 # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from pathlib import Path

import grpc

from meshserve.api.client import InferenceClient
from meshserve.api.convert import ApiLimits
from meshserve.api.server import ApiServer
from meshserve.cluster.coordinator import ClusterConfig, Coordinator
from meshserve.config import AttentionConfig, CacheConfig, ModelConfig, SchedulerConfig, ServerConfig
from meshserve.demo_model import DEMO_MODEL_DIR
from meshserve.engine.engine_config import EngineConfig


def _service(max_model_len: int) -> Coordinator:
    config = EngineConfig(model=ModelConfig(model=str(DEMO_MODEL_DIR), dtype="float32", max_model_len=max_model_len),
                          cache=CacheConfig(block_size=16, num_kv_blocks=400),
                          scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024),
                          attention=AttentionConfig(backend="TORCH"))
    return Coordinator(ClusterConfig(engine=config, runtime="in-process", device="cpu"))


def run_case(name: str, limits: ApiLimits, args: argparse.Namespace) -> dict:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(600)

    service = _service(args.max_model_len)
    on_loop(service.start())
    server = ApiServer(service, ServerConfig(port=0, metrics_port=0, max_message_bytes=(args.mib + 1) << 20),
                       max_queue=64, limits=limits, metrics=False)
    on_loop(server.start())
    streams: list[list[float]] = []  # token arrival times, one list per stream
    spans: list[tuple[float, float]] = []
    codes: list[str] = []
    with InferenceClient(server.address, max_message_bytes=(args.mib + 1) << 20) as client:
        client.generate([5, 6, 7], max_tokens=4, temperature=0)  # warm
        first, done = threading.Event(), threading.Event()

        def stream() -> None:  # streams back to back until the huge prompts are done
            while not done.is_set():
                stamps: list[float] = []
                streams.append(stamps)
                for _ in client.stream([5, 6, 7], max_tokens=args.stream_tokens, ignore_eos=True, temperature=0,
                                       timeout=600):
                    stamps.append(time.perf_counter())
                    first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        first.wait(120)
        big = "word " * ((args.mib << 20) // 5)
        for _ in range(args.prompts):
            start = time.perf_counter()
            try:
                client.generate(big, max_tokens=1, timeout=600)
                codes.append("OK")
            except grpc.RpcError as exc:
                codes.append(exc.code().name)
            spans.append((start, time.perf_counter()))
        done.set()
        reader.join()
    on_loop(server.stop(grace=0))
    on_loop(service.shutdown(drain=False))
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)
    t0 = streams[0][0]
    gaps = [(b - t0, b - a) for stamps in streams for a, b in zip(stamps, stamps[1:])]
    values = [g for _, g in gaps]
    return {"case": name, "prompt_chars": len(big), "per_prompt_s": statistics.mean(e - s for s, e in spans),
            "max_gap_s": max(values), "median_gap_s": statistics.median(values), "codes": sorted(set(codes)),
            "tokens": sum(len(s) for s in streams), "gaps": gaps, "spans": [(s - t0, e - t0) for s, e in spans]}


def plot(results: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return
    fig, axes = plt.subplots(len(results), 1, figsize=(8, 2.6 * len(results)), squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        plot_gaps(ax, r, f"{r['case']}: max gap {r['max_gap_s'] * 1e3:.0f} ms (shaded: a huge prompt in flight)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", flush=True)


def plot_gaps(ax, r: dict, title: str) -> None:
    """One case's inter-token gaps over time, the huge prompts' spans shaded (bench/chaos.py too)."""
    for s, e in r["spans"]:
        ax.axvspan(s, e, color="tab:red", alpha=0.12)
    ax.plot([t for t, _ in r["gaps"]], [g * 1e3 for _, g in r["gaps"]], ".", ms=3)
    ax.set_title(title, fontsize=9)
    ax.set_ylabel("inter-token gap, ms")
    ax.set_xlabel("seconds since the stream's first token")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=4, help="huge prompts sent one after the other")
    p.add_argument("--mib", type=int, default=15, help="size of each, MiB of text")
    p.add_argument("--stream-tokens", type=int, default=400, help="tokens of each running stream")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--out", default="bench/results", help="folder for the JSON and the PNG")
    args = p.parse_args()
    results = [run_case("cap", ApiLimits(), args),
               run_case("no-cap", ApiLimits(max_chars_per_token=1 << 30), args)]
    print(f"{args.prompts} prompts of {args.mib} MiB; streams of {args.stream_tokens} tokens; "
          f"max_model_len {args.max_model_len}")
    print("| case | time per huge prompt | max inter-token gap | median gap | refused with |")
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['case']} | {r['per_prompt_s'] * 1e3:.0f} ms | {r['max_gap_s'] * 1e3:.0f} ms | "
              f"{r['median_gap_s'] * 1e3:.0f} ms | {', '.join(r['codes'])} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = [{k: v for k, v in r.items() if k != "gaps"} for r in results]  # every gap is in the PNG
    (out / "prompt_flood.json").write_text(json.dumps({"args": vars(args), "results": summary}, indent=1))
    plot(results, out / "prompt_flood.png")


if __name__ == "__main__":
    main()
