"""KV hand-over over torch.distributed point-to-point (gloo on CPU) between two processes."""

import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_send_recv_round_trip_and_refusals_over_gloo():
    port = str(_free_port())
    cmd = [sys.executable, "-m", "tests.integration.kv_handover_peer", "dist", "--port", port, "--rank"]
    procs = [subprocess.Popen([*cmd, str(r)], cwd=ROOT, stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    result = json.loads(outs[0].strip().splitlines()[-1])
    assert result == {"ok": True, "checksum": "checksum", "layout": "layout", "leaked": 0}
