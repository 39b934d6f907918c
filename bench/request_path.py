"""Which meshserve files one request crosses, from the gRPC Generate handler to the attention kernel.

Serves the demo model (float32, CPU, TORCH attention unless --backend) over real gRPC on loopback, once as
`meshserve serve` runs it (unified: one in-process replica) and once disaggregated (a prefill
and a decode replica, ranks on threads, KV handed over), and sends one Generate to each. A
profile hook, armed only while that request is served, records in every thread:

- on the path: the meshserve files on the Python call stack wherever the request is handed
  down — the replica taking it (`Replica.submit` / `adopt`), the driver sending a step or a
  hand-over call to its ranks (cluster/executors/channel.py), every call into attention/ (plan
  and forward, down to the kernel), every call into kvtransfer/ (the rank side of a KV
  hand-over and its transports). Each stack runs from its thread's root (the gRPC
  handler's coroutine, a replica's step thread, a rank's loop thread) to the probe.
- touched: every meshserve file any of whose functions ran for the request (helpers included:
  validation, sampling, detokenizing, conversion to protobuf, stats).

    python -m bench.request_path            # prints both tables (docs/architecture.md)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "meshserve") + os.sep
PROBES = (os.path.join(PKG, "attention") + os.sep, os.path.join(PKG, "kvtransfer") + os.sep)
_CLUSTER = os.path.join(PKG, "cluster")
HAND_DOWN = {(os.path.join(_CLUSTER, "replica.py"), "submit"), (os.path.join(_CLUSTER, "replica.py"), "adopt"),
             (os.path.join(_CLUSTER, "executors", "channel.py"), "_send_all")}  # the driver's side of the rank channel
CLIENT = os.path.join(PKG, "api", "client.py")  # the test's client, not the server


class PathRecorder:
    def __init__(self) -> None:
        self.armed = False
        self.on_path: list[str] = []  # first-seen order, root to leaf
        self.touched: set[str] = set()

    def hook(self, frame, event, arg):
        if event != "call" or not self.armed:
            return
        path = frame.f_code.co_filename
        if not path.startswith(PKG) or path == CLIENT:
            return
        self.touched.add(path)
        if path.startswith(PROBES) or (path, frame.f_code.co_name) in HAND_DOWN:
            stack, f = [], frame
            while f is not None:
                p = f.f_code.co_filename
                if p.startswith(PKG) and p != CLIENT and p not in stack:
                    stack.append(p)
                f = f.f_back
            for p in reversed(stack):
                if p not in self.on_path:
                    self.on_path.append(p)

    def install(self) -> None:
        sys.setprofile(self.hook)
        threading.setprofile(self.hook)


def _rel(path: str) -> str:
    return os.path.relpath(path, PKG)


def measure(layout: str, recorder: PathRecorder, backend: str) -> tuple[list[str], list[str]]:
    from meshserve.api.client import InferenceClient
    from meshserve.api.server import ApiServer
    from meshserve.cluster.coordinator import ClusterConfig, Coordinator
    from meshserve.config import AttentionConfig, CacheConfig, ModelConfig, PoolConfig, ServerConfig
    from meshserve.demo_model import DEMO_MODEL_DIR
    from meshserve.engine.engine_config import EngineConfig

    engine = EngineConfig(model=ModelConfig(model=str(DEMO_MODEL_DIR), dtype="float32", max_model_len=256),
                          cache=CacheConfig(block_size=16, num_kv_blocks=64),
                          attention=AttentionConfig(backend=backend))
    if layout == "unified":
        config = ClusterConfig(engine=engine, runtime="in-process", device="cpu")
    else:
        config = ClusterConfig(engine=engine, pools=PoolConfig(mode="disaggregated"), runtime="threads", device="cpu")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(300)  # noqa: E731
    service = run(Coordinator(config).start())
    server = ApiServer(service, ServerConfig(host="127.0.0.1", port=0, metrics_port=0), max_queue=16, metrics=False)
    run(server.start())
    try:
        with InferenceClient(server.address) as client:
            client.generate("Warm up", max_tokens=2, temperature=0)
            recorder.on_path, recorder.touched = [], set()
            recorder.armed = True
            client.generate("The for statement is used to", max_tokens=4, temperature=0, ignore_eos=True)
            recorder.armed = False
    finally:
        run(server.stop(grace=0))
        run(service.shutdown(drain=False))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
    return [_rel(p) for p in recorder.on_path], sorted(_rel(p) for p in recorder.touched)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["unified", "disaggregated"])
    parser.add_argument("--backend", default="TORCH", help="TRITON needs TRITON_INTERPRET=1 on a CPU")
    args = parser.parse_args()
    recorder = PathRecorder()
    recorder.install()
    for layout in args.layouts:
        on_path, touched = measure(layout, recorder, args.backend)
        print(f"\n{layout} ({args.backend}): {len(on_path)} files on the path (root to kernel, first-seen order); "
              f"{len(touched)} touched")
        print("| # | file on the path |\n| --- | --- |")
        for i, p in enumerate(on_path, 1):
            print(f"| {i} | {p} |")
        rest = [p for p in touched if p not in on_path]
        print(f"touched besides ({len(rest)}): {', '.join(rest)}")


if __name__ == "__main__":
    main()
