"""A KV export server polled by a daemon thread for the length of a `with` block (tests only)."""

from __future__ import annotations

import contextlib
import threading


@contextlib.contextmanager
def polled(server, *, timeout_ms: int = 5):
    """Poll `server` (anything with `poll(timeout_ms)`) on a thread until the block ends; the server
    stays open (its owner closes it)."""
    done = threading.Event()

    def loop():
        while not done.is_set():
            server.poll(timeout_ms)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        done.set()
        thread.join(10)
