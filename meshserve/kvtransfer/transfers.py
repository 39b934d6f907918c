"""A rank's KV imports in flight: one background thread per transfer, so the rank keeps running
steps while a request's KV arrives.

    pulls = BackgroundPulls()
    pulls.start("t1", lambda cancel: {...})   # the work: pull into blocks the driver reserved
    pulls.take_done()                         # {"t1": {"ok": ..., "seconds": ...}} once finished
    pulls.cancel("t1"); pulls.close()         # abort / shutdown: the work sees its cancel event

The work writes only into blocks its driver reserved for it (no running request reads or writes
them), so it needs no lock against the step; on CUDA it copies on its own stream and waits for it
before it returns. Results are msgpack-able maps: {"ok": True, ...} from the work, or {"ok":
False, "reason": KVTransferError.reason or None, "error": text} when it raised.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from meshserve.errors import check
from meshserve.kvtransfer.wire import KVTransferError

log = logging.getLogger("meshserve.rank")

Work = Callable[[threading.Event], dict[str, Any]]


class BackgroundPulls:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, tuple[threading.Thread, threading.Event]] = {}
        self._done: dict[str, dict[str, Any]] = {}

    @property
    def num_running(self) -> int:
        with self._lock:
            return len(self._running)

    def start(self, transfer_id: str, work: Work) -> None:
        with self._lock:
            check(transfer_id not in self._running and transfer_id not in self._done, "transfer_id", transfer_id,
                  "an id not in use by another transfer of this rank")
            cancel = threading.Event()
            thread = threading.Thread(target=self._run, args=(transfer_id, work, cancel), daemon=True,
                                      name=f"meshserve-kv-pull-{transfer_id}")
            self._running[transfer_id] = (thread, cancel)
        thread.start()

    def _run(self, transfer_id: str, work: Work, cancel: threading.Event) -> None:
        start = time.perf_counter()
        try:
            result = dict(work(cancel))
        except KVTransferError as exc:
            result = {"ok": False, "reason": exc.reason, "error": str(exc)}
        except Exception as exc:  # a bug or a device error: the driver recomputes, the log says why
            log.exception("KV pull %s failed", transfer_id)
            result = {"ok": False, "reason": None, "error": f"{type(exc).__name__}: {exc}"}
        result["seconds"] = time.perf_counter() - start
        with self._lock:
            self._running.pop(transfer_id, None)
            self._done[transfer_id] = result

    def take_done(self) -> dict[str, dict[str, Any]]:
        """Results of the transfers that finished since the last call."""
        with self._lock:
            done, self._done = self._done, {}
        return done

    def cancel(self, transfer_id: str) -> None:
        with self._lock:
            entry = self._running.get(transfer_id)
        if entry is not None:
            entry[1].set()

    def close(self, timeout_s: float = 10.0) -> bool:
        """Cancel every transfer and wait for their threads (bounded); False if one is still running."""
        with self._lock:
            running = list(self._running.values())
        for _, cancel in running:
            cancel.set()
        deadline = time.monotonic() + timeout_s
        for thread, _ in running:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread, _ in running)
