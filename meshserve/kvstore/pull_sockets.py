"""Connected zmq DEALER sockets kept for the next pull from the same exporter.

A pull on a fresh socket pays its connection set-up (TCP handshake, ZMTP greeting and READY
exchange, the IO thread's wake-ups) before its request leaves: a fixed cost of every hand-over
that a decode replica receiving a burst pays again for each request. A puller (transport.py)
keeps one `PullSockets`; `pull_kv` takes a socket from it and gives it back only after a pull
that read every message of its answer (so no late message of one pull can reach the next);
a pull that failed, timed out or was cancelled closes its socket.

Sockets are used by one thread at a time (handed over under the lock, which orders the memory
as zmq asks of a socket that changes threads).
"""

from __future__ import annotations

import threading

import zmq

MAX_IDLE_PER_ADDRESS = 8  # idle sockets kept per exporter (concurrent pulls of a burst each hold one)


class PullSockets:
    def __init__(self, context: zmq.Context | None = None, *, max_idle: int = MAX_IDLE_PER_ADDRESS) -> None:
        self.context = context or zmq.Context.instance()
        self.max_idle = max_idle
        self._idle: dict[str, list[zmq.Socket]] = {}
        self._lock = threading.Lock()
        self.num_created = 0  # sockets made (a reused one is not counted again)

    def take(self, address: str) -> zmq.Socket:
        """A socket connected to `address`: an idle one, or a new one."""
        with self._lock:
            idle = self._idle.get(address)
            if idle:
                return idle.pop()
            self.num_created += 1
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(address)
        return sock

    def give_back(self, address: str, sock: zmq.Socket) -> None:
        """Keep a socket whose pull read its whole answer (beyond max_idle it is closed)."""
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if len(idle) < self.max_idle:
                idle.append(sock)
                return
        sock.close(linger=0)

    def num_idle(self, address: str) -> int:
        with self._lock:
            return len(self._idle.get(address, ()))

    def close(self) -> None:
        """Close every idle socket (a context is terminated only once its sockets are closed)."""
        with self._lock:
            idle, self._idle = self._idle, {}
        for socks in idle.values():
            for sock in socks:
                sock.close(linger=0)
