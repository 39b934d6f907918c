"""A rank tells its driver unasked when a background KV pull finished (channel.py PULLED).

A real step channel (driver and rank loop, zmq, MACs) around the smallest rank host that has
background pulls (kvtransfer/transfers.py BackgroundPulls): the pulls' results reach the driver
with no request sent, whether it waits for them or is busy with a step; the driver's wait ends
when its doorbell rings; a rank that cannot collect its pulls fails the wait.
"""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from meshserve.cluster.executors.executor import RankError
from meshserve.core.doorbell import Doorbell
from meshserve.kvtransfer.transfers import BackgroundPulls
from tests.unit.cluster.channel_ranks import WAIT_S, no_dead_rank, ranks_on_threads


class _PullingHost:
    """Echoes steps, runs pulls the test starts, records every method the driver asks for."""

    has_pending_exports = False
    secret = None

    def __init__(self) -> None:
        self.pulls = BackgroundPulls()
        self.calls: list[str] = []
        self.broken = False

    @property
    def pulls_done(self) -> Doorbell:
        return self.pulls.done_bell

    def kv_pull_done(self) -> dict:
        if self.broken:
            raise RuntimeError("injected: lost track of its pulls")
        return self.pulls.take_done()

    def execute_step(self, plan: bytes) -> bytes:
        return plan

    def call(self, method, args):
        self.calls.append(method)
        return getattr(self, method)(**args)

    def poll_exports(self) -> None:
        pass

    def shutdown(self) -> None:
        self.pulls.close()


@pytest.fixture
def channel():
    host = _PullingHost()
    with ranks_on_threads([host]) as driver:
        yield driver, host


def finished(result: dict):
    return lambda cancel: result


def test_a_finished_pull_reaches_the_waiting_driver_with_nothing_asked(channel):
    driver, host = channel
    host.pulls.start("t1", finished({"ok": True, "bytes": 7}))
    assert driver.wait_pulls_done(WAIT_S, no_dead_rank)
    (got,) = driver.take_pulls_done()
    assert (got["t1"]["ok"], got["t1"]["bytes"]) == (True, 7)
    assert host.calls == [] and driver.num_pulled == 1
    assert driver.take_pulls_done() == [{}]


def test_a_pull_that_finishes_during_a_step_is_kept_for_the_driver(channel):
    driver, host = channel
    gate = threading.Event()
    host.pulls.start("t2", lambda cancel: {"ok": gate.wait(WAIT_S)})
    gate.set()
    for i in range(3):  # the push may come in while the driver waits for a step's answer
        assert driver.step(b"plan-%d" % i, no_dead_rank) == b"plan-%d" % i
    assert driver.wait_pulls_done(WAIT_S, no_dead_rank)
    assert driver.take_pulls_done()[0]["t2"]["ok"] is True
    assert host.calls == []


def test_the_driver_s_wait_ends_when_its_doorbell_rings_or_its_time_is_up(channel):
    driver, _ = channel
    bell = Doorbell()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(driver.wait_pulls_done, 3600, no_dead_rank, bell)
        bell.ring()
        assert waiting.result(WAIT_S) is False  # rung, no pull finished
    assert driver.wait_pulls_done(0.01, no_dead_rank) is False
    bell.close()


def test_a_rank_that_cannot_collect_its_pulls_fails_the_wait(channel):
    driver, host = channel
    host.broken = True
    host.pulls.start("t3", finished({"ok": True}))
    with pytest.raises(RankError, match="injected"):
        driver.wait_pulls_done(WAIT_S, no_dead_rank)
