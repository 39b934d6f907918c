"""A wake-up that one thread rings and another waits for in select() or a zmq.Poller, next to sockets.

    bell = Doorbell()
    bell.ring()                       # any thread; cheap, never blocks; rings pile up into one
    zmq.Poller().register(bell, zmq.POLLIN)   # or select.select([bell], ...): readable once rung
    bell.is_rung()                    # a look without waiting
    bell.clear()                      # the waiter, after it woke: readable no more until the next ring
    bell.close()

A threading.Event cannot sit in the same wait as a socket; this can, so a thread blocked on its
sockets (a rank's step channel, a replica's driver waiting for its ranks) also wakes when a pull
thread finishes or its owner has news. A connected pair of local stream sockets: a ring writes a
byte (a full buffer means it is rung already), a clear reads them all.
"""

from __future__ import annotations

import select
import socket


class Doorbell:
    def __init__(self) -> None:
        self._read, self._write = socket.socketpair()
        self._read.setblocking(False)
        self._write.setblocking(False)

    def fileno(self) -> int:
        return self._read.fileno()

    def ring(self) -> None:
        try:
            self._write.send(b"\0")
        except (BlockingIOError, OSError):  # full: rung already; closed: nobody waits any more
            pass

    def is_rung(self) -> bool:
        """Rung and not cleared since (a look that never blocks)."""
        return bool(select.select([self._read], [], [], 0)[0])

    def clear(self) -> None:
        try:
            while self._read.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        self._read.close()
        self._write.close()
