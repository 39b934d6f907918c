"""A real step channel for tests: a DriverChannel and one `serve_rank` loop per host on threads
(zmq, MACs), stopped and joined on exit."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

from meshserve.cluster.executors.channel import ChannelAuth, DriverChannel, serve_rank
from meshserve.core.secret import ClusterSecret

WAIT_S = 60  # bound of every wait; each ends as soon as the awaited thing happens


def no_dead_rank() -> None:
    pass


@contextlib.contextmanager
def ranks_on_threads(hosts: Sequence[object]) -> Iterator[DriverChannel]:
    """The driver of a channel whose rank r is served by hosts[r] on a thread, every rank connected."""
    auth = ChannelAuth.new(ClusterSecret.generate())
    driver = DriverChannel(len(hosts), auth)
    stop = threading.Event()
    ranks = [threading.Thread(target=serve_rank, args=(host, driver.address, auth),
                              kwargs={"rank": r, "keep_going": lambda: not stop.is_set()}, daemon=True)
             for r, host in enumerate(hosts)]
    for t in ranks:
        t.start()
    try:
        driver.wait_ready(no_dead_rank, timeout_s=WAIT_S)
        yield driver
    finally:
        stop.set()
        for t in ranks:
            t.join(WAIT_S)
        driver.close()
