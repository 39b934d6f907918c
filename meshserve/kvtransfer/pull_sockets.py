"""Connected zmq DEALER sockets kept for the next pull from the same exporter.

A pull on a fresh socket pays its connection set-up (TCP handshake, ZMTP greeting and READY
exchange, the IO thread's wake-ups) before its request leaves: a fixed cost of every hand-over
that a decode replica receiving a burst pays again for each request. A puller (transport.py)
keeps one `PullSockets`; `pull_kv` takes a socket from it and gives it back only after a pull
that read every message of its answer (so no late message of one pull can reach the next);
a pull that failed, timed out or was cancelled closes its socket. A socket left idle for
IDLE_S is closed at the next take or give-back (an exporter that went away, e.g. a rebuilt
prefill rank on a new port, must not keep sockets reconnecting to it forever).

Sockets are used by one thread at a time (handed over under the lock, which orders the memory
as zmq asks of a socket that changes threads).

Done notices (pull_client.send_done) go by `notify`, on one socket per exporter that carries
nothing else and lingers NOTICE_LINGER_MS when closed; pull sockets linger 0. A notice needs no
answer, so it is sent and forgotten: a puller closed (or dropped) right after queueing one must
not discard it, or the exporter keeps that hand-over's pinned blocks until the offer's TTL. zmq's
own linger is the flush: `zmq_close` returns at once and the I/O thread goes on delivering what is
queued for at most the linger, so closing never waits on a dead exporter (only a context's term
waits, and for the linger at most). Pull sockets keep LINGER 0: what they may hold queued is a
pull request that nobody will read the answer of, and it must not keep reconnecting to a dead
exporter. The notices get their own socket rather than a linger on every socket for that reason:
only what must be delivered lingers.
"""

from __future__ import annotations

import threading
import time

import zmq

MAX_ANSWER_PART_BYTES = (256 << 20) + (64 << 10)  # a device-sized frame (rank_io.DEVICE_FRAME_BYTES), a margin
MAX_IDLE_PER_ADDRESS = 8  # idle sockets kept per exporter (concurrent pulls of a burst each hold one)
IDLE_S = 60.0  # an idle socket unused this long is closed
# How long a closed notice socket still tries to deliver its queued done notices: a notice to a live
# exporter leaves within a millisecond, a first connection (or a reconnect, 100 ms apart) within a
# few hundred; beyond that the exporter is taken for gone and lets go at the offer's TTL anyway.
NOTICE_LINGER_MS = 2000


class PullSockets:
    def __init__(self, context: zmq.Context | None = None, *, max_idle: int = MAX_IDLE_PER_ADDRESS,
                 idle_s: float = IDLE_S) -> None:  # fmt: skip
        self.context = context or zmq.Context.instance()
        self.max_idle = max_idle
        self.idle_s = idle_s
        self._idle: dict[str, list[tuple[zmq.Socket, float]]] = {}  # address -> (socket, when given back)
        self._notices: dict[str, tuple[zmq.Socket, float]] = {}  # address -> (notice socket, when last used)
        self._lock = threading.Lock()
        self.num_created = 0  # sockets made (a reused one is not counted again)

    def take(self, address: str) -> zmq.Socket:
        """A socket connected to `address`: an idle one, or a new one."""
        with self._lock:
            stale = self._prune(time.monotonic())
            idle = self._idle.get(address)
            sock = idle.pop()[0] if idle else None
            if sock is None:
                self.num_created += 1
        _close(stale)
        if sock is not None:
            return sock
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        # The largest legitimate message part is one export frame (rank_io.DEVICE_FRAME_BYTES).
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_ANSWER_PART_BYTES)
        sock.connect(address)
        return sock

    def give_back(self, address: str, sock: zmq.Socket) -> None:
        """Keep a socket whose pull read its whole answer (beyond max_idle it is closed)."""
        now = time.monotonic()
        with self._lock:
            stale = self._prune(now)
            idle = self._idle.setdefault(address, [])
            if len(idle) < self.max_idle:
                idle.append((sock, now))
            else:
                stale.append(sock)
        _close(stale)

    def notify(self, address: str, parts: list[bytes]) -> bool:
        """Queue a message that gets no answer (a done notice) to `address` on its notice socket,
        which delivers it even when closed right after (NOTICE_LINGER_MS, the module docstring);
        False when it cannot be queued (the exporter has not read a thousand notices: it is gone
        or stuck, and lets go at its offers' TTL)."""
        now = time.monotonic()
        with self._lock:  # held while sending: one notice socket serves every thread of the puller
            stale = self._prune(now)
            sock = self._notices.pop(address, (None, now))[0]
            if sock is None:
                self.num_created += 1
                sock = self.context.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, NOTICE_LINGER_MS)
                sock.connect(address)
            try:
                sock.send_multipart(parts, zmq.NOBLOCK)
            except zmq.Again:
                stale.append(sock)  # a fresh socket next time; its queue was for a peer that does not read
                sent = False
            else:
                self._notices[address] = (sock, now)
                sent = True
        _close(stale)
        return sent

    def num_idle(self, address: str) -> int:
        with self._lock:
            return len(self._idle.get(address, ()))

    def close(self) -> None:
        """Close every idle socket and every notice socket (a context is terminated only once its
        sockets are closed). Returns at once: queued notices leave from zmq's I/O thread, for
        NOTICE_LINGER_MS at most."""
        with self._lock:
            idle, self._idle = self._idle, {}
            notices, self._notices = self._notices, {}
        _close([sock for socks in idle.values() for sock, _ in socks] + [sock for sock, _ in notices.values()])

    def _prune(self, now: float) -> list[zmq.Socket]:
        """Take out the sockets idle longer than idle_s (under the lock; the caller closes them)."""
        stale = []
        for address in list(self._idle):
            keep = []
            for sock, since in self._idle[address]:
                (keep if now - since <= self.idle_s else stale).append((sock, since))
            if keep:
                self._idle[address] = keep
            else:
                del self._idle[address]
        for address, (sock, since) in list(self._notices.items()):
            if now - since > self.idle_s:
                del self._notices[address]
                stale.append((sock, since))
        return [sock for sock, _ in stale]


def _close(socks: list[zmq.Socket]) -> None:
    for sock in socks:
        sock.close()  # each with its own LINGER: 0 for pull sockets, NOTICE_LINGER_MS for notice sockets
