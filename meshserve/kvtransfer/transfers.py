"""A rank's KV imports in flight: each on a background thread, so the rank keeps running steps while
a request's KV arrives.

    pulls = BackgroundPulls()
    pulls.start("t1", lambda cancel: {...})   # the work: pull into blocks the driver reserved
    pulls.take_done()                         # {"t1": {"ok": ..., "seconds": ...}} once finished
    pulls.done_bell                           # a Doorbell, rung while finished pulls wait in take_done
    pulls.cancel("t1"); pulls.close()         # abort / shutdown: the work sees its cancel event

The threads are kept for the next pulls (up to MAX_IDLE_WORKERS waiting; a burst's extra ones
end after their pull): starting an OS thread per pull cost ~100 us before its work began, handing
work to a waiting thread ~35 us (the 2-core CPU machine). Every pull still has a thread of its
own while it runs: a pull blocks (on the network, a READ, the device) for up to its timeout.

Whoever collects the results need not ask: `done_bell` is readable from the moment a result
lands until `take_done` takes it, so the rank's channel loop (or an in-process driver) waits on it
beside its sockets and learns at once that a pull finished (cluster/executors/channel.py).

The work writes only into blocks its driver reserved for it (no running request reads or writes
them), so it needs no lock against the step; on CUDA it copies on its own stream and waits for it
before it returns. Results are msgpack-able maps: {"ok": True, ...} from the work, or {"ok":
False, "reason": KVTransferError.reason or None, "error": text} when it raised.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from meshserve.core import hop_trace
from meshserve.core.doorbell import Doorbell
from meshserve.errors import check
from meshserve.kvtransfer.wire import KVTransferError

log = logging.getLogger("meshserve.rank")

Work = Callable[[threading.Event], dict[str, Any]]
MAX_IDLE_WORKERS = 8  # threads kept waiting for the next pull (a decode rank's burst of hand-overs)


class BackgroundPulls:
    def __init__(self, *, max_idle_workers: int = MAX_IDLE_WORKERS) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, tuple[threading.Event, threading.Event]] = {}  # id -> (cancel, ended)
        self._done: dict[str, dict[str, Any]] = {}
        self.done_bell = Doorbell()  # rung while _done holds results (cleared with it, under the lock)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # (id, work, cancel, ended), or None: stop
        self._max_idle = max_idle_workers
        self._idle = 0  # workers counted as waiting on the queue (each start takes one, else makes one)
        self._workers = 0  # workers alive
        self._closed = False

    @property
    def num_running(self) -> int:
        with self._lock:
            return len(self._running)

    def start(self, transfer_id: str, work: Work) -> None:
        with self._lock:
            check(transfer_id not in self._running and transfer_id not in self._done, "transfer_id", transfer_id,
                  "an id not in use by another transfer of this rank")
            cancel, ended = threading.Event(), threading.Event()
            self._running[transfer_id] = (cancel, ended)
            closed = self._closed
            spawn = self._idle == 0
            if spawn:
                self._workers += 1
            else:
                self._idle -= 1
        if closed:  # the queue may hold stops for the threads of before: a thread for this one alone
            threading.Thread(target=self._serve, args=((transfer_id, work, cancel, ended),), daemon=True,
                             name="meshserve-kv-pull").start()
            return
        self._queue.put((transfer_id, work, cancel, ended))
        if spawn:  # no thread waiting: a new one (any waiting thread may take any item: they are alike)
            threading.Thread(target=self._serve, daemon=True, name="meshserve-kv-pull").start()

    def _serve(self, first: tuple | None = None) -> None:
        """A worker: run pulls from the queue (`first` before) until told to stop, or until enough
        others wait."""
        try:
            while True:
                item, first = first or self._queue.get(), None
                if item is None:
                    return
                transfer_id, work, cancel, ended = item
                threading.current_thread().name = f"meshserve-kv-pull-{transfer_id}"
                self._run(transfer_id, work, cancel)
                ended.set()
                with self._lock:
                    if self._closed or self._idle >= self._max_idle:
                        return
                    self._idle += 1
        finally:
            with self._lock:
                self._workers -= 1

    def _run(self, transfer_id: str, work: Work, cancel: threading.Event) -> None:
        hop_trace.mark("rank.pull_begin")
        start = time.perf_counter()
        try:
            result = dict(work(cancel))
        except KVTransferError as exc:
            result = {"ok": False, "reason": exc.reason, "error": str(exc)}
        except Exception as exc:  # a bug or a device error: the driver recomputes, the log says why
            log.exception("KV pull %s failed", transfer_id)
            result = {"ok": False, "reason": None, "error": f"{type(exc).__name__}: {exc}"}
        result["seconds"] = time.perf_counter() - start
        hop_trace.mark("rank.pull_end")
        with self._lock:
            self._running.pop(transfer_id, None)
            self._done[transfer_id] = result
            self.done_bell.ring()

    def take_done(self) -> dict[str, dict[str, Any]]:
        """Results of the transfers that finished since the last call."""
        with self._lock:
            done, self._done = self._done, {}
            self.done_bell.clear()
        return done

    def cancel(self, transfer_id: str) -> None:
        with self._lock:
            entry = self._running.get(transfer_id)
        if entry is not None:
            entry[0].set()

    def close(self, timeout_s: float = 10.0) -> bool:
        """Cancel every transfer and wait for them to end (bounded); stop the waiting threads.
        False if a transfer is still running."""
        with self._lock:
            running = list(self._running.values())
            self._closed = True
            workers, self._idle = self._workers, 0
        for cancel, _ in running:
            cancel.set()
        deadline = time.monotonic() + timeout_s
        for _, ended in running:
            ended.wait(max(0.0, deadline - time.monotonic()))
        for _ in range(workers):  # a stop for every thread (busy ones end after their pull anyway)
            self._queue.put(None)
        self.done_bell.close()  # a pull still running rings it in vain
        return all(ended.is_set() for _, ended in running)
