"""Streams kept decoding against a `meshserve serve`, from a process of their own.

bench/serve_latency.py --background measures one request's time to first token while other
streams decode beside it. Driven from the bench's own asyncio loop, those streams' tokens keep
that loop busy when the measured request's first token arrives, and the wait to read it is the
bench's, not the server's (a part of the H100's 3-4 ms "client" hop, 2026-12-06; the rest was
the bench attributing other streams' marks to the measured request, exact since: see
serve_latency.attribute). A real client of the measured request has a loop of its own: so the
streams run here, in a child process (they send no request id: none of the trace's marks that
carry the measured request's ids are theirs).

    python -m bench.background_streams --face grpc --address 127.0.0.1:PORT --streams 15 \
        --max-tokens 200 --prompt '"The for statement is used to"'

Each stream sends a greedy request of --max-tokens (EOS ignored) and sends it again when it
ends, until stdin closes. stdout: JSON lines {"step_ms": [...]}, the times between consecutive
tokens of a stream (a step as the streams see it): the first once every stream has two tokens
(they are decoding: the parent waits for it), then every --report-s, the last after stdin
closes. The parent reads them between its measured requests (`BackgroundStreams.drain`), so
nothing it is not asked for wakes its loop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

from bench.served import GreedyGrpc, GreedyOpenAI
from meshserve.api.bench.loadgen import BenchRequest, Sample

READY_TIMEOUT_S = 300.0  # a first token for every stream (a cold CUDA server compiles)


class _Stream:
    """One stream's requests in turn; `take` gives the token gaps not given before."""

    def __init__(self) -> None:
        self.sample: Sample | None = None
        self.upto = 0  # arrivals of self.sample already turned into gaps
        self.pending: list[float] = []  # gaps of requests that ended since the last take

    def start(self, sample: Sample) -> None:
        self.pending += self._gaps()
        self.sample, self.upto = sample, 0

    def _gaps(self) -> list[float]:
        if self.sample is None:
            return []
        a = self.sample.arrivals
        start = max(self.upto, 1)
        gaps = [round(1e3 * (y - x), 3) for x, y in zip(a[start - 1:], a[start:])]
        self.upto = len(a)
        return gaps

    def take(self) -> list[float]:
        gaps, self.pending = self.pending + self._gaps(), []
        return gaps

    def decoding(self) -> bool:
        return self.sample is not None and len(self.sample.arrivals) >= 2


async def _run(face: str, address: str, prompt, streams: int, max_tokens: int, report_s: float) -> None:
    backend = GreedyOpenAI(address, token=None, model="") if face == "http" else GreedyGrpc(
        address, token=None, model="")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def stdin_readable() -> None:
        if not os.read(sys.stdin.fileno(), 4096):  # EOF: the parent is done
            loop.remove_reader(sys.stdin.fileno())
            stop.set()

    loop.add_reader(sys.stdin.fileno(), stdin_readable)
    state = [_Stream() for _ in range(streams)]

    async def keep_decoding(k: int) -> None:
        request = BenchRequest(prompt, max_tokens, seed=1 + k)
        while not stop.is_set():
            sample = Sample(0, max_tokens)
            state[k].start(sample)
            await backend.send(request, sample, 0.0)
            backend.outputs.pop(request.seed, None)  # the greedy clients keep every output: not needed here
            if not sample.arrivals:
                raise RuntimeError(f"background stream {k}: a request came back with no token")

    def report() -> None:
        gaps = [g for s in state for g in s.take()]
        sys.stdout.write(json.dumps({"step_ms": gaps}) + "\n")
        sys.stdout.flush()

    tasks = []
    try:
        backend.model, _, _ = await backend.model_info()
        tasks = [asyncio.ensure_future(keep_decoding(k)) for k in range(streams)]
        while not all(s.decoding() for s in state):
            failed = [t for t in tasks if t.done()]
            if failed:
                failed[0].result()  # raises its error
            await asyncio.sleep(0.02)
        report()
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), report_s)
            except TimeoutError:
                pass
            for t in tasks:
                if t.done():
                    t.result()
            report()
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await backend.close()


class BackgroundStreams:
    """The child process, seen from the bench: started (returns once its streams decode),
    drained between measured requests without blocking, stopped (its last gaps read)."""

    def __init__(self, face: str, address: str, prompt, streams: int, max_tokens: int, report_s: float = 0.5):
        self.args = [sys.executable, "-m", "bench.background_streams", "--face", face, "--address", address,
                     "--streams", str(streams), "--max-tokens", str(max_tokens), "--report-s", str(report_s),
                     "--prompt", json.dumps(prompt)]
        self.proc: subprocess.Popen | None = None
        self._buf = b""  # a line not complete yet
        self._stopping = False

    def __enter__(self) -> BackgroundStreams:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> list[float]:
        """The gaps seen so far (the streams decode when this returns)."""
        # cwd: the checkout this module is in, where `-m bench.background_streams` finds it
        self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     cwd=Path(__file__).resolve().parents[1])
        try:
            gaps, lines = self._read(deadline=time.monotonic() + READY_TIMEOUT_S, lines=1)
            if not lines:
                raise RuntimeError(f"background streams: no report from the child in {READY_TIMEOUT_S:.0f} s")
        except BaseException:
            self.stop()
            raise
        return gaps

    def drain(self) -> list[float]:
        """The gaps reported since the last call; never waits."""
        return self._read(deadline=None)[0]

    def stop(self) -> list[float]:
        """Ends the streams and the child; the gaps it reported last."""
        if self.proc is None or self.proc.stdout.closed:
            return []
        gaps: list[float] = []
        self._stopping = True
        try:
            self.proc.stdin.close()
            gaps = self._read(deadline=time.monotonic() + 30.0)[0]
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        finally:
            self.proc.stdout.close()
        return gaps

    def _read(self, *, deadline: float | None, lines: int | None = None) -> tuple[list[float], int]:
        """(the gaps, the number of lines) from the child: until `lines` lines came, EOF or the
        deadline; with no deadline, those there are now."""
        fd = self.proc.stdout.fileno()
        gaps: list[float] = []
        got = 0
        while lines is None or got < lines:
            wait = 0.0 if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], wait)[0]:
                break  # nothing now (drain) or the deadline passed
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # EOF: the child ended
                self.proc.wait()
                if not self._stopping:
                    raise RuntimeError(f"background streams: the child ended (exit {self.proc.returncode}) "
                                       "while the measured requests ran; its error is above")
                break
            *complete, self._buf = (self._buf + chunk).split(b"\n")
            for line in complete:
                gaps += json.loads(line)["step_ms"]
                got += 1
        return gaps, got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--face", required=True, choices=["http", "grpc"])
    ap.add_argument("--address", required=True, help="http: the base URL; grpc: host:port")
    ap.add_argument("--prompt", required=True, help="JSON: a text or a list of token ids")
    ap.add_argument("--streams", type=int, required=True)
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--report-s", type=float, default=0.5)
    args = ap.parse_args(argv)
    if args.streams < 1:
        ap.error(f"--streams must be >= 1, got {args.streams}")
    asyncio.run(_run(args.face, args.address, json.loads(args.prompt), args.streams, args.max_tokens,
                     args.report_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
