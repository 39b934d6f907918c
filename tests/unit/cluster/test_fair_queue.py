"""The fair queue's key and the per-caller ledger (cluster/fair_queue.py)."""

from __future__ import annotations

import pytest

from meshserve.cluster.fair_queue import PRIORITY_RANGE, CallerLedger, CallerLimitError, queue_key


def test_a_light_caller_goes_ahead_of_a_heavy_callers_backlog():
    ledger = CallerLedger(max_sequences=10_000)
    keys = []
    for serial in range(100):  # caller a queues 100 requests of n=8 first
        keys.append((queue_key(priority=0, load=ledger.admit("a", 8), serial=serial), f"a{serial}"))
    keys.append((queue_key(priority=0, load=ledger.admit("b", 1), serial=100), "b0"))
    order = [name for _, name in sorted(keys)]
    assert order.index("b0") == 1  # only a's first request (load 0, older) is ahead of it
    # within one caller, first come first served
    assert [n for n in order if n.startswith("a")] == [f"a{i}" for i in range(100)]


def test_priority_orders_before_load_and_is_clamped():
    low, high = PRIORITY_RANGE
    urgent = queue_key(priority=-1, load=10**6, serial=5)
    normal = queue_key(priority=0, load=0, serial=0)
    assert urgent < normal < queue_key(priority=1, load=0, serial=0)
    assert queue_key(priority=low - 5, load=0, serial=0) == queue_key(priority=low, load=0, serial=0)
    assert queue_key(priority=high + 5, load=0, serial=0) == queue_key(priority=high, load=0, serial=0)


def test_the_ledger_limits_a_caller_and_forgets_it_when_done():
    ledger = CallerLedger(max_sequences=16)
    assert ledger.admit("a", 100) == 0  # a caller's only request is always let in (per-request limits bound it)
    with pytest.raises(CallerLimitError, match="max_sequences_per_caller=16"):
        ledger.admit("a", 1)
    assert ledger.admit("b", 10) == 0 and ledger.admit("b", 6) == 10
    with pytest.raises(CallerLimitError):
        ledger.admit("b", 1)
    assert ledger.load("b") == 16  # a refusal counts nothing
    assert ledger.admit("", 100) == 0 and ledger.admit("", 100) == 100  # the embedding program: not limited
    ledger.release("a", 100)
    ledger.release("b", 16)
    ledger.release("", 200)
    assert len(ledger) == 0
