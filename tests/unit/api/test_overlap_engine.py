"""The engine with overlap scheduling against the same engine without it, on a tiny checkpoint.

Every sampling feature whose inputs depend on tokens drawn so far (seeds, penalties, logprobs,
stop strings, EOS) must give the same outputs, with a KV pool small enough to preempt and
prompts sharing a prefix; the static decode path (the CUDA-graph path without capture) too.
"""

import pytest
import torch

from meshserve import LLM, SamplingParams
from meshserve.workers.decode_graphs import DecodeGraphs
from tests.tiny_models import prompts, write_checkpoint

PARAMS = [
    SamplingParams(temperature=0, max_tokens=18, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=15),
    SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3, presence_penalty=0.5),
    SamplingParams(temperature=0, max_tokens=12, logprobs=3),
    SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=14, frequency_penalty=0.4),
    SamplingParams(temperature=0, max_tokens=25),  # stops at EOS when the model draws it
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("overlap") / "llama"
    write_checkpoint(path, "llama", seed=5)
    return path


def _batch(n=12):
    shared = prompts(1, seed=2, min_len=20, max_len=20)[0]
    return [shared + p for p in prompts(12, seed=4, min_len=2, max_len=30)][:n]


def _outputs(llm, *, digits=5, n=12):
    """Per request (the first n of the batch): tokens, finish reason, (token, logprob rounded to
    `digits`) per step; digits=None keeps the float32 logprobs as they are."""
    batch = _batch(n)
    params = [PARAMS[i % len(PARAMS)] for i in range(len(batch))]
    outs = llm.generate(batch, params)
    rnd = (lambda v: v) if digits is None else (lambda v: round(v, digits))
    return [(o.token_ids, o.finish_reason, [(lp.token_id, rnd(lp.logprob)) for lp in (o.logprobs or [])])
            for o in outs]


def _assert_same_draws(got, want, *, logprob_atol):
    """Tokens, finish reasons and logprob tokens equal; logprob values within logprob_atol."""
    assert [(t, f, [i for i, _ in lps]) for t, f, lps in got] == [(t, f, [i for i, _ in lps]) for t, f, lps in want]
    for r, ((_, _, a), (_, _, b)) in enumerate(zip(got, want)):
        diff = max((abs(x - y) for (_, x), (_, y) in zip(a, b)), default=0.0)
        assert diff <= logprob_atol, f"request {r}: logprobs differ by {diff} > {logprob_atol}"


def _llm(ckpt, backend, overlap, num_kv_blocks=16):
    return LLM(ckpt, attention_backend=backend, max_model_len=128, num_kv_blocks=num_kv_blocks,
               max_num_batched_tokens=48, async_scheduling=overlap, progress=False)


def test_overlap_gives_the_outputs_of_the_synchronous_engine(ckpt):
    eager = _llm(ckpt, "TORCH", overlap=False)
    fast = _llm(ckpt, "TORCH", overlap=True)
    assert fast.core.overlap and not eager.core.overlap
    assert _outputs(fast) == _outputs(eager)
    assert fast.core.scheduler.stats.num_preemptions > 0
    assert fast.core.scheduler.stats.num_prefix_hit_tokens > 0
    assert fast.core.kv.num_free_blocks == eager.core.kv.num_free_blocks  # nothing leaked


def test_overlap_through_the_static_decode_path(ckpt):
    """TRITON (interpreter) with the graph runner's static buffers: tokens drawn in the step in
    flight are filled into the static token-id buffer on the device.

    The static path runs each decode step padded to its bucket (1, 2, 4, 8 rows), the eager
    reference at the exact batch; the CPU BLAS (MKL sgemm) picks its kernel by the row count,
    so a row's float32 result differs in the last bits between 3 and 4 rows, 5 and 8 (both
    weight layouts; docs/performance.md). Draws are therefore compared exactly and logprobs to
    1e-5 (the float32 differences seen are <= 2e-6); rounding both to 5 decimals made the test
    fail whenever a value sat on a rounding boundary.

    Half the batch (one request per sampling feature) and a pool of 10 blocks, so that it still
    preempts: the interpreter runs every decode program one by one, and the full batch took a
    minute of the suite."""
    reference = _outputs(_llm(ckpt, "TRITON", overlap=False, num_kv_blocks=10), digits=None, n=len(PARAMS))
    fast = _llm(ckpt, "TRITON", overlap=True, num_kv_blocks=10)
    worker = fast.core.executor.worker
    runner = worker.runner
    runner.decode_graphs = graphs = DecodeGraphs(
        runner.model, backends=runner.backends, kv_caches=runner.kv_caches, layer_groups=runner.layer_groups,
        block_size=worker.info.block_size, max_local_len=worker.info.max_model_len, max_batch=8,
        device=torch.device("cpu"), capture=False)  # fmt: skip
    _assert_same_draws(_outputs(fast, digits=None, n=len(PARAMS)), reference, logprob_atol=1e-5)
    assert graphs.num_steps > 0
    stats = fast.core.scheduler.stats
    assert stats.num_preemptions > 0 and stats.num_prefix_hit_tokens > 0


def test_unset_overlaps_only_where_the_device_runs_steps_asynchronously(ckpt):
    """On a CPU a step's submit computes it whole: overlap would hand a request's first token out
    one step() later (after the next step was computed too). Unset, the CPU engine steps
    synchronously and the first step() returns the first token; asked for, it overlaps."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = _batch(1)[0]
    firsts = {}
    for setting in (None, True):
        llm = LLM(ckpt, attention_backend="TORCH", max_model_len=128, num_kv_blocks=16, async_scheduling=setting,
                  progress=False)
        assert llm.core.overlap is (setting is True)
        assert llm.core.executor.runs_async is False
        llm.core.add(llm.core.make_request(prompt, params))
        calls = []
        while llm.core.has_unfinished():
            calls.append([t for d in llm.core.step() for t in d.token_ids])
        firsts[setting] = next(i for i, tokens in enumerate(calls) if tokens)
        assert [t for tokens in calls for t in tokens] == llm.generate(prompt, params)[0].token_ids
    assert firsts == {None: 0, True: 1}
