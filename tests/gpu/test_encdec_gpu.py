"""BART (encoder-decoder) on CUDA through the backend the registry picks; skipped without CUDA.

float32: greedy tokens equal HF transformers' own generate (run on the CPU, float32, eager).
bfloat16: the registry's backend against the TORCH reference in bfloat16 on the same GPU (the
first token of every prompt must agree: later ones may part at a rounding near-tie), and no
block stays held afterwards.
"""

import pytest
import torch

from meshserve import LLM, SamplingParams
from tests.encdec_models import bart_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    path = tmp_path_factory.mktemp("bart_gpu")
    _, prompts, want = bart_case(path, (1, 5, 17, 33, 48, 64), max_new_tokens=NEW_TOKENS)
    return path, prompts, want


def _llm(path, dtype, backend=None):
    return LLM(path, attention_backend=backend, dtype=dtype, device="cuda", block_size=16, num_kv_blocks=64,
               progress=False)


def test_float32_on_cuda_equals_hf(bart):
    path, prompts, want = bart
    llm = _llm(path, "float32")
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == want, f"backend {llm.core.info.backend}"
    assert llm.core.kv.pool.num_used_blocks == 0


def test_bfloat16_registry_backend_agrees_with_torch_reference(bart):
    path, prompts, _ = bart
    fast = _llm(path, "bfloat16")
    ref = _llm(path, "bfloat16", backend="TORCH")
    got = [o.token_ids for o in fast.generate(prompts, GREEDY)]
    exp = [o.token_ids for o in ref.generate(prompts, GREEDY)]
    assert [g[0] for g in got] == [e[0] for e in exp], f"backend {fast.core.info.backend}"
    assert all(len(g) >= 1 for g in got)
    assert fast.core.kv.pool.num_used_blocks == 0 and ref.core.kv.pool.num_used_blocks == 0
