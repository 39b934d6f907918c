"""Gemma2 and GPT-OSS on CUDA through the backend the registry picks, against the TORCH
reference and HF transformers; skipped without CUDA.

Head size 64 so that FlashInfer's kernels apply. Gemma2/3 (soft-caps, alternating windows) run
on FLASHINFER when it is installed; GPT-OSS's learned sinks are refused by FLASHINFER, so it
runs on TRITON. bf16 runs are compared with the TORCH backend in bf16 (rounding may split a
late near-tie, so the first token of every prompt must agree and most of the rest); float32
TRITON runs must equal HF's greedy tokens exactly.
"""

import importlib.util

import pytest
import torch

from meshserve import LLM, SamplingParams
from tests.tiny_models import HYBRID_ARCHS, hf_greedy, prompts, write_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_gpu")
    out = {}
    for name in HYBRID_ARCHS:
        hf = write_checkpoint(root / name, name, overrides={"head_dim": 64})
        out[name] = (root / name, prompts(6, seed=5, min_len=12, max_len=60), hf)
    return out


def _llm(path, backend=None, dtype="bfloat16"):
    return LLM(path, attention_backend=backend, dtype=dtype, device="cuda", block_size=16, num_kv_blocks=64,
               max_model_len=128, progress=False)


def _expected_backend(arch: str) -> str:
    if arch.startswith("gemma") and importlib.util.find_spec("flashinfer") is not None:
        return "FLASHINFER"
    return "TRITON"  # GPT-OSS: FLASHINFER has no learned sinks


@pytest.mark.parametrize("arch", list(HYBRID_ARCHS))
def test_registry_backend_matches_torch_reference_in_bf16(cases, arch):
    path, batch, _ = cases[arch]
    fast = _llm(path)
    assert fast.core.info.backend == _expected_backend(arch)
    got = [o.token_ids for o in fast.generate(batch, GREEDY)]
    want = [o.token_ids for o in _llm(path, "TORCH").generate(batch, GREEDY)]
    assert [g[0] for g in got] == [w[0] for w in want]
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    assert same >= 0.75 * NEW_TOKENS * len(batch), (got, want)


@pytest.mark.parametrize("arch", list(HYBRID_ARCHS))
def test_triton_float32_equals_hf_greedy(cases, arch):
    path, batch, hf = cases[arch]
    llm = _llm(path, "TRITON", dtype="float32")
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    for i, (o, p) in enumerate(zip(outs, batch)):
        ref = hf_greedy(hf, p, NEW_TOKENS)
        assert o.token_ids == ref, f"prompt {i}: {o.token_ids} != HF {ref}"
