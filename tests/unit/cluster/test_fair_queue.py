"""The fair queue's key and the per-caller ledger (cluster/fair_queue.py), and the Ray reaper's
sweep (cluster/ray_reaper.py) on plain processes standing in for Ray's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
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


_DRIVER = textwrap.dedent("""
    import subprocess, sys, time
    from meshserve.cluster.ray_reaper import RayReaper
    before = RayReaper.children()
    # stand-ins for Ray's gcs_server and raylet, one with a child of its own (a worker)
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    spawner = [sys.executable, "-c", "import subprocess, sys, time; "
               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"]
    procs = [subprocess.Popen(sleeper, start_new_session=True), subprocess.Popen(spawner, start_new_session=True)]
    time.sleep(0.5)
    RayReaper.start(existing=before)
    print(" ".join(str(p.pid) for p in procs), flush=True)
    time.sleep(600)
""")


def test_the_reaper_ends_every_process_it_watches_when_the_server_is_sigkilled():
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        watched = [psutil.Process(p) for p in pids]
        watched += [c for p in watched for c in p.children(recursive=True)]
        assert len(watched) == 3
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(10)
        started = time.monotonic()
        gone, alive = psutil.wait_procs(watched, timeout=30)  # a hang guard; they end within GRACE_S
        assert not alive, alive
        assert time.monotonic() - started < 30
    finally:
        if driver.poll() is None:
            driver.kill()
