"""The start-up warm-up on CUDA, where it is on by default (engine/warmup.py), skipped without CUDA.

Oracle: the same checkpoint and settings with warmup=False. The warmed engine must have run its
three requests through the prefix-cache path (32 cached tokens), freed every block, and give
the same greedy tokens as the engine that never ran it, with the default backend (FLASHINFER
where it is installed, else TRITON) and decode graphs, for a plain Llama and a Gemma-2 (sliding
window + soft-cap: the FlashInfer module the prebuilt set lacked until 2026-12-06).
"""

import pytest
import torch

from meshserve import LLM, SamplingParams
from tests.gpu import FLASHINFER_HEAD_DIM
from tests.tiny_models import prompts, write_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_warmup_runs_by_default_and_changes_no_token(tmp_path, arch):
    path = tmp_path / arch
    write_checkpoint(path, arch, overrides={"head_dim": FLASHINFER_HEAD_DIM})
    batch = prompts(6, seed=5, min_len=8, max_len=60)
    outs, engines = [], []
    for warmup in (None, False):  # None: CUDA's default, on
        llm = LLM(path, dtype="bfloat16", device="cuda", max_model_len=256, num_kv_blocks=128, progress=False,
                  warmup=warmup)
        try:
            core = llm.core
            engines.append(core.warmup)
            assert core.kv.num_free_blocks == core.kv.num_total_blocks
            outs.append([o.token_ids for o in llm.generate(batch, GREEDY)])
        finally:
            llm.shutdown()
    warm, cold = engines
    assert cold is None
    assert warm is not None and warm.requests == 3 and warm.cached_tokens == 32
    assert outs[0] == outs[1]
