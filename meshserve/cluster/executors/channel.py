"""The persistent step channel between a replica's driver and its ranks (pyzmq, msgpack).

The driver binds one ROUTER socket; every rank connects a DEALER and says hello. Then, per step,
the driver sends the same msgpack StepPlan to every rank and waits for rank 0's StepOutput
(other ranks stay silent unless they fail). Control calls (start, KV hand-over) go to every rank
and every rank answers. No Ray call and no new connection per step: a step costs one small
message per rank and one reply. A call can also be sent and its answers read later
(`call_start`, `call_finish`): the driver goes on meanwhile, a step sent after it runs after it
on every rank, and whichever read meets its answers keeps them (a started call's ERR fails that
call, not the step being read). The prefill replica offers a request's KV this way while its
first token is delivered (cluster/handover.py).

Overlap scheduling (`step_start`, `step_finish`): SUBMIT sends a step whose answer is read later,
so the driver plans step N+1 while the ranks run step N. On SUBMIT N a rank queues N's kernels
(Worker.submit), then collects step N-1 if it is still uncollected and (rank 0) sends OUT(N-1);
a step still uncollected when no message comes is collected as soon as its draw is on the host
(Worker.step_ready, a CUDA event query between 1 ms polls) and its OUT sent unasked. OUTs leave
in step order; a STEP or CALL is handled only after every submitted step before it is collected
(a call such as kv_offer reads KV the step writes). Whichever read meets a submitted step's OUT
or ERR keeps it for `step_finish`, as for started calls.

Frames: driver -> rank  [routing id, kind, seq, payload, tag]
        rank -> driver  [kind, seq, payload, tag]   (the ROUTER prepends the routing id)
kind: HELLO, STEP, SUBMIT, OUT (rank 0's step result), CALL, RET, ERR, STOP, PULLED; seq: 8-byte counter so a
late answer to an abandoned request is recognised and dropped. An ERR from any rank fails the
driver's current request (a rank that failed a step has diverged from the others); the same
request's ERRs from the other ranks are dropped afterwards.

PULLED is the one message a rank sends unasked: the moment a background KV pull finishes (its
`pulls_done` doorbell rings, kvtransfer/transfers.py) the rank loop sends {transfer_id: result}
of every finished pull (seq: the rank's own count of them, so a replayed one is dropped); a pull
that ended while the rank ran a step or call is sent ahead of that answer, so the driver holds it
when the step returns and the request joins the very next step. The
driver keeps them for `take_pulls_done`, whichever read brought them in (a step's, a call's, or
`wait_pulls_done`, which an idle decode replica blocks in until one comes or it is interrupted):
a finished pull reaches the driver with no request and no polling (docs/cluster.md). A rank that
cannot collect its pulls sends an ERR with seq 0 instead, which fails the replica.

Authentication (core/secret.py): tag = HMAC-SHA256 of the cluster secret over (direction, this
channel's random session id, the rank, kind, seq, payload). The session id and the secret reach
the ranks with their start-up config (`ChannelAuth`), so a frame of another channel (or an
earlier one of this replica) does not verify here. Routing ids are zmq's own, not chosen by the
peer: a rank is known by its first authenticated HELLO, and later HELLOs for it are dropped.
Frames that do not verify, from unknown peers, malformed, or replayed (a rank takes only seqs
above the last it took) are dropped and counted (`rejected`), never raised.

While the driver waits it wakes every POLL_MS to ask the launcher whether a rank died, so a dead
actor or process surfaces as WorkerDiedError within a fraction of a second; a step or call given
`timeout_s` that gets no answer in that time raises WorkerHungError (a stopped process or a hung
GPU looks alive to the launcher: the deadline is what catches it).
"""

from __future__ import annotations

import logging
import secrets
import struct
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from meshserve.cluster.executors.executor import RankError, WorkerDiedError, WorkerHungError
from meshserve.core.doorbell import Doorbell
from meshserve.core.secret import ClusterSecret, RejectedFrames

log = logging.getLogger("meshserve.channel")

HELLO, STEP, OUT, CALL, RET, ERR, STOP, PULLED = (b"H", b"S", b"O", b"C", b"R", b"E", b"X", b"P")
SUBMIT = b"U"  # a step answered later (overlap scheduling): the rank collects it at the next message or when done
POLL_MS = 100
STEP_POLL_MS = 1  # a rank's poll while a submitted step runs: how late its OUT may leave once the step is done
# Largest message part each end accepts (zmq.MAXMSGSIZE): zmq drops a peer that announces a bigger
# one before buffering it, so whoever reaches the driver's port cannot make it allocate what it
# sends ahead of the HMAC check. A rank's answer is a step output (tokens, logprobs; prompt
# logprobs of a long prompt run to a few MiB) or a call's result; a plan to a rank carries new
# prompts' token ids (a 128k-token prompt is 0.5 MiB).
MAX_ANSWER_BYTES = 32 << 20
MAX_PLAN_BYTES = 64 << 20
_TO_RANK, _TO_DRIVER = b"step>", b"step<"


def rank_identity(rank: int) -> bytes:
    return f"rank-{rank}".encode()


def _seq(n: int) -> bytes:
    return struct.pack("<Q", n)


@dataclass(frozen=True)
class ChannelAuth:
    """What a rank needs to talk to its driver: the cluster secret and the channel's session id.
    Travels with the rank's start-up config (`to_msgpack`), never over the channel itself."""

    secret: ClusterSecret
    session: bytes

    @classmethod
    def new(cls, secret: ClusterSecret) -> ChannelAuth:
        return cls(secret, secrets.token_bytes(16))

    def to_msgpack(self) -> bytes:
        return msgpack.packb({"key": self.secret.key, "session": self.session})

    @classmethod
    def from_msgpack(cls, data: bytes) -> ChannelAuth:
        d = msgpack.unpackb(data)
        return cls(ClusterSecret(d["key"]), d["session"])

    def sign(self, direction: bytes, rank: bytes, kind: bytes, seq: bytes, payload: bytes) -> bytes:
        return self.secret.sign(direction, self.session, rank, kind, seq, payload)

    def verify(self, tag: bytes, direction: bytes, rank: bytes, kind: bytes, seq: bytes, payload: bytes) -> bool:
        return self.secret.verify(tag, direction, self.session, rank, kind, seq, payload)


class DriverChannel:
    """Driver end: broadcast steps and calls to `world` ranks, gather their answers."""

    def __init__(self, world: int, auth: ChannelAuth, *, host: str = "127.0.0.1",
                 context: zmq.Context | None = None) -> None:  # fmt: skip
        self.world = world
        self.auth = auth
        self._sock = (context or zmq.Context.instance()).socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a rank that is not connected raises
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_ANSWER_BYTES)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._names = [rank_identity(r) for r in range(world)]
        self._routes: dict[int, bytes] = {}  # rank -> zmq routing id, from its authenticated HELLO
        self._ranks: dict[bytes, int] = {}  # routing id -> rank
        self._next_seq = 1
        self._reported: set[int] = set()  # requests whose failure was raised already
        self._pulls_done: list[dict[str, Any]] = [{} for _ in range(world)]  # per rank, from PULLED
        self._pulled_seq = [0] * world  # per rank, the last PULLED taken
        self.num_pulled = 0  # PULLED messages taken (tests, benches)
        self._calls: dict[int, _Answers] = {}  # calls sent and not finished, by seq (call_start)
        self._steps: dict[int, _StepAnswer] = {}  # steps submitted and not finished, by seq (step_start)
        self.rejected = RejectedFrames(f"step channel {self.address}")

    def wait_ready(self, check: Callable[[], None], *, timeout_s: float) -> None:
        """Wait for every rank's hello."""
        deadline = time.monotonic() + timeout_s
        while len(self._routes) < self.world:
            self._recv(check, deadline)

    def step(self, plan: bytes, check: Callable[[], None], *, timeout_s: float | None = None,
             what: str = "step") -> bytes:
        """Send a msgpack StepPlan to every rank; rank 0's msgpack StepOutput. No answer within
        timeout_s: WorkerHungError (any rank may be the hung one: rank 0 waits for the others
        in the step's collectives)."""
        seq = self._send_all(STEP, [plan] * self.world, check)
        hung = _Hung(timeout_s, lambda: f"{what} got no answer from rank 0")
        while True:
            rank, kind, rseq, payload = self._recv(check, hung=hung)
            if kind == OUT and rseq == seq and rank == 0:
                return payload

    def step_start(self, plan: bytes, check: Callable[[], None]) -> int:
        """Send a msgpack StepPlan to every rank to be answered later (SUBMIT) and return at once:
        the step's seq, for `step_finish`. The ranks queue it behind the previous step and answer
        that one meanwhile; whichever read meets this step's OUT (or an ERR) keeps it."""
        seq = self._send_all(SUBMIT, [plan] * self.world, check)
        self._steps[seq] = _StepAnswer()
        return seq

    def step_finish(self, seq: int, check: Callable[[], None], *, timeout_s: float | None = None,
                    what: str = "step") -> bytes:
        """Rank 0's msgpack StepOutput of the step `step_start` sent as `seq`, waiting for it
        (timeout_s counts from now: WorkerHungError). A rank that failed it: RankError."""
        answer = self._steps[seq]
        hung = _Hung(timeout_s, lambda: f"{what} got no answer from rank 0")
        try:
            while answer.payload is None and answer.error is None:
                if self._sock.poll(POLL_MS, zmq.POLLIN):
                    self._read_one()  # keeps the answers to submitted steps and started calls
                else:
                    check()
                    hung.check()
        finally:
            del self._steps[seq]
            if answer.payload is None:  # failed or abandoned: the other ranks' late ERRs are dropped
                self._reported.add(seq)
        if answer.error is not None:
            raise RankError(answer.error)
        return answer.payload

    def call(self, method: str, args: Sequence[dict[str, Any]], check: Callable[[], None], *,
             timeout_s: float | None = None) -> list[Any]:
        """Run an allow-listed method on every rank (args[r] for rank r); results by rank. Not
        every rank answered within timeout_s: WorkerHungError naming the silent ones."""
        return self.call_finish(self.call_start(method, args, check), check, timeout_s=timeout_s)

    def call_start(self, method: str, args: Sequence[dict[str, Any]], check: Callable[[], None]) -> int:
        """Send `call`'s messages and return at once: the call's seq, for `call_finish`. The ranks
        answer in their turn (a step sent after it runs after it on every rank); whichever read
        meets the answers first keeps them for `call_finish`."""
        payloads = [msgpack.packb({"method": method, "args": a}) for a in args]
        seq = self._send_all(CALL, payloads, check)
        self._calls[seq] = _Answers(method)
        return seq

    def call_finish(self, seq: int, check: Callable[[], None], *, timeout_s: float | None = None) -> list[Any]:
        """The results by rank of the call `call_start` sent as `seq`, waiting for them (timeout_s
        counts from now). A rank that failed it: RankError at once (the call is over, the other
        ranks' answers to it are dropped)."""
        answers = self._calls[seq]
        hung = _Hung(timeout_s, lambda: f"call {answers.method!r}: rank(s) "
                     f"{sorted(set(range(self.world)) - answers.ranks)} did not answer")
        try:
            while len(answers.ranks) < self.world and answers.error is None:
                if self._sock.poll(POLL_MS, zmq.POLLIN):
                    self._read_one()  # keeps the answers to started calls (and PULLED); drops the rest
                else:
                    check()
                    hung.check()
        finally:
            del self._calls[seq]
            if len(answers.ranks) < self.world:  # failed or abandoned: the other ranks' late ERRs are dropped
                self._reported.add(seq)
        if answers.error is not None:  # (as soon as one rank failed it, like a step)
            raise RankError(answers.error)
        return [answers.results[r] for r in range(self.world)]

    def take_pulls_done(self) -> list[dict[str, Any]]:
        """Per rank, {transfer_id: result} of the KV pulls it reported finished since the last call
        (PULLED), including those waiting unread on the socket. Never blocks, sends nothing."""
        while self._sock.poll(0, zmq.POLLIN):
            self._read_one()
        out, self._pulls_done = self._pulls_done, [{} for _ in range(self.world)]
        return out

    def wait_pulls_done(self, timeout_s: float, check: Callable[[], None], interrupt: Doorbell | None = None) -> bool:
        """Block until a rank reports a finished KV pull (True; `take_pulls_done` has it), or
        `interrupt` rings, or timeout_s passes (False). Nothing is asked of the ranks: they push
        PULLED as their pulls end. A dead rank raises (check(), every POLL_MS), as does an ERR."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        if interrupt is not None:
            poller.register(interrupt, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while not any(self._pulls_done):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            events = dict(poller.poll(min(POLL_MS, max(1, int(left * 1000)))))
            if interrupt is not None and interrupt.fileno() in events:
                return any(self._pulls_done)
            if self._sock in events:
                self._read_one()
            else:
                check()
        return True

    def close(self) -> None:
        """Tell every rank to stop (ranks already gone are skipped) and close the socket."""
        s = _seq(self._next_seq)
        for rank, route in self._routes.items():
            try:
                self._sock.send_multipart(self._frame(rank, route, STOP, s, b""), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._sock.close(linger=200)  # let the stops leave

    def _frame(self, rank: int, route: bytes, kind: bytes, seq: bytes, payload: bytes) -> list[bytes]:
        return [route, kind, seq, payload, self.auth.sign(_TO_RANK, self._names[rank], kind, seq, payload)]

    def _send_all(self, kind: bytes, payloads: Sequence[bytes], check: Callable[[], None]) -> int:
        seq = self._next_seq
        self._next_seq += 1
        s = _seq(seq)
        for rank, payload in enumerate(payloads):
            try:
                self._sock.send_multipart(self._frame(rank, self._routes[rank], kind, s, payload))
            except (zmq.ZMQError, KeyError) as exc:
                check()  # the launcher knows why (exit code, Ray's death cause)
                raise WorkerDiedError(f"rank {rank} is not connected to the channel ({exc!r})") from exc
        return seq

    def _recv(self, check: Callable[[], None], deadline: float | None = None, *,
              hung: _Hung | None = None) -> tuple[int, bytes, int, bytes]:
        """The next authenticated frame as (rank, kind, seq, payload); others are dropped."""
        while True:
            while not self._sock.poll(POLL_MS, zmq.POLLIN):
                check()
                if deadline is not None and time.monotonic() > deadline:
                    raise WorkerDiedError("ranks did not connect to the channel in time")
                if hung is not None:
                    hung.check()
            frame = self._read_one()
            if frame is not None:
                return frame

    def _read_one(self) -> tuple[int, bytes, int, bytes] | None:
        """Read one message: None when it was dropped or taken here (PULLED); an ERR raises."""
        frame = self._accept(self._sock.recv_multipart())
        if frame is None:
            return None
        rank, kind, n, payload = frame
        answers = self._calls.get(n) if kind in (RET, ERR) else None
        if answers is not None:  # a started call's: kept for call_finish
            answers.take(rank, kind, payload)
            return None
        step = self._steps.get(n) if kind in (OUT, ERR) else None
        if step is not None:  # a submitted step's: kept for step_finish
            step.take(rank, kind, payload)
            return None
        if kind == ERR and n not in self._reported:  # other ranks' errors for the same request: reported
            self._reported.add(n)
            err = msgpack.unpackb(payload)
            log.debug("rank error traceback:\n%s", err.get("traceback", ""))
            raise RankError(f"rank {rank} failed: {err['error']}")
        if kind == PULLED:
            if n <= self._pulled_seq[rank]:
                self.rejected.add(f"replayed PULLED {n} of rank {rank}")
            else:
                self._pulled_seq[rank] = n
                self._pulls_done[rank].update(msgpack.unpackb(payload))
                self.num_pulled += 1
            return None
        return frame

    def _accept(self, parts: list[bytes]) -> tuple[int, bytes, int, bytes] | None:
        """Check one incoming message; None (counted) when it must be dropped."""
        if len(parts) != 5 or len(parts[2]) != 8:
            self.rejected.add("malformed")
            return None
        route, kind, seq, payload, tag = parts
        if kind == HELLO:
            rank = self._names.index(payload) if payload in self._names else -1
            if rank < 0 or not self.auth.verify(tag, _TO_DRIVER, payload, kind, seq, payload):
                self.rejected.add("hello that does not verify")
                return None
            if rank in self._routes or route in self._ranks:
                self.rejected.add(f"second hello for rank {rank}")
                return None
            self._routes[rank], self._ranks[route] = route, rank
            return rank, kind, 0, payload
        rank = self._ranks.get(route)
        if rank is None or not self.auth.verify(tag, _TO_DRIVER, self._names[rank], kind, seq, payload):
            self.rejected.add("unknown peer" if rank is None else "bad tag")
            return None
        return rank, kind, struct.unpack("<Q", seq)[0], payload


class _Answers:
    """The ranks' answers to one call (call_start) as they come in: a result per rank, or the
    first rank's error (the call then fails as a whole)."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.results: dict[int, Any] = {}
        self.ranks: set[int] = set()  # ranks that answered (a result or an error)
        self.error: str | None = None

    def take(self, rank: int, kind: bytes, payload: bytes) -> None:
        if rank in self.ranks:
            return
        self.ranks.add(rank)
        if kind == RET:
            self.results[rank] = msgpack.unpackb(payload)
            return
        err = msgpack.unpackb(payload)
        log.debug("rank error traceback:\n%s", err.get("traceback", ""))
        if self.error is None:
            self.error = f"rank {rank} failed: {err['error']}"


class _StepAnswer:
    """A submitted step's answer as it comes in: rank 0's OUT, or the first rank's error."""

    def __init__(self) -> None:
        self.payload: bytes | None = None
        self.error: str | None = None

    def take(self, rank: int, kind: bytes, payload: bytes) -> None:
        if self.payload is not None or self.error is not None:
            return
        if kind == OUT:
            if rank == 0:
                self.payload = payload
            return
        err = msgpack.unpackb(payload)
        log.debug("rank error traceback:\n%s", err.get("traceback", ""))
        self.error = f"rank {rank} failed: {err['error']}"


class _Hung:
    """The deadline of one step or call: check() raises WorkerHungError once it has passed."""

    def __init__(self, timeout_s: float | None, what: Callable[[], str]) -> None:
        self.start = time.monotonic()
        self.timeout_s = timeout_s
        self.what = what

    def check(self) -> None:
        waited = time.monotonic() - self.start
        if self.timeout_s is not None and waited > self.timeout_s:
            raise WorkerHungError(f"{self.what()} within {self.timeout_s:.1f} s (the step deadline): "
                                  "a rank is hung", waited_s=waited)


def serve_rank(host, address: str, auth: ChannelAuth, *, rank: int, keep_going: Callable[[], bool] | None = None,
               context: zmq.Context | None = None) -> None:  # fmt: skip
    """Rank end: answer the driver at `address` until it says stop (or keep_going() is False).

    host: a RankHost (execute_step, submit_step, collect_step, step_ready, call, poll_exports,
    has_pending_exports, pulls_done, kv_pull_done, shutdown); it gets the cluster secret (its KV
    export server and pulls sign with it). Between messages it serves KV pulls from peers; while an
    offer is pending it polls every millisecond. When the host's `pulls_done` doorbell rings (a
    background KV pull finished) it sends the finished pulls' results to the driver unasked
    (PULLED). A submitted step (SUBMIT) is answered at the next message or as soon as it is done.
    """
    name = rank_identity(rank)
    host.secret = auth.secret
    rejected = RejectedFrames(f"rank {rank} of {address}")
    sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_PLAN_BYTES)
    sock.connect(address)
    seq0 = _seq(0)
    sock.send_multipart([HELLO, seq0, name, auth.sign(_TO_DRIVER, name, HELLO, seq0, name)])
    last_seq = 0
    pulled = _PulledSender(sock, auth, name)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    submitted: list[bytes] = []  # seqs of the steps submitted (SUBMIT) and not collected yet, oldest first

    def send(reply: list[bytes] | None) -> None:
        if pulled.waiting():
            pulled.send(host)  # a pull that ended during the step goes ahead of its answer
        if reply is not None:
            reply.append(auth.sign(_TO_DRIVER, name, *reply))
            sock.send_multipart(reply)

    def collect_submitted() -> None:
        while submitted:
            send(_collect(host, rank, submitted.pop(0)))

    try:
        while keep_going is None or keep_going():
            pulled.watch(host.pulls_done, poller)  # the KV agent (and its doorbell) comes with the worker
            if submitted and host.step_ready():  # no next message came before the step ended: answer it now
                collect_submitted()
            wait_ms = 1 if host.has_pending_exports else (STEP_POLL_MS if submitted else POLL_MS)
            events = dict(poller.poll(wait_ms))
            if pulled.rung(events):  # before a message: a kv_pull_done call may take them anyway
                pulled.send(host)
            if sock in events:
                parts = sock.recv_multipart()
                if len(parts) != 4 or len(parts[1]) != 8 or not auth.verify(parts[3], _TO_RANK, name, *parts[:3]):
                    rejected.add("malformed or bad tag")
                    continue
                kind, seq, payload, _ = parts
                n = struct.unpack("<Q", seq)[0]
                if n <= last_seq:
                    rejected.add(f"replayed seq {n}")
                    continue
                last_seq = n
                if kind == STOP:
                    break
                if kind == SUBMIT:  # queue this step's kernels first, then answer the steps before it
                    failed = _submit(host, rank, seq, payload)
                    collect_submitted()
                    if failed is None:
                        submitted.append(seq)
                    else:
                        send(failed)
                else:  # a step or call runs after every step submitted before it is collected
                    collect_submitted()
                    send(_handle(host, rank, kind, seq, payload))
            host.poll_exports()
    finally:
        host.shutdown()
        sock.close(linger=0)


class _PulledSender:
    """The rank's PULLED messages: which doorbell it waits on, and its own sequence numbers."""

    def __init__(self, sock: zmq.Socket, auth: ChannelAuth, name: bytes) -> None:
        self.sock, self.auth, self.name = sock, auth, name
        self.bell = None
        self.seq = 0
        self.broken = False  # collecting failed once (reported): the doorbell is not waited on again

    def watch(self, bell, poller: zmq.Poller) -> None:
        bell = None if self.broken else bell
        if bell is not self.bell:
            if self.bell is not None:
                poller.unregister(self.bell)
            self.bell = bell
            if bell is not None:
                poller.register(bell, zmq.POLLIN)

    def rung(self, events: dict) -> bool:
        """The poll saw the doorbell ring."""
        return not self.broken and self.bell is not None and self.bell.fileno() in events

    def waiting(self) -> bool:
        """A finished pull waits to be sent (a look that never blocks)."""
        return not self.broken and self.bell is not None and self.bell.is_rung()

    def send(self, host) -> None:
        if self.broken:
            return
        try:
            done = host.kv_pull_done()  # clears the doorbell
        except Exception as exc:  # the driver cannot learn of its pulls any more: it fails the replica
            log.warning("rank %s: collecting finished KV pulls failed: %r", self.name.decode(), exc)
            self.broken = True  # (watch unregisters the doorbell)
            reply = [ERR, _seq(0), msgpack.packb({"error": f"{type(exc).__name__}: {exc}",
                                                  "traceback": traceback.format_exc()})]
        else:
            if not done:  # a kv_pull_done call took them first
                return
            self.seq += 1
            reply = [PULLED, _seq(self.seq), msgpack.packb(done)]
        reply.append(self.auth.sign(_TO_DRIVER, self.name, *reply))
        self.sock.send_multipart(reply)


def _submit(host, rank: int, seq: bytes, payload: bytes) -> list[bytes] | None:
    """Submit a step (SUBMIT); None, or the ERR to send once the steps before it are answered."""
    try:
        host.submit_step(payload)
        return None
    except Exception as exc:
        return _error(rank, seq, exc)


def _collect(host, rank: int, seq: bytes) -> list[bytes] | None:
    """The oldest submitted step's answer: OUT (rank 0), nothing (other ranks), or ERR."""
    try:
        out = host.collect_step()
        return [OUT, seq, out] if rank == 0 else None
    except Exception as exc:
        return _error(rank, seq, exc)


def _error(rank: int, seq: bytes, exc: Exception) -> list[bytes]:
    log.warning("rank %d failed: %r", rank, exc)  # reported to the driver, which fails the replica
    return [ERR, seq, msgpack.packb({"rank": rank, "error": f"{type(exc).__name__}: {exc}",
                                     "traceback": traceback.format_exc()})]


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
        return _error(rank, seq, exc)
