"""The embedded Ray cluster, started for real and failing (cluster/executors/ray_executor.py).

`serve --replicas 2` on a machine where Ray's GCS never comes up in time (its port-file wait set
to 0 s, what a loaded machine looks like to Ray): after its retries the server prints one
`meshserve: error:` line naming the cause, no traceback, exits 2, and leaves no Ray process.

A started server that is SIGKILLed leaves no Ray process either (its watchdog, ray_reaper.py):
test_listen_loopback.py kills its `serve --replicas 2 --tp 2` and counts them the same way.

Ray processes are recognised by an environment variable the test gives the process it starts
(children inherit it), so other Ray clusters on the machine do not count.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.marked_processes import MARK, left_running, marked

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def env():
    temp = tempfile.mkdtemp(prefix="msray", dir="/tmp")  # short: Ray's socket paths live under it
    mark = uuid.uuid4().hex
    yield {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "RAY_TMPDIR": temp, MARK: mark}
    for p in marked(mark):  # a failing test must not leave Ray running
        p.kill()
    shutil.rmtree(temp, ignore_errors=True)


def test_a_ray_start_that_times_out_is_one_line_exit_2_and_no_orphan(env):
    env = {**env, "RAY_gcs_server_port_wait_time_s": "0"}
    proc = subprocess.run([sys.executable, "-m", "meshserve.cli", "serve", "--replicas", "2", "--port", "0",
                           "--metrics-port", "0", "--http-port", "0", "--dtype", "float32", "--max-model-len", "128"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("meshserve: error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and "Ray" in errors[0] and "gcs_server_port" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert left_running(env[MARK]) == []

