"""DeepSeek-V2 / V3 (MLA attention, MoE, YaRN) through `meshserve.LLM` equal HF transformers'
own greedy `generate`, token for token, with the TORCH and TRITON MLA backends; also with
chunked prefill, preemption and prefix-cache hits. And the KV pool holds as many tokens as the
latent size says."""

import pytest
import torch

from meshserve import LLM, SamplingParams
from meshserve.attention.mla.layer import MLAAttention
from meshserve.kvstore.cache_tensors import MLACache, block_bytes
from meshserve.workers.checkpoint import read_arch
from tests.deepseek_models import DEEPSEEK, write_deepseek
from tests.tiny_models import hf_greedy, prompts

NEW_TOKENS = 16
BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """variant -> (checkpoint dir, prompts, HF greedy outputs)."""
    root = tmp_path_factory.mktemp("deepseek_hf")
    out = {}
    for name in DEEPSEEK:
        hf = write_deepseek(root / name, name)
        batch = prompts(3, seed=len(name), min_len=9, max_len=40)
        out[name] = (root / name, batch, [hf_greedy(hf, p, NEW_TOKENS) for p in batch])
    return out


def _llm(path, backend="TORCH", **kw):
    kw = {"num_kv_blocks": 64, "max_model_len": 128, **kw}
    return LLM(path, attention_backend=backend, block_size=BLOCK, progress=False, **kw)


def _check(outputs, want):
    for i, (out, ref) in enumerate(zip(outputs, want)):
        assert out.token_ids == ref, f"prompt {i}: meshserve {out.token_ids} != HF {ref}"


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
@pytest.mark.parametrize("name", list(DEEPSEEK))
def test_greedy_matches_hf(cases, name, backend):
    path, batch, want = cases[name]
    n = 3 if backend == "TORCH" else 2  # TRITON runs in the interpreter here
    llm = _llm(path, backend)
    attn = llm.core.executor.worker.runner.backends[0]
    assert isinstance(attn, MLAAttention) and attn.decode.name == attn.prefill.name == backend
    _check(llm.generate(batch[:n], GREEDY), want[:n])


@pytest.mark.parametrize("name", list(DEEPSEEK))
def test_chunks_preemption_and_prefix_hits_keep_outputs(cases, name):
    path, batch, want = cases[name]
    chunked = _llm(path, max_num_batched_tokens=8)  # prompts prefill in chunks over the latent cache
    _check(chunked.generate(batch, GREEDY), want)
    tiny = _llm(path, num_kv_blocks=5, max_model_len=64)
    _check(tiny.generate(batch, GREEDY), want)
    assert tiny.core.scheduler.stats.num_preemptions > 0
    cached = _llm(path)
    _check(cached.generate(batch, GREEDY), want)
    second = cached.generate(batch, GREEDY)
    _check(second, want)
    assert [o.num_cached_tokens for o in second] == [(len(p) - 1) // BLOCK * BLOCK for p in batch]


def test_kv_pool_is_sized_by_the_latent(cases):
    """One token costs (kv_lora_rank + rope) values per layer, not 2 x heads x head size."""
    path, _, _ = cases["deepseek_v3"]
    arch = read_arch(path)
    dims = arch.deepseek.mla
    per_block = arch.num_layers * BLOCK * dims.latent_size * 4  # float32 on CPU
    llm = _llm(path, num_kv_blocks=None, kv_cache_memory_bytes=100 * per_block + 7)
    assert llm.core.executor.worker.info.num_kv_blocks == 100
    caches = llm.core.executor.worker.runner.kv_caches
    assert all(isinstance(c, MLACache) and c.data.shape[1:] == (BLOCK, dims.latent_size) for c in caches)
    specs = llm.core.executor.worker.runner.model.attention_specs()
    assert block_bytes(specs, BLOCK, torch.float32) == per_block
    expanded = arch.num_layers * BLOCK * 2 * arch.num_heads * dims.qk_head_dim * 4  # K and V per head
    assert expanded / per_block > 4
