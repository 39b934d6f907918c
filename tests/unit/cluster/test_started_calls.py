"""A call sent without waiting (channel.py call_start / call_finish).

A real step channel (driver and rank loops on threads, zmq, MACs) around rank hosts that echo
steps and answer calls in order: the answers of a started call survive the step read after it,
a step sent after it runs after it on every rank, and a rank's failure of a started call fails
that call at call_finish, not the step the driver was reading.
"""

import pytest

from meshserve.cluster.executors.executor import RankError
from tests.unit.cluster.channel_ranks import WAIT_S, no_dead_rank, ranks_on_threads


class _OrderedHost:
    """Echoes steps; `offer` answers its argument (or raises when asked to); logs what ran, in order."""

    has_pending_exports = False
    pulls_done = None
    secret = None

    def __init__(self, log: list) -> None:
        self.log = log

    def execute_step(self, plan: bytes) -> bytes:
        self.log.append(("step", plan))
        return plan

    def call(self, method, args):
        self.log.append((method, args["n"]))
        if args.get("fail"):
            raise RuntimeError("injected: cannot offer")
        return args["n"] * 10

    def poll_exports(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


@pytest.fixture
def channel():
    logs = [[], []]
    with ranks_on_threads([_OrderedHost(log) for log in logs]) as driver:
        yield driver, logs


def test_a_started_calls_answers_outlive_the_step_read_after_it(channel):
    driver, logs = channel
    seq = driver.call_start("offer", [{"n": 1}, {"n": 2}], no_dead_rank)
    assert driver.step(b"plan-1", no_dead_rank, timeout_s=WAIT_S) == b"plan-1"  # the step's read meets the answers
    assert driver.call_finish(seq, no_dead_rank, timeout_s=WAIT_S) == [10, 20]
    assert driver.call("offer", [{"n": 3}, {"n": 4}], no_dead_rank, timeout_s=WAIT_S) == [30, 40]
    # Every rank ran the started call before the step sent after it. (Read once every rank has
    # answered the last call: a step returns with rank 0's answer, the others may still be in it.)
    assert logs == [[("offer", 1), ("step", b"plan-1"), ("offer", 3)],
                    [("offer", 2), ("step", b"plan-1"), ("offer", 4)]]


def test_a_rank_failing_a_started_call_fails_that_call_not_the_step(channel):
    driver, logs = channel
    seq = driver.call_start("offer", [{"n": 1}, {"n": 2, "fail": True}], no_dead_rank)
    assert driver.step(b"plan-1", no_dead_rank, timeout_s=WAIT_S) == b"plan-1"
    with pytest.raises(RankError, match="rank 1 failed: RuntimeError: injected: cannot offer"):
        driver.call_finish(seq, no_dead_rank, timeout_s=WAIT_S)
    # The channel goes on: the next step and call are answered, nothing of the failed call is left.
    assert driver.step(b"plan-2", no_dead_rank, timeout_s=WAIT_S) == b"plan-2"
    assert driver.call("offer", [{"n": 5}, {"n": 6}], no_dead_rank, timeout_s=WAIT_S) == [50, 60]
    assert driver.rejected.count == 0


def test_two_started_calls_finish_in_either_order(channel):
    driver, _ = channel
    first = driver.call_start("offer", [{"n": 1}, {"n": 2}], no_dead_rank)
    second = driver.call_start("offer", [{"n": 3}, {"n": 4}], no_dead_rank)
    assert driver.call_finish(second, no_dead_rank, timeout_s=WAIT_S) == [30, 40]
    assert driver.call_finish(first, no_dead_rank, timeout_s=WAIT_S) == [10, 20]
