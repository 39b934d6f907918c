"""The embedded Ray cluster's watchdog (cluster/executors/ray_reaper.py) against a SIGKILLed stand-in server."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

_DRIVER = textwrap.dedent("""
    import subprocess, sys, time
    from meshserve.cluster.executors.ray_reaper import start_reaper
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    spawner = [sys.executable, "-c", "import subprocess, sys, time; time.sleep(1.0); "
               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"]
    # the server's own child, not Ray's (an application's worker, multiprocessing's resource tracker)
    bystander = subprocess.Popen(sleeper, start_new_session=True)
    # stand-ins for Ray's gcs_server and raylet, one starting a child of its own later (a worker)
    procs = [subprocess.Popen(sleeper, start_new_session=True), subprocess.Popen(spawner, start_new_session=True)]
    start_reaper(p.pid for p in procs)
    time.sleep(2.5)  # the watchdog notes the roots' descendants every WATCH_PERIOD_S
    print(bystander.pid, " ".join(str(p.pid) for p in procs), flush=True)
    time.sleep(600)
""")


def test_the_reaper_ends_every_process_it_watches_when_the_server_is_sigkilled_and_no_other():
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER], stdout=subprocess.PIPE, text=True, env=env)
    bystander = None
    try:
        first, *pids = [int(p) for p in driver.stdout.readline().split()]
        bystander = psutil.Process(first)
        watched = [psutil.Process(p) for p in pids]
        watched += [c for p in watched for c in p.children(recursive=True)]
        assert len(watched) == 3
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(10)
        started = time.monotonic()
        gone, alive = psutil.wait_procs(watched, timeout=30)  # a hang guard; they end within STOP_GRACE_S
        assert not alive, alive
        assert time.monotonic() - started < 30
        assert bystander.is_running() and bystander.status() != psutil.STATUS_ZOMBIE  # not Ray's: left alone
    finally:
        if driver.poll() is None:
            driver.kill()
        if bystander is not None and bystander.is_running():
            bystander.kill()
