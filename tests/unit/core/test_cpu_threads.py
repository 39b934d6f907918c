"""core/cpu_threads.py: a CPU engine runs torch at meshserve's default thread count unless the
user chose one (OMP_NUM_THREADS, or torch.set_num_threads before the model starts).

Each case is a fresh Python process (torch's thread count is process state, and the test
session's own conftest pins it), read back with torch.get_num_threads() there, also from a thread
started afterwards (serve steps in worker threads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from meshserve.core.cpu_threads import default_threads, torch_default_threads, usable_cores

ROOT = Path(__file__).resolve().parents[3]

READ_BACK = """
import json, threading, torch
seen = {}
t = threading.Thread(target=lambda: seen.update(thread=torch.get_num_threads()))
t.start(); t.join()
print(json.dumps({"main": torch.get_num_threads(), **seen}))
"""


def threads_after(setup: str, *, env: dict[str, str] | None = None) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    clean.update(env or {}, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", setup + READ_BACK], env=clean, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_an_llm_on_cpu_takes_the_documented_default():
    got = threads_after("from meshserve import LLM\nLLM(device='cpu', progress=False, max_model_len=64)\n")
    want = default_threads(usable_cores())
    assert got == {"main": want, "thread": want}


def test_omp_num_threads_wins():
    n = torch_default_threads()  # every core: not meshserve's default where there are two or more
    got = threads_after("from meshserve.core.cpu_threads import apply_cpu_threads\n"
                        "assert apply_cpu_threads().source == 'OMP_NUM_THREADS'\n", env={"OMP_NUM_THREADS": str(n)})
    assert got == {"main": n, "thread": n}


def test_a_torch_set_num_threads_call_wins():
    n = torch_default_threads() + 1  # anything but torch's own default reads as the user's choice
    got = threads_after(f"import torch\ntorch.set_num_threads({n})\n"
                        "from meshserve.core.cpu_threads import apply_cpu_threads\n"
                        "assert apply_cpu_threads().source == 'torch.set_num_threads'\n")
    assert got == {"main": n, "thread": n}


def test_default_leaves_a_core_to_python():
    assert [default_threads(c) for c in (1, 2, 3, 8, 64)] == [1, 1, 2, 7, 63]
    assert [default_threads(8, r) for r in (1, 2, 4, 8, 16)] == [7, 3, 1, 1, 1]
