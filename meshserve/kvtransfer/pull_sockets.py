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
"""

from __future__ import annotations

import threading
import time

import zmq

MAX_ANSWER_PART_BYTES = (256 << 20) + (64 << 10)  # a device-sized frame (rank_io.DEVICE_FRAME_BYTES), a margin
MAX_IDLE_PER_ADDRESS = 8  # idle sockets kept per exporter (concurrent pulls of a burst each hold one)
IDLE_S = 60.0  # an idle socket unused this long is closed


class PullSockets:
    def __init__(self, context: zmq.Context | None = None, *, max_idle: int = MAX_IDLE_PER_ADDRESS,
                 idle_s: float = IDLE_S) -> None:  # fmt: skip
        self.context = context or zmq.Context.instance()
        self.max_idle = max_idle
        self.idle_s = idle_s
        self._idle: dict[str, list[tuple[zmq.Socket, float]]] = {}  # address -> (socket, when given back)
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

    def num_idle(self, address: str) -> int:
        with self._lock:
            return len(self._idle.get(address, ()))

    def close(self) -> None:
        """Close every idle socket (a context is terminated only once its sockets are closed)."""
        with self._lock:
            idle, self._idle = self._idle, {}
        _close([sock for socks in idle.values() for sock, _ in socks])

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
        return [sock for sock, _ in stale]


def _close(socks: list[zmq.Socket]) -> None:
    for sock in socks:
        sock.close(linger=0)
