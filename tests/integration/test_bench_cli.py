"""`meshserve bench` against a live demo server, over both backends, as CI runs it (few requests).

The oracle is the server's own counters: a run must make exactly the tokens it asked for
(fixed lengths, EOS ignored, warm-up included), and the JSON must account for every request.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from meshserve.api.client import InferenceClient

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    proc = subprocess.Popen([sys.executable, "-m", "meshserve.cli", "serve", "--grpc-port", "0",
                             "--port", str(_free_port()), "--dtype", "float32", "--max-model-len", "256",
                             "--num-kv-blocks", "64"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    first, second = proc.stdout.readline(), proc.stdout.readline()
    grpc_address = re.match(r"meshserve: serving \S+ on (\S+),", first)[1]
    url = re.match(r"meshserve: OpenAI-compatible API on (\S+)/v1$", second.strip())[1]
    with InferenceClient(grpc_address) as client:
        yield {"grpc": grpc_address, "url": url, "client": client}
    proc.terminate()
    assert proc.wait(60) == 0


@pytest.mark.parametrize("backend", ["openai", "grpc"])
def test_bench_runs_and_accounts_for_every_token(server, backend, tmp_path):
    client = server["client"]
    before = client.server_info().stats
    target = ["--base-url", server["url"]] if backend == "openai" else ["--address", server["grpc"]]
    done = subprocess.run([sys.executable, "-m", "meshserve.cli", "bench", "--backend", backend, *target,
                           "--num-prompts", "6", "--input-len", "12", "--output-len", "8", "--max-concurrency", "3",
                           "--num-warmups", "2", "--result-json", str(tmp_path / "run.json"),
                           "--plot", str(tmp_path / "run.png")],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr + done.stdout
    after = client.server_info().stats
    assert after.generated_tokens - before.generated_tokens == (6 + 2) * 8  # warm-up included
    assert after.prompt_tokens - before.prompt_tokens == (6 + 2) * 12
    run = json.loads((tmp_path / "run.json").read_text())
    summary = run["summary"]
    assert (summary["completed"], summary["failed"], summary["output_tokens"], summary["prompt_tokens"]) == (
        6, 0, 48, 72)
    for sample in run["samples"]:
        assert sample["output_tokens"] == 8 and sample["prompt_tokens"] == 12 and not sample["error"]
        assert sample["sent"] <= sample["arrivals"][0] <= sample["arrivals"][-1] <= summary["duration_s"]
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = summary[f"{name}_ms"]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"]
    assert summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p50"]
    assert summary["output_throughput"] == pytest.approx(48 / summary["duration_s"])
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for label in ("TTFT", "TPOT", "ITL", "E2E", "req/s", "output tok/s"):
        assert label in done.stdout


def test_ranged_lengths_and_a_request_rate(server, tmp_path):
    done = subprocess.run([sys.executable, "-m", "meshserve.cli", "bench", "--backend", "openai", "--base-url",
                           server["url"], "--num-prompts", "8", "--input-len", "20", "--output-len", "6",
                           "--range-ratio", "0.5", "--request-rate", "50", "--num-warmups", "0",
                           "--result-json", str(tmp_path / "run.json"), "--no-save"],  # (no PNG in the checkout)
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr + done.stdout
    samples = json.loads((tmp_path / "run.json").read_text())["samples"]
    assert all(10 <= s["prompt_tokens"] <= 30 and 3 <= s["output_tokens"] == s["max_tokens"] <= 9 for s in samples)
    assert len({s["prompt_tokens"] for s in samples}) > 1  # lengths do vary
    sent = sorted(s["sent"] for s in samples)
    assert sent[-1] > sent[0]  # arrivals spread over time, not all at once


def test_bad_settings_are_refused_naming_the_flag():
    done = subprocess.run([sys.executable, "-m", "meshserve.cli", "bench", "--range-ratio", "1.5"], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "range_ratio=1.5 is not allowed: a number in [0, 1)" in done.stderr


def test_defaults_write_json_and_png_beside_the_summary(server, tmp_path):
    done = subprocess.run([sys.executable, "-m", "meshserve.cli", "bench", "--base-url", server["url"],
                           "--num-prompts", "3", "--input-len", "8", "--output-len", "4", "--num-warmups", "0"],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr + done.stdout
    (json_path,) = tmp_path.glob("meshserve-bench-openai-*.json")
    (png_path,) = tmp_path.glob("meshserve-bench-openai-*.png")
    assert json_path.stem == png_path.stem and f"results: {json_path.name}" in done.stdout
    assert json.loads(json_path.read_text())["summary"]["completed"] == 3
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chat_completions_over_a_sharegpt_file(server, tmp_path):
    """Prompts are the conversations' first turns; output lengths the second turns' token counts (by
    the server's tokenizer); a one-turn conversation and a too-short pair are skipped."""
    client = server["client"]
    human = ["Explain what a Python generator is.", "How do I open a file for reading?",
             "What does the with statement do in Python?", "hi"]
    gpt = ["A generator yields values one at a time instead of building a list.",
           "Use open(path) and read from the file object it returns.",
           "It runs the body inside a context manager, which cleans up afterwards.", "hello"]
    data = [{"id": str(i), "conversations": [{"from": "human", "value": h}, {"from": "gpt", "value": g}]}
            for i, (h, g) in enumerate(zip(human, gpt))] + [{"id": "x", "conversations": [{"from": "human",
                                                                                            "value": "alone"}]}]
    (tmp_path / "sharegpt.json").write_text(json.dumps(data))
    before = client.server_info().stats
    done = subprocess.run([sys.executable, "-m", "meshserve.cli", "bench", "--backend", "openai-chat", "--base-url",
                           server["url"], "--dataset", str(tmp_path / "sharegpt.json"), "--num-prompts", "3",
                           "--num-warmups", "0", "--result-json", str(tmp_path / "run.json"), "--no-save"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr + done.stdout
    samples = json.loads((tmp_path / "run.json").read_text())["samples"]
    want = sorted(len(client.tokenize(g)) for g in gpt[:3])
    assert sorted(s["output_tokens"] for s in samples) == sorted(s["max_tokens"] for s in samples) == want
    after = client.server_info().stats
    assert after.generated_tokens - before.generated_tokens == sum(want)
    prompt_tokens = sum(s["prompt_tokens"] for s in samples)  # as the server counted them: template included
    asked = sum(len(client.tokenize(h)) for h in human[:3])
    assert after.prompt_tokens - before.prompt_tokens == prompt_tokens >= asked
