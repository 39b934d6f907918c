"""Beam search and n / best_of on CUDA (registry's backend, CUDA graphs and overlap scheduling on),
against HF transformers' beam search run on the CPU in float32; skipped without CUDA.

On the GPU, decode batches of beams replay CUDA graphs (held beams change the batch every step)
and the next step is planned while one runs: the beams' tokens must still be exactly HF's and
every block must come back. n seeded samples must equal the same prompt run alone with seed + i.
"""

from collections import Counter

import pytest
import torch

from meshserve import LLM, BeamSearchParams, SamplingParams
from tests.tiny_models import hf_greedy, prompts, write_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NEW = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """EOS is the token greedy decoding emits most (as in the CPU test): beams end early."""
    root = tmp_path_factory.mktemp("beam_gpu")
    batch = prompts(4, seed=9, min_len=7, max_len=40)
    probe = write_checkpoint(root / "probe", "llama", overrides={"head_dim": 64})
    eos = Counter(t for p in batch for t in hf_greedy(probe, p, NEW, eos=-1)).most_common(1)[0][0]
    hf = write_checkpoint(root / "llama", "llama", overrides={"head_dim": 64, "eos_token_id": eos})  # same weights
    llm = LLM(root / "llama", dtype="float32", device="cuda", block_size=16, num_kv_blocks=128, max_model_len=128,
              progress=False)
    yield llm, hf, batch, eos
    llm.shutdown()


def _hf(hf, prompt, p: BeamSearchParams, eos: int):
    with torch.no_grad():
        r = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                        max_new_tokens=p.max_tokens, num_beams=p.beam_width, do_sample=False,
                        length_penalty=p.length_penalty, early_stopping=p.early_stopping,
                        num_return_sequences=p.beam_width, eos_token_id=eos, pad_token_id=eos,
                        return_dict_in_generate=True, output_scores=True)
    seqs = [s[len(prompt):] for s in r.sequences.tolist()]
    return [s[: s.index(eos) + 1] if eos in s else s for s in seqs], r.sequences_scores.tolist()


@pytest.mark.parametrize("params", [
    BeamSearchParams(beam_width=4, max_tokens=NEW, length_penalty=1.0),
    BeamSearchParams(beam_width=8, max_tokens=NEW, length_penalty=0.5, early_stopping=True),
], ids=["w4", "w8-early"])
def test_beam_search_equals_hf_on_cuda(setup, params):
    llm, hf, batch, eos = setup
    assert llm.core.info.backend != "TORCH"  # a paged GPU backend, with CUDA graphs
    kv = llm.core.kv
    free = kv.num_free_blocks
    outs = llm.beam_search(batch, params)
    assert kv.num_free_blocks == free and kv.num_requests == 0
    kv.check_invariants()
    for prompt, out in zip(batch, outs):
        want, scores = _hf(hf, prompt, params, eos)
        assert [s.token_ids for s in out.sequences] == want
        assert [s.score for s in out.sequences] == pytest.approx(scores, abs=1e-3)


def test_n_samples_equal_independent_requests_on_cuda(setup):
    llm, _, batch, _ = setup
    kv = llm.core.kv
    free = kv.num_free_blocks
    outs = llm.generate(batch, SamplingParams(temperature=0.8, seed=21, max_tokens=NEW, n=4, ignore_eos=True))
    assert kv.num_free_blocks == free
    for prompt, out in zip(batch, outs):
        for i, choice in enumerate(out.outputs):
            alone = llm.generate(prompt, SamplingParams(temperature=0.8, seed=21 + i, max_tokens=NEW,
                                                        ignore_eos=True))[0]
            assert choice.token_ids == alone.token_ids
