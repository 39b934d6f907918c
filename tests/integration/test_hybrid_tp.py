"""Gemma2 and GPT-OSS under tensor parallelism (tp=2, and GPT-OSS at tp=2 dcp=2; gloo): the
single-rank greedy tokens and log-probabilities, and HF transformers' greedy tokens.

tp=2 splits the query heads (and GPT-OSS's per-head sink logits), the two K/V heads, the MLP
(GPT-OSS: every expert's intermediate features, gate/up pairs together), the vocabulary of the
tied Gemma2 embedding and LM head. Prompts span many 4-token blocks, beyond the 6-token window.
"""

import json

import pytest

from meshserve.engine.engine_core import EngineCore
from tests.integration.distributed import run_ranks
from tests.integration.test_tensor_parallel import engine_config, generate, rank_main
from tests.tiny_models import hf_greedy, prompts, write_checkpoint

NEW_TOKENS = 12  # test_tensor_parallel.PARAMS: greedy, 12 tokens, ignore_eos, top-3 logprobs


# Gemma3 differs from Gemma2 only in replicated parts. GPT-OSS also at tp=2 dcp=2: each rank
# attends for both ranks' query heads over half the tokens, the sinks counted once in the merge.
@pytest.mark.parametrize(("arch", "dcp"), [("gemma2", 1), ("gpt_oss", 1), ("gpt_oss", 2)])
def test_tp2_matches_single_rank_and_hf(tmp_path, arch, dcp):
    path = tmp_path / arch
    hf = write_checkpoint(path, arch)
    batch = prompts(3, seed=7, min_len=14, max_len=30)
    core = EngineCore(engine_config(path), device="cpu", progress=False)
    try:
        want = generate(core, batch)
    finally:
        core.shutdown()
    for i, (p, w) in enumerate(zip(batch, want)):
        ref = hf_greedy(hf, p, NEW_TOKENS)  # HF stops at EOS; the engine here ignores it
        assert w["tokens"][: len(ref)] == ref, f"prompt {i}: single rank {w['tokens']} != HF {ref}"
    out_file = tmp_path / "out.json"
    run_ranks(rank_main, 2, str(path), dcp, "ag_rs", batch, str(out_file))
    got = json.loads(out_file.read_text())
    for i, (g, w) in enumerate(zip(got, want)):
        assert g["tokens"] == w["tokens"], f"prompt {i}: tp=2 dcp={dcp} {g['tokens']} != single rank {w['tokens']}"
        for step, (a, b) in enumerate(zip(g["logprobs"], w["logprobs"])):
            assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), f"prompt {i} step {step}: logprob {a} vs {b}"
