"""The persistent step channel between a replica's driver and its ranks (pyzmq, msgpack).

The driver binds one ROUTER socket; every rank connects a DEALER whose identity is its rank and
says hello. Then, per step, the driver sends the same msgpack StepPlan to every rank and waits
for rank 0's StepOutput (other ranks stay silent unless they fail). Control calls (start, KV
hand-over) go to every rank and every rank answers. No Ray call and no new connection per step:
a step costs one small message per rank and one reply.

Frames: driver -> rank  [identity, kind, seq, payload]
        rank -> driver  [kind, seq, payload]   (the ROUTER prepends the identity)
kind: HELLO, STEP, OUT (rank 0's step result), CALL, RET, ERR, STOP; seq: 8-byte counter so a
late answer to an abandoned request is recognised and dropped. An ERR from any rank fails the
driver's current request (a rank that failed a step has diverged from the others); the same
request's ERRs from the other ranks are dropped afterwards.

While the driver waits it wakes every POLL_MS to ask the launcher whether a rank died, so a dead
actor or process surfaces as WorkerDiedError within a fraction of a second.
"""

from __future__ import annotations

import logging
import struct
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import zmq

from meshserve.cluster.executor import RankError, WorkerDiedError

log = logging.getLogger("meshserve.channel")

HELLO, STEP, OUT, CALL, RET, ERR, STOP = (b"H", b"S", b"O", b"C", b"R", b"E", b"X")
POLL_MS = 100


def rank_identity(rank: int) -> bytes:
    return f"rank-{rank}".encode()


def _seq(n: int) -> bytes:
    return struct.pack("<Q", n)


class DriverChannel:
    """Driver end: broadcast steps and calls to `world` ranks, gather their answers."""

    def __init__(self, world: int, *, host: str = "127.0.0.1", context: zmq.Context | None = None) -> None:
        self.world = world
        self._sock = (context or zmq.Context.instance()).socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a rank that is not connected raises
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._idents = [rank_identity(r) for r in range(world)]
        self._ranks = {ident: r for r, ident in enumerate(self._idents)}
        self._next_seq = 1
        self._reported: set[int] = set()  # requests whose failure was raised already

    def wait_ready(self, check: Callable[[], None], *, timeout_s: float) -> None:
        """Wait for every rank's hello."""
        missing = set(self._idents)
        deadline = time.monotonic() + timeout_s
        while missing:
            ident, kind, _, _ = self._recv(check, deadline)
            if kind == HELLO:
                missing.discard(ident)

    def step(self, plan: bytes, check: Callable[[], None]) -> bytes:
        """Send a msgpack StepPlan to every rank; rank 0's msgpack StepOutput."""
        seq = self._send_all(STEP, [plan] * self.world, check)
        while True:
            ident, kind, rseq, payload = self._recv(check)
            if kind == OUT and rseq == seq:
                return payload

    def call(self, method: str, args: Sequence[dict[str, Any]], check: Callable[[], None]) -> list[Any]:
        """Run an allow-listed method on every rank (args[r] for rank r); results by rank."""
        payloads = [msgpack.packb({"method": method, "args": a}) for a in args]
        seq = self._send_all(CALL, payloads, check)
        results: dict[int, Any] = {}
        while len(results) < self.world:
            ident, kind, rseq, payload = self._recv(check)
            if kind == RET and rseq == seq:
                results[self._ranks[ident]] = msgpack.unpackb(payload)
        return [results[r] for r in range(self.world)]

    def close(self) -> None:
        """Tell every rank to stop (ranks already gone are skipped) and close the socket."""
        for ident in self._idents:
            try:
                self._sock.send_multipart([ident, STOP, _seq(0), b""], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._sock.close(linger=200)  # let the stops leave

    def _send_all(self, kind: bytes, payloads: Sequence[bytes], check: Callable[[], None]) -> int:
        seq = self._next_seq
        self._next_seq += 1
        s = _seq(seq)
        for ident, payload in zip(self._idents, payloads):
            try:
                self._sock.send_multipart([ident, kind, s, payload])
            except zmq.ZMQError as exc:
                check()  # the launcher knows why (exit code, Ray's death cause)
                raise WorkerDiedError(f"{ident.decode()} is not connected to the channel ({exc})") from exc
        return seq

    def _recv(self, check: Callable[[], None], deadline: float | None = None) -> tuple[bytes, bytes, int, bytes]:
        while not self._sock.poll(POLL_MS, zmq.POLLIN):
            check()
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerDiedError("ranks did not connect to the channel in time")
        ident, kind, seq, payload = self._sock.recv_multipart()
        n = struct.unpack("<Q", seq)[0]
        if kind == ERR and n not in self._reported:  # other ranks' errors for the same request: reported
            self._reported.add(n)
            err = msgpack.unpackb(payload)
            log.debug("rank error traceback:\n%s", err.get("traceback", ""))
            raise RankError(f"rank {err['rank']} failed: {err['error']}")
        return ident, kind, n, payload


def serve_rank(host, address: str, *, rank: int, keep_going: Callable[[], bool] | None = None,
               context: zmq.Context | None = None) -> None:
    """Rank end: answer the driver at `address` until it says stop (or keep_going() is False).

    host: a RankHost (execute_step, call, poll_exports, has_pending_exports, shutdown). Between
    messages it serves KV pulls from peers; while an offer is pending it polls every millisecond.
    """
    sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, rank_identity(rank))
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send_multipart([HELLO, _seq(0), b""])
    try:
        while keep_going is None or keep_going():
            if sock.poll(1 if host.has_pending_exports else POLL_MS, zmq.POLLIN):
                kind, seq, payload = sock.recv_multipart()
                if kind == STOP:
                    break
                reply = _handle(host, rank, kind, seq, payload)
                if reply is not None:
                    sock.send_multipart(reply)
            host.poll_exports()
    finally:
        host.shutdown()
        sock.close(linger=0)


def _handle(host, rank: int, kind: bytes, seq: bytes, payload: bytes) -> list[bytes] | None:
    try:
        if kind == STEP:
            out = host.execute_step(payload)
            return [OUT, seq, out] if rank == 0 else None
        if kind == CALL:
            msg = msgpack.unpackb(payload)
            return [RET, seq, msgpack.packb(host.call(msg["method"], msg["args"]))]
        raise ValueError(f"unknown message kind {kind!r}")
    except Exception as exc:  # reported to the driver, which fails the replica
        log.warning("rank %d failed: %r", rank, exc)
        return [ERR, seq, msgpack.packb({"rank": rank, "error": f"{type(exc).__name__}: {exc}",
                                         "traceback": traceback.format_exc()})]
