"""Fair queueing between callers: each request's place in the waiting queue, and per-caller limits.

A caller is whoever the front-end says sent the request (the digest of its bearer token, else
its connection's peer address; see api/callers.py). The schedulers serve waiting requests in
order of `Request.arrival`; here that key is made so that a caller with many sequences in
flight does not push another caller's request behind all of them:

    key = (priority, sequences the caller already had in flight, admission serial)

A caller's k-th concurrent sequence waits behind every other caller's k-th and earlier ones:
a caller with nothing in flight goes ahead of a caller whose thousand sequences are queued
(the least-attained-service flavour of round robin, weighted by sequences rather than
requests, so n = 64 counts 64). `priority` is vLLM's: lower is served first, default 0.
Preemption takes the largest key first, so the heaviest caller's newest work yields first.

The key is packed into one int because `Request.arrival` is an int that migrated and adopted
requests also get from their engine's own counter.

Per-caller limit: a caller may have at most `max_sequences` sequences waiting or running;
beyond it `CallerLimitError` (429 with Retry-After). A caller with nothing in flight is always
let in: the per-request limits (api/convert.py) bound a single request. The anonymous caller ""
(a program embedding the service: `LLM.stream`, tests) is queued the same way but not limited.
"""

from __future__ import annotations

from meshserve.errors import QueueFullError

_PRIORITY_BITS = 32
_LOAD_BITS = 40
_SERIAL_BITS = 40
PRIORITY_RANGE = (-(1 << (_PRIORITY_BITS - 1)), (1 << (_PRIORITY_BITS - 1)) - 1)


class CallerLimitError(QueueFullError):
    """One caller has too many sequences in flight (429 / RESOURCE_EXHAUSTED; retry later)."""

    retry_after_s = 1


def queue_key(*, priority: int, load: int, serial: int) -> int:
    """The packed (priority, load, serial): smaller is served first."""
    low, high = PRIORITY_RANGE
    priority = min(max(priority, low), high) - low
    load = min(load, (1 << _LOAD_BITS) - 1)
    serial &= (1 << _SERIAL_BITS) - 1
    return (priority << (_LOAD_BITS + _SERIAL_BITS)) | (load << _SERIAL_BITS) | serial


class CallerLedger:
    """Sequences in flight per caller (event-loop thread only)."""

    def __init__(self, max_sequences: int) -> None:
        self.max_sequences = max_sequences
        self._load: dict[str, int] = {}

    def load(self, caller: str) -> int:
        return self._load.get(caller, 0)

    def admit(self, caller: str, sequences: int) -> int:
        """Count `sequences` more for `caller`; the load it had before. CallerLimitError beyond the limit."""
        before = self._load.get(caller, 0)
        if caller and before and before + sequences > self.max_sequences:
            raise CallerLimitError(f"this caller already has {before} sequences waiting or running; "
                                   f"{sequences} more would pass max_sequences_per_caller={self.max_sequences} "
                                   f"(retry after {CallerLimitError.retry_after_s} s)")
        self._load[caller] = before + sequences
        return before

    def release(self, caller: str, sequences: int) -> None:
        left = self._load.get(caller, 0) - sequences
        if left > 0:
            self._load[caller] = left
        else:
            self._load.pop(caller, None)

    def busiest(self) -> int:
        """The largest load of any caller (0 when none has anything in flight)."""
        return max(self._load.values(), default=0)

    def __len__(self) -> int:
        return len(self._load)
