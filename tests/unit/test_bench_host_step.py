"""bench/host_step.py's CPU smoke run (few steps, two batch sizes): the engine's host path runs with
the bench's stand-ins (the bench broke once when the sampler's `draw` gained a keyword), the table
has a row per batch size and the JSON every stage's time."""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_two_batch_sizes_print_a_row_each_and_time_every_stage(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.host_step", "--batch-sizes", "1,4", "--steps", "3",
                           "--warmup", "1", "--prompt", "32", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["1", "4"]
    from bench.host_step import STAGES

    ms = json.loads((tmp_path / "host-step.json").read_text())["ms"]
    for bs in ("1", "4"):
        times = ms[bs]
        assert set(STAGES) | {"total", "device stub"} <= set(times)
        assert all(math.isfinite(times[s]) and times[s] >= 0 for s in STAGES)
        assert times["total"] > 0
    assert (tmp_path / "host-step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
