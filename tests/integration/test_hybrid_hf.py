"""Gemma2, Gemma3 (text) and GPT-OSS through `meshserve.LLM` equal HF transformers' greedy
`generate`, token for token.

Both alternate sliding-window (6 tokens, shorter than every prompt) and full-attention layers
in one model. Gemma2 adds attention and final logit soft-caps, query_pre_attn_scalar, sandwich
norms with (1 + weight) scales and a tied, scaled embedding; GPT-OSS adds learned per-head sink
logits (made large in the checkpoint so that ignoring them changes the tokens), YaRN rope and a
top-2-of-4 mixture of clamped-SwiGLU experts. Gemma3 drops the soft-caps, adds (1 + weight)
q/k norms and rotates its windowed layers with a local base (10k) and its full layers with a
linearly scaled global one (1M, factor 4). The same outputs must hold with chunked prefill,
preemption and prefix-cache hits.
"""

import dataclasses

import pytest

from meshserve import LLM, SamplingParams
from meshserve.attention.backend import AttentionProblem
from meshserve.attention.registry import explain
from meshserve.workers.checkpoint import read_arch
from meshserve.workers.models import model_class
from tests.tiny_models import HYBRID_ARCHS, HYBRID_WINDOW, hf_greedy, prompts, write_checkpoint

NEW_TOKENS = 16
BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
BATCH = {"TORCH": 4, "TRITON": 2}  # TRITON runs in the interpreter on CPU
# KV layer groups (kvstore/groups.py): 2 windowed + 1 full layer -> 3 groups of one layer each.
GROUPS = {"gemma2": 3, "gemma3": 3, "gpt_oss": 2}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """arch -> (checkpoint dir, prompts, HF greedy outputs, HF model)."""
    root = tmp_path_factory.mktemp("hybrid_hf")
    out = {}
    for name in HYBRID_ARCHS:
        hf = write_checkpoint(root / name, name)
        batch = prompts(4, seed=3, min_len=12, max_len=30)
        out[name] = (root / name, batch, [hf_greedy(hf, p, NEW_TOKENS) for p in batch], hf)
    return out


def _llm(path, backend="TORCH", **kw):
    kw = {"num_kv_blocks": 64, "max_model_len": 128, **kw}
    return LLM(path, attention_backend=backend, block_size=BLOCK, progress=False, **kw)


def _check(outputs, want):
    for i, (out, ref) in enumerate(zip(outputs, want)):
        assert out.token_ids == ref, f"prompt {i}: meshserve {out.token_ids} != HF {ref}"


def test_architecture_data(cases):
    gemma = read_arch(cases["gemma2"][0])
    assert gemma.layer_windows == (HYBRID_WINDOW, None, HYBRID_WINDOW)
    assert (gemma.attn_soft_cap, gemma.final_soft_cap, gemma.attn_scale) == (3.0, 10.0, 24 ** -0.5)
    assert gemma.tie_word_embeddings and gemma.sandwich_norms and gemma.embed_scale == 8.0
    gemma3 = read_arch(cases["gemma3"][0])
    assert gemma3.qk_norm and gemma3.attn_soft_cap is None and gemma3.final_soft_cap is None
    assert (gemma3.rope.theta, gemma3.rope.kind, gemma3.local_rope.theta) == (1e6, "linear", 1e4)
    oss = read_arch(cases["gpt_oss"][0])
    assert oss.layer_windows == (HYBRID_WINDOW, None) and oss.attn_sinks
    assert (oss.experts.num_experts, oss.experts.top_k, oss.rope.kind) == (4, 2, "yarn")
    specs = model_class(oss)(oss, max_positions=8).attention_specs()
    assert [s.has_sinks for s in specs] == [True, True]
    assert [s.sliding_window for s in specs] == [HYBRID_WINDOW, None]


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
@pytest.mark.parametrize("arch", list(HYBRID_ARCHS))
def test_greedy_matches_hf(cases, arch, backend):
    path, batch, want, _ = cases[arch]
    n = BATCH[backend]
    llm = _llm(path, backend)
    _check(llm.generate(batch[:n], GREEDY), want[:n])


@pytest.mark.parametrize("arch", list(HYBRID_ARCHS))
def test_chunked_prefill_preemption_and_prefix_hits_keep_outputs(cases, arch):
    path, batch, want, _ = cases[arch]
    chunked = _llm(path, max_num_batched_tokens=8)  # every prompt split into chunks of <= 8 tokens
    _check(chunked.generate(batch, GREEDY), want)
    assert chunked.core.scheduler.stats.num_steps >= sum(len(p) for p in batch) // 8
    # the null block + 3 per group (one 48-token sequence in each): the batch cannot fit
    tiny = _llm(path, num_kv_blocks=1 + 3 * GROUPS[arch], max_model_len=48)
    _check(tiny.generate(batch, GREEDY), want)
    assert tiny.core.scheduler.stats.num_preemptions > 0
    cached = _llm(path)
    _check(cached.generate(batch, GREEDY), want)
    second = cached.generate(batch, GREEDY)
    _check(second, want)
    hits = [o.num_cached_tokens for o in second]
    assert hits == [(len(p) - 1) // BLOCK * BLOCK for p in batch] and sum(hits) > 0


def test_gpt_oss_sinks_change_the_tokens(cases):
    """Zeroing the checkpoint's sink logits in the HF model changes its greedy tokens: the
    equality above therefore depends on meshserve applying them."""
    import torch

    _, batch, want, hf = cases["gpt_oss"]
    saved = [layer.self_attn.sinks.detach().clone() for layer in hf.model.layers]
    try:
        with torch.no_grad():
            for layer in hf.model.layers:
                layer.self_attn.sinks.fill_(-1e4)  # exp(-1e4) = 0: no sink mass
        assert [hf_greedy(hf, p, NEW_TOKENS) for p in batch[:2]] != want[:2]
    finally:
        with torch.no_grad():
            for layer, s in zip(hf.model.layers, saved):
                layer.self_attn.sinks.copy_(s)


def test_backend_without_sinks_is_refused_with_the_reason(cases):
    arch = read_arch(cases["gpt_oss"][0])
    spec = model_class(arch)(arch, max_positions=8).attention_specs()[0]
    gpu = AttentionProblem(spec=spec, dtype="bfloat16", block_size=BLOCK, max_model_len=128, device="cuda",
                           compute_capability=(9, 0))
    verdicts = {v.name: v for v in explain(gpu)}
    assert any("sink" in r for r in verdicts["FLASHINFER"].reasons), verdicts["FLASHINFER"].reasons
    no_sinks = dataclasses.replace(gpu, spec=dataclasses.replace(spec, has_sinks=False))
    assert not any("sink" in r for r in {v.name: v for v in explain(no_sinks)}["FLASHINFER"].reasons)


@pytest.mark.parametrize("arch", ["gemma3", "gpt_oss"])
def test_generate_command_prints_hf_greedy_text(cases, arch, capsys):
    from meshserve.cli import main
    from tests.tiny_models import tiny_tokenizer

    path, _, _, hf = cases[arch]
    text = "Once upon a time there was a tiny model"
    tok = tiny_tokenizer()
    ref = hf_greedy(hf, tok.encode(text).ids, 8)
    assert main(["generate", "--model", str(path), "--max-tokens", "8", "--device", "cpu", text]) == 0
    assert capsys.readouterr().out.strip() == (text + tok.decode(ref)).strip()  # the prompt, then HF's text


def test_windowed_layers_of_a_hybrid_model_free_their_blocks(cases):
    """KV memory for 6 blocks of all 3 layers (one null): two 46-token sequences need 6 blocks
    if every layer keeps everything, but only 3 + 3 of the full layer plus <= 2 + 2 of each
    windowed layer (window 6) if windowed layers free theirs: that fits in 15 layer-blocks."""
    path, batch, want, _ = cases["gemma2"]
    layer_block_bytes = 2 * BLOCK * 2 * 16 * 4  # K and V, 16 tokens, 2 KV heads of 16, float32
    llm = LLM(path, attention_backend="TORCH", block_size=BLOCK, progress=False, max_model_len=64,
              kv_cache_memory_bytes=6 * 3 * layer_block_bytes)
    long_pair = [p + p[:30 - len(p)] for p in batch[-2:]]
    out = llm.generate(long_pair, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert all(len(o.token_ids) == NEW_TOKENS for o in out)
    assert llm.core.scheduler.stats.num_preemptions == 0
    kv = llm.core.kv
    assert kv.num_groups == GROUPS["gemma2"] and kv.num_total_blocks == 6 * 3 - 1  # one layer per block id
    assert kv.stats.window_released_blocks > 0


@pytest.mark.parametrize("arch", list(HYBRID_ARCHS))
def test_prefix_hit_past_released_window_blocks_matches_hf(cases, arch):
    """Prompts of 50..60 tokens: on the second run the hit is 48 tokens, and the windowed groups'
    hits hold only the blocks the first query's window reaches (block 2); their blocks 0 and 1
    were released while the first run decoded and are the null block in the hit."""
    path, _, _, hf = cases[arch]
    batch = prompts(2, seed=21, min_len=50, max_len=60)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in batch]
    llm = _llm(path)
    _check(llm.generate(batch, GREEDY), want)
    assert llm.core.kv.stats.window_released_blocks > 0
    hit = llm.core.kv.lookup_prefix(batch[0])
    windowed = [ids for ids, r in zip(hit.block_ids, llm.core.kv.retentions) if not r.keeps_everything]
    assert hit.num_tokens == 48 and windowed and all(ids[:2] == (0, 0) for ids in windowed)
    second = llm.generate(batch, GREEDY)
    _check(second, want)
    assert [o.num_cached_tokens for o in second] == [48, 48]
