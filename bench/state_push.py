"""What it costs that every step's BATCH carries the engine's state (health, stats, models).

The engine's process sends each front-end process of `serve` one BATCH of deltas per step
(cluster/service_endpoint.py); the BATCH also carries the state as of those deltas, so that
/metrics and ServerInfo are as fresh as the last step (vLLM's engine core sends its scheduler
stats with each step's outputs likewise). This measures, with C streams decoding on the demo
model (a Coordinator behind a ServiceEndpoint and an EngineClient in one event loop over a real
ipc socket, as the unit tests run them), the CPU time of the event loop's thread (a busy step
thread stretches the wall clock of any Python on the loop by its turns with the GIL):

- engine side, once a step: the snapshot (health + stats + models, encoded and packed);
- engine side, per front-end: what the state adds to packing and signing a BATCH of C deltas;
- front-end side, per step: unpacking and decoding the state;
- the snapshot's encoding with a MoE model's per-expert counters (26 layers x 64 experts, the
  DeepSeek-V2-Lite shape: the largest stats a served model sends);
- frames received per step while the streams run (BATCH, STATE), and the step time.

    python -m bench.state_push --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import msgpack

from meshserve.api.engine_client import EngineClient
from meshserve.api.serve import build_service, configs_of
from meshserve.cli import build_parser
from meshserve.cluster import service_wire as wire
from meshserve.cluster.service_endpoint import ServiceEndpoint
from meshserve.core.outputs import CompletionDelta
from meshserve.core.sampling_params import SamplingParams
from meshserve.core.secret import ClusterSecret
from meshserve.demo_model import DEMO_MODEL_DIR

CHUNK = 200  # calls timed back to back; the loop runs steps between chunks


async def _time_us(fn, chunks: int) -> float:
    """Median over `chunks` of the mean CPU µs per call of CHUNK back-to-back calls: this thread's
    CPU time, not the wall clock, which also counts the step thread's turns with the GIL."""
    means = []
    for _ in range(chunks):
        start = time.thread_time()
        for _ in range(CHUNK):
            fn()
        means.append((time.thread_time() - start) / CHUNK * 1e6)
        await asyncio.sleep(0.01)  # let steps run: the snapshots are of a busy engine
    return statistics.median(means)


async def measure(concurrency: int, chunks: int, window_s: float, *, steps_only: bool = False) -> dict:
    args = build_parser("serve").parse_args(["serve", str(DEMO_MODEL_DIR), "--dtype", "float32"])
    engine, pools, _ = configs_of(args)
    service = build_service(engine, pools, model_name=None, device="cpu", progress=False)
    folder = tempfile.mkdtemp(prefix="meshserve-bench-")
    address = f"ipc://{Path(folder) / 'engine.sock'}"
    key = wire.ChannelKey(ClusterSecret.generate(), secrets.token_bytes(16))
    endpoint = ServiceEndpoint(service, address, key)
    serving = asyncio.create_task(endpoint.run(start=True))
    client = EngineClient(address, key, model_dir=str(DEMO_MODEL_DIR))
    frames = {wire.BATCH: 0, wire.STATE: 0}
    handle = client._handle

    def counting(kind: bytes, payload: bytes) -> None:
        if kind in frames:
            frames[kind] += 1
        handle(kind, payload)

    client._handle = counting
    params = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)

    async def stream(i: int) -> None:
        async for _ in client.generate([5 + i % 100] * 16, params, request_id=f"r{i}"):
            pass

    out: dict = {"concurrency": concurrency}
    tasks: list[asyncio.Task] = []
    try:
        await client.start()
        tasks = [asyncio.create_task(stream(i)) for i in range(concurrency)]
        while client.stats().num_running < concurrency:
            await asyncio.sleep(0.05)
        # steps and frames over a window of plain decoding
        start_tokens, start_frames, start = client.stats().generated_tokens, dict(frames), time.perf_counter()
        await asyncio.sleep(window_s)
        elapsed = time.perf_counter() - start
        steps = (client.stats().generated_tokens - start_tokens) / concurrency
        out["step_ms"] = elapsed / steps * 1e3
        out["batch_frames_per_step"] = (frames[wire.BATCH] - start_frames[wire.BATCH]) / steps
        out["state_frames_per_step"] = (frames[wire.STATE] - start_frames[wire.STATE]) / steps
        out["num_running"] = client.stats().num_running
        if steps_only:
            return out
        # the costs, while the streams keep decoding
        out["engine_snapshot_us"] = await _time_us(endpoint._state, chunks)
        state = endpoint._state()
        delta = CompletionDelta("r", [1234], " word", False, None)
        items = [wire.encode_delta(i, delta) for i in range(concurrency)]
        seq = wire.seq_bytes(1)

        def batch(payload_of) -> None:
            payload = msgpack.packb(payload_of)
            key.sign(wire.TO_FRONTEND, wire.BATCH, seq, payload)

        bare = await _time_us(lambda: batch(items), chunks)
        out["engine_batch_with_state_us"] = await _time_us(lambda: batch([items, state]), chunks) - bare
        out["frontend_take_state_us"] = await _time_us(lambda: client._take_state(state), chunks)
        stats, health, models = service.stats(), service.health(), service.models()
        moe = dataclasses.replace(stats, expert_tokens=[[123_456] * 64 for _ in range(26)])
        out["engine_pack_us"] = await _time_us(lambda: msgpack.packb(wire.encode_state(health, stats, models)), chunks)
        out["engine_pack_moe_us"] = await _time_us(lambda: msgpack.packb(wire.encode_state(health, moe, models)),
                                                   chunks)
        out["state_bytes"] = len(state)
        out["state_bytes_moe"] = len(msgpack.packb(wire.encode_state(health, moe, models)))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        endpoint.stop()
        await serving
        await service.shutdown(drain=False)
        await endpoint.close()
        await client.shutdown(drain=False)
        with contextlib.suppress(OSError):
            Path(folder).rmdir()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=15)
    parser.add_argument("--window-s", type=float, default=3.0)
    parser.add_argument("--steps-only", action="store_true",
                        help="only the step time and frames per step (runs against an older tree too: A/B)")
    parser.add_argument("--out", type=Path, default=None)
    opts = parser.parse_args()
    r = asyncio.run(measure(opts.concurrency, opts.chunks, opts.window_s, steps_only=opts.steps_only))
    if opts.out:
        opts.out.write_text(json.dumps(r, indent=1))
    step_us = r["step_ms"] * 1e3
    print(f"{r['concurrency']} streams decoding ({r['num_running']} running), step {r['step_ms']:.2f} ms; "
          f"frames per step: BATCH {r['batch_frames_per_step']:.2f}, STATE {r['state_frames_per_step']:.2f}")
    if opts.steps_only:
        return
    print("| per step (CPU of the loop's thread) | µs | of one step |")
    print("| --- | ---: | ---: |")
    for name, k in (("engine, once: snapshot (health, stats, models; packed)", "engine_snapshot_us"),
                    ("engine, per front-end: the state in its BATCH (packing, signing)", "engine_batch_with_state_us"),
                    ("front-end: the state unpacked and decoded", "frontend_take_state_us"),
                    ("engine: encoding + packing the state alone", "engine_pack_us"),
                    ("engine: the same with MoE expert counters (26 x 64)", "engine_pack_moe_us")):
        print(f"| {name} | {r[k]:.1f} | {r[k] / step_us:.2%} |")
    print(f"STATE size: {r['state_bytes']} B ({r['state_bytes_moe']} B with the MoE counters)")


if __name__ == "__main__":
    main()
