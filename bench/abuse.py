"""The abuse suite (issue 40) against a live `meshserve serve`: one table, one PNG.

A server process (the demo model, float32 on CPU, one in-process replica, two bearer tokens:
caller A the abuser, caller B the bystander) on loopback. For each case, caller B keeps a
greedy SSE stream running (the probe) while caller A does the case; measured:

    status         what A got (HTTP status / gRPC code; for drain: how each stream ended)
    refuse s       A's request sent -> its answer
    probe gap s    the probe's longest inter-token gap during the case (its stall)
    rss +MB        the server's RSS growth over the case (peak sampled every 10 ms, minus before)
    leaked blocks  free KV blocks once idle again, against before the case (0: nothing leaked)

Cases: fan-out over the limits (200 prompts x n=64), fan-out within them while B is served
(B's worst latency as refuse s), 10 MiB of 500k prompts, 7M token ids, 300k chat messages, a
20 MiB body with and without Content-Length, lone surrogates, empty prompts, a 100 KB model
name (HTTP and gRPC), gRPC 3M token ids, classic bad inputs, a 200-stream cancel storm, a request
over the KV capacity, per-caller 429; last, SIGTERM with open SSE and gRPC streams (drain).
Faults of ranks and forged internal frames are bench/chaos.py's and tests/unit/cluster's.

    python -m bench.abuse            # about 2 min on 2 cores; bench/results/abuse.json + abuse.png
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import psutil

from bench.report import pyplot
from meshserve.api.client import InferenceClient

TOKEN_A, TOKEN_B = "bench-abuser", "bench-bystander"
ROOT = Path(__file__).resolve().parents[1]


class Server:
    def __init__(self, args: argparse.Namespace) -> None:
        folder = Path(tempfile.mkdtemp(prefix="abuse-"))
        (folder / "tokens").write_text(f"{TOKEN_A}\n{TOKEN_B}\n")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "meshserve.cli", "serve", "--grpc-port", "0", "--metrics-port", "0",
             "--port", "0", "--dtype", "float32", "--max-model-len", "1024",
             "--num-kv-blocks", str(args.kv_blocks),
             "--max-num-seqs", "64", "--auth-token-file", str(folder / "tokens"), "--drain-seconds",
             str(args.drain_seconds)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout], daemon=True).start()
        self.grpc = re.match(r"meshserve: serving \S+ on (\S+),", lines.get(timeout=600))[1]
        self.port = int(re.search(r":(\d+)/v1$", lines.get(timeout=60).strip())[1])
        self.client = InferenceClient(self.grpc, token=TOKEN_A)
        self.ps = psutil.Process(self.proc.pid)
        self.drain_seconds = args.drain_seconds

    def free_blocks(self) -> int:
        return self.client.server_info().stats.num_free_kv_blocks

    def idle_free_blocks(self, timeout: float = 120.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.client.server_info().stats
            if s.num_running == 0 and s.num_waiting == 0:
                return s.num_free_kv_blocks
            time.sleep(0.05)
        return self.client.server_info().stats.num_free_kv_blocks


def post(port: int, body, *, token: str = TOKEN_A, path: str = "/v1/completions", timeout: float = 300):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, data, {"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        response = conn.getresponse()
        payload = response.read()
        return response.status, payload
    except (BrokenPipeError, ConnectionResetError):
        return "reset", b""
    finally:
        conn.close()


def raw_post(port: int, body: bytes, *, chunked: bool = False) -> str:
    """A body sent as fast as the socket takes it; the status line of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN_A}\r\n"
                f"Content-Type: application/json\r\n{framing}\r\n\r\n").encode()
        payload = b"".join(f"{len(body[i:i + 65536]):x}\r\n".encode() + body[i:i + 65536] + b"\r\n"
                           for i in range(0, len(body), 65536)) + b"0\r\n\r\n" if chunked else body
        try:
            sock.sendall(head + payload)
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = sock.recv(4096).decode(errors="replace")
    return reply.split(" ")[1] if reply.startswith("HTTP/") else "no answer"


class Probe:
    """Caller B's SSE stream (greedy, ignore_eos), restarted while the case runs; token arrival times."""

    def __init__(self, port: int) -> None:
        self.port, self.times, self.stop = port, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        while not self.times:
            time.sleep(0.01)

    def _run(self) -> None:
        while not self.stop.is_set():
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
            conn.request("POST", "/v1/completions", json.dumps(
                {"prompt": "Once upon a time", "max_tokens": 600, "ignore_eos": True, "temperature": 0,
                 "stream": True}), {"Authorization": f"Bearer {TOKEN_B}", "Content-Type": "application/json"})
            response = conn.getresponse()
            for line in response:
                if self.stop.is_set():
                    break
                if line.startswith(b"data: {"):
                    self.times.append(time.monotonic())
            conn.close()

    def max_gap(self, start: float, end: float) -> float:
        inside = [t for t in self.times if start <= t <= end + 0.5]
        before = [t for t in self.times if t < start][-1:]
        pts = before + inside
        return max((b - a for a, b in zip(pts, pts[1:])), default=end - start)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)


def measure(server: Server, name: str, action, *, probe: bool = True) -> dict:
    free = server.idle_free_blocks()
    p = Probe(server.port) if probe else None
    rss0 = server.ps.memory_info().rss
    peak, sampling = [rss0], threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            peak.append(server.ps.memory_info().rss)
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.monotonic()
    status = action()
    refuse = time.monotonic() - start
    time.sleep(0.3)
    sampling.set()
    sampler.join()
    gap = p.max_gap(start, start + refuse) if p else float("nan")
    if p:
        p.close()
    leaked = free - server.idle_free_blocks()
    row = {"case": name, "status": str(status), "refuse_s": refuse, "probe_gap_s": gap,
           "rss_mb": (max(peak) - rss0) / 2**20, "leaked_blocks": leaked}
    print(f"  {name:<26} {row['status']:<28} {refuse:8.3f} {gap:8.3f} {row['rss_mb']:8.1f} {leaked:6d}", flush=True)
    return row


def grpc_code(fn) -> str:
    try:
        result = fn()
        if hasattr(result, "__iter__"):
            list(result)
        return "OK"
    except grpc.RpcError as exc:
        return f"{exc.code().name} ({len(exc.details() or '')} chars)"


def cases(server: Server) -> list[tuple[str, object]]:
    port, client = server.port, server.client
    short = json.dumps({"prompt": [f"p{i:05d}" for i in range(500_000)], "max_tokens": 1}).encode()
    ids = ("{\"prompt\": [" + ",".join(["7"] * 7_000_000) + "], \"max_tokens\": 1}").encode()
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}] * 300_000}).encode()

    def http_status(body, **kw):
        return lambda: post(port, body, **kw)[0]

    def fan_out_served() -> str:
        worst, statuses = [0.0], []
        heavy = {"prompt": [f"Count to {i}:" for i in range(64)], "max_tokens": 8, "ignore_eos": True}
        senders = [threading.Thread(target=lambda: statuses.append(post(port, heavy)[0])) for _ in range(4)]
        for s in senders:
            s.start()
        time.sleep(0.5)
        for _ in range(4):
            t = time.monotonic()
            statuses.append(post(port, {"prompt": "Hello", "max_tokens": 4}, token=TOKEN_B)[0])
            worst[0] = max(worst[0], time.monotonic() - t)
        for s in senders:
            s.join()
        return f"{sorted(set(map(str, statuses)))} B worst {worst[0]:.2f}s"

    def cancel_storm() -> str:
        conns = []
        for i in range(200):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            c.request("POST", "/v1/completions", json.dumps({"prompt": f"Story {i}", "max_tokens": 200,
                                                             "stream": True, "ignore_eos": True}),
                      {"Authorization": f"Bearer {TOKEN_A}", "Content-Type": "application/json"})
            conns.append(c)
        for c in conns:
            c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            c.close()
        return "200 opened, closed"

    def per_caller_429() -> str:
        heavy = {"prompt": [f"Go {i}" for i in range(64)], "n": 4, "max_tokens": 16, "ignore_eos": True}
        out: list = []
        senders = [threading.Thread(target=lambda: out.append(post(port, heavy)[0])) for _ in range(3)]
        for s in senders:
            s.start()
            time.sleep(0.3)
        for s in senders:
            s.join()
        return ",".join(map(str, sorted(out)))

    return [
        ("fan-out 200 x n=64", http_status({"prompt": [f"N {i}" for i in range(200)], "n": 64, "max_tokens": 1})),
        ("fan-out within limits", fan_out_served),
        ("per-caller 3 x 256 seqs", per_caller_429),
        ("10 MiB: 500k prompts", lambda: raw_post(port, short + b" " * max(0, (10 << 20) - len(short)))),
        ("14 MB: 7M token ids", lambda: raw_post(port, ids)),
        ("300k chat messages", http_status(chat, path="/v1/chat/completions")),
        ("20 MiB, Content-Length", lambda: raw_post(port, b" " * (20 << 20))),
        ("20 MiB, chunked", lambda: raw_post(port, b" " * (20 << 20), chunked=True)),
        ("lone surrogate", http_status(b'{"prompt": "a\\ud800b", "max_tokens": 2}')),
        ("surrogate in chat", http_status(b'{"messages": [{"role": "user", "content": "\\udc00"}]}',
                                          path="/v1/chat/completions")),
        ("empty prompt", http_status({"prompt": "", "max_tokens": 2})),
        ("100 KB model (HTTP)", lambda: (lambda r: f"{r[0]} ({len(r[1])} bytes)")(
            post(port, {"model": "m" * 100_000, "prompt": "Hi"}))),
        ("100 KB model (gRPC)", lambda: grpc_code(lambda: client.generate("Hi", model="m" * 100_000))),
        ("gRPC 3M token ids", lambda: grpc_code(lambda: client.generate([7] * 3_000_000, max_tokens=1))),
        ("bad: temperature -1", http_status({"prompt": "Hi", "temperature": -1})),
        ("bad: n=0", http_status({"prompt": "Hi", "n": 0})),
        ("bad: not JSON", http_status(b"{\"prompt\": ")),
        ("over KV capacity", http_status({"prompt": "Hi", "n": 64, "max_tokens": 1000})),
        ("cancel storm 200 SSE", cancel_storm),
    ]


def drain(server: Server) -> dict:
    """SIGTERM with an SSE and a gRPC stream open: how each ended, time to exit, processes left."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "Once", "max_tokens": 1000, "ignore_eos": True,
                                                        "stream": True}),
                 {"Authorization": f"Bearer {TOKEN_B}", "Content-Type": "application/json"})
    sse = conn.getresponse()
    stream = server.client.stream("Python", max_tokens=1000, ignore_eos=True)
    next(r for r in stream if r.token_ids)
    children = server.ps.children(recursive=True)
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    grpc_end = grpc_code(lambda: stream)
    grpc_ended = time.monotonic() - start
    events = [x for x in sse.read().decode().splitlines() if x.startswith("data: ")]
    sse_ended = time.monotonic() - start
    sse_end = "error+[DONE]" if len(events) >= 2 and '"error"' in events[-2] and events[-1] == "data: [DONE]" \
        else f"other: {events[-1:]}"
    code = server.proc.wait(120)
    exited = time.monotonic() - start
    _, alive = psutil.wait_procs(children, timeout=5)
    row = {"case": "SIGTERM drain", "status": f"SSE {sse_end}; gRPC {grpc_end.split(' ')[0]}; exit {code}",
           "refuse_s": max(grpc_ended, sse_ended), "probe_gap_s": float("nan"), "rss_mb": float("nan"),
           "leaked_blocks": len(alive), "exit_s": exited}
    print(f"  {'SIGTERM drain':<26} {row['status']:<28} {row['refuse_s']:8.3f} (streams ended; --drain-seconds "
          f"{server.drain_seconds:g}; exit after {exited:.1f} s; processes left: {len(alive)})")
    return row


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 6))
    names = [r["case"] for r in rows]
    a.barh(names, [r["refuse_s"] for r in rows], color="tab:blue")
    a.axvline(0.5, color="tab:red", ls="--", label="0.5 s")
    a.set_xscale("symlog", linthresh=0.01)
    a.set_xlabel("time to answer (s)")
    a.invert_yaxis()
    a.legend()
    b.barh(names, [r["probe_gap_s"] if r["probe_gap_s"] == r["probe_gap_s"] else 0 for r in rows], color="tab:green")
    b.axvline(0.5, color="tab:red", ls="--")
    b.set_xlabel("bystander stream's longest inter-token gap (s)")
    b.invert_yaxis()
    b.set_yticklabels([])
    fig.suptitle("meshserve abuse suite (demo model, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-blocks", type=int, default=512)
    parser.add_argument("--drain-seconds", type=float, default=2.0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    server = Server(args)
    print(f"  {'case':<26} {'status':<28} {'refuse s':>8} {'probe gap':>8} {'rss +MB':>8} {'leaked':>6}")
    rows = []
    try:
        for name, action in cases(server):
            rows.append(measure(server, name, action))
        rows.append(drain(server))
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "abuse.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out / "abuse.png")


if __name__ == "__main__":
    main()
