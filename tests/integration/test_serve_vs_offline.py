"""bench/serve_vs_offline.py compares the same work on every path: a tiny greedy workload through
the bench's offline loop and through a live `meshserve serve` over HTTP/SSE and gRPC gives, for
every request, the tokens `LLM.generate` gives for that prompt (the oracle: the plain offline
API, one call, all prompts at once), and the table, JSON and PNG account for every request."""

from __future__ import annotations

import json
import os

import pytest

from bench import serve_vs_offline as svo
from meshserve.api.bench.loadgen import make_requests
from meshserve.api.llm import LLM
from meshserve.core.sampling_params import SamplingParams
from meshserve.demo_model import DEMO_MODEL_DIR

pytestmark = pytest.mark.timeout(300)
CONCURRENCY = [3]
WORKLOAD = svo.Workload(input_len=10, output_len=6, prompts_per_stream=2, num_warmups=0)
VOCAB = json.loads((DEMO_MODEL_DIR / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def settings():
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the server inherits it: two processes share two cores
    return svo.EngineSettings(model=str(DEMO_MODEL_DIR), device="cpu", dtype="float32", max_num_seqs=4,
                              max_model_len=32, kv_cache_memory_bytes=16 << 20)


def test_every_path_gives_generates_tokens_and_the_report_counts_every_request(settings, tmp_path):
    llm = LLM(settings.model, progress=False, **settings.llm_kwargs())
    try:
        runs = svo.run_all(settings, WORKLOAD, CONCURRENCY, svo.PATHS, vocab_size=VOCAB, log_dir=tmp_path, llm=llm)
        assert sorted((r.path, r.concurrency) for r in runs) == sorted(
            (p, c) for p in svo.PATHS for c in CONCURRENCY)
        for c in CONCURRENCY:
            n = WORKLOAD.spec(c).num_prompts
            prompts = [r.prompt for r in make_requests(WORKLOAD.spec(c), vocab_size=VOCAB, count=n)]
            oracle = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
            want_ids = [o.token_ids for o in oracle]
            want_text = [o.text for o in oracle]
            assert all(len(ids) == 6 for ids in want_ids)
            got = {r.path: r for r in runs if r.concurrency == c}
            assert got["offline"].outputs == want_ids
            assert got["offline"].texts == want_text
            assert got["grpc"].outputs == want_ids
            assert got["http"].outputs == want_text
            for run in got.values():
                s = run.summary
                assert (s["completed"], s["failed"], s["output_tokens"]) == (n, 0, 6 * n), run.path
                assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"]
                assert 0 < s["tpot_ms"]["p50"] <= s["tpot_ms"]["p99"]
                assert run.path == "offline" or svo.same_work(run, got["offline"])
    finally:
        llm.shutdown()
    text = svo.table(runs)
    rows = [line for line in text.splitlines()[2:] if line.startswith("|")]
    assert len(rows) == len(runs)
    assert all(line.rstrip(" |").endswith("yes") for line in rows if "| offline |" not in line)
    svo.plot(runs, tmp_path / "run.png", "test")
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_served_output_that_differs_is_reported_as_different_work():
    offline = svo.PathRun("offline", 2, {"failed": 0}, [[5, 6], [7, 8]], ["a", "b"])
    assert svo.same_work(svo.PathRun("grpc", 2, {"failed": 0}, [[5, 6], [7, 8]]), offline)
    assert not svo.same_work(svo.PathRun("grpc", 2, {"failed": 0}, [[5, 6], [7, 9]]), offline)
    assert not svo.same_work(svo.PathRun("http", 2, {"failed": 0}, ["a", "c"]), offline)
    assert not svo.same_work(svo.PathRun("grpc", 2, {"failed": 1}, [[5, 6], [7, 8]]), offline)
    # how far the differing outputs agree: request 2 parts at its second of two tokens
    assert svo.agreement(svo.PathRun("grpc", 2, {"failed": 0}, [[5, 6], [7, 9]]), offline) == (1, 2, 0.5)
    assert svo.agreement(svo.PathRun("http", 2, {"failed": 0}, ["a", "c"]), offline)[:2] == (1, 2)
