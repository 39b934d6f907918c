"""A KV puller whose pulls the test holds and releases (kv_transport=GATED): the zmq pull, after
waiting, while `GATE.holding` is set, for `GATE.release`, the pull's cancel event or its timeout.
Ranks on threads share this module with the test, so the events reach them."""

from __future__ import annotations

import threading
import time

from meshserve.kvtransfer.transport import ZmqPuller
from meshserve.kvtransfer.wire import KVTransferError

GATED = "tests.unit.cluster.gated_puller:GatedPuller"


class Gate:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.holding = threading.Event()  # set: pulls wait for `release`
        self.arrived = threading.Event()  # a pull is being held
        self.release = threading.Event()
        self.cancelled = threading.Event()  # a held pull ended by its cancel event
        self.timed_out = threading.Event()  # a held pull ended by its timeout


GATE = Gate()


class GatedPuller(ZmqPuller):
    def pull(self, target, endpoint, capability, *, secret, timeout_s, cancel=None) -> str | None:
        if GATE.holding.is_set():
            GATE.arrived.set()
            deadline = time.monotonic() + timeout_s
            while not GATE.release.wait(0.01):
                if cancel is not None and cancel.is_set():
                    GATE.cancelled.set()
                    raise KVTransferError("cancelled", "the held pull was cancelled")
                if time.monotonic() > deadline:
                    GATE.timed_out.set()
                    raise KVTransferError("timeout", "the held pull timed out")
        super().pull(target, endpoint, capability, secret=secret, timeout_s=timeout_s, cancel=cancel)
        return None  # counted under this puller's configured name
