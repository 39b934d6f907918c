"""`meshserve serve --pools disaggregated --gpus-per-rank 0.5` on ONE GPU; skipped without CUDA.

The prefill and the decode replica are Ray actors that each reserve half of the GPU (rank_bundle),
so both are placed on it and see it as their device; their KV budgets are left automatic, so each
is its half of the card (workers/kv_budget.py, gpu_kv_budget) and both fit. Oracle: the unified
server (one in-process replica, the whole GPU) on the same checkpoint, run first: greedy tokens
of every request equal, every hand-over imported by CUDA IPC (auto: the two actors see the same
GPU), none recomputed.
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"), pytest.mark.timeout(600)]
pytest.importorskip("ray", reason="the disaggregated pools are Ray actors (the GPU machine's image has no Ray)")

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 12


def _serve(args: list[str], log: Path):
    """A `meshserve serve` process (stderr to `log`) and its gRPC address once it serves."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)  # keep a wheel dir set before
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path, "MESHSERVE_LOG": "info"}
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "meshserve.cli", "serve", *args], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=err, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)  # stdout closed: the server exited

    threading.Thread(target=read, daemon=True).start()
    try:
        first = lines.get(timeout=300)
    except queue.Empty:
        first = None
    if first is None:
        proc.kill()
        pytest.fail(f"the server did not start: {log.read_text()[-3000:]}")
    match = re.match(r"meshserve: serving (\S+) on (\S+),", first)
    assert match, first + log.read_text()[-3000:]
    return proc, match[2]


def _stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _generate_all(address: str, requests: list[list[int]]) -> list[list[int]]:
    from meshserve.api.client import InferenceClient

    with InferenceClient(address) as client:  # one at a time: the same batch shapes on both servers
        return [list(client.generate(p, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids)
                for p in requests]


def _metric(url: str, name: str, label: str) -> dict[str, float]:
    """Value of `label` -> the sum of the samples of `name` (over its other labels: pool, replica)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=30).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_disaggregated_on_one_gpu_with_half_gpu_ranks_matches_unified(tmp_path):
    from tests.tiny_models import prompts, write_checkpoint

    write_checkpoint(tmp_path / "llama", "llama", seed=4)
    requests = prompts(4, seed=31, min_len=5, max_len=90)
    # an automatic KV budget (of 10% of what each rank may take, to stay small): no --kv-cache-memory-bytes
    common = [str(tmp_path / "llama"), "--device", "cuda", "--dtype", "float32", "--enforce-eager",
              "--max-model-len", "256", "--no-enable-prefix-caching", "--grpc-port", "0",
              "--gpu-memory-utilization", "0.1"]

    port = _free_port()
    proc, address = _serve([*common, "--port", str(port)], tmp_path / "unified.log")
    try:
        unified = _generate_all(address, requests)
    finally:
        _stop(proc)

    port = _free_port()
    proc, address = _serve([*common, "--port", str(port), "--pools", "disaggregated", "--gpus-per-rank", "0.5",
                            "--placement-timeout", "120"], tmp_path / "disaggregated.log")
    try:
        split = _generate_all(address, requests)
        imports = _metric(f"http://127.0.0.1:{port}/metrics", "meshserve_kv_imports_total", "transport")
        recomputes = _metric(f"http://127.0.0.1:{port}/metrics", "meshserve_kv_recomputes_total", "reason")
    finally:
        _stop(proc)
    log = (tmp_path / "disaggregated.log").read_text()
    assert split == unified, log[-3000:]
    assert all(len(t) == MAX_TOKENS for t in unified)
    assert {k: v for k, v in imports.items() if v} == {"cuda_ipc": len(requests)}, (imports, log[-3000:])
    assert sum(recomputes.values()) == 0, recomputes
    # each half-GPU replica's automatic KV budget is its half of the card (the tiny weights aside): half
    # the whole-GPU replica's, the same for both whichever loaded first
    blocks = _kv_blocks(log)
    (whole,) = _kv_blocks((tmp_path / "unified.log").read_text()).values()
    assert set(blocks) == {"prefill-0", "decode-0"}, log[-3000:]
    assert all(0.45 * whole < n < 0.55 * whole for n in blocks.values()), (blocks, whole)


def _kv_blocks(log: str) -> dict[str, int]:
    """replica name -> its KV blocks, from the replicas' "ready" log lines."""
    return {m[1]: int(m[2]) for m in re.finditer(r"replica (\S+) \(\w+\) ready: (\d+) KV blocks", log)}
