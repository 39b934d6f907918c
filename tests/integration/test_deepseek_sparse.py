"""DeepSeek-V3.2 (sparse MLA: the lightning indexer picks index_topk tokens per query) through
`meshserve.LLM` equals HF transformers' own DeepseekV32ForCausalLM greedy `generate`, token for
token, with the TORCH and TRITON sparse backends; also with chunked prefill, preemption and
prefix-cache hits, under tp=2 with dcp=2 (gloo): each rank scores the tokens it stores and the
ranks' top-k lists merge, and after a disaggregated KV hand-over (index keys included).
index_topk=8 is below most prompt lengths, so the choice matters (checked)."""

import asyncio
import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from meshserve import SamplingParams
from meshserve.attention.mla.sparse_layer import SparseMLAAttention
from meshserve.cluster.coordinator import ClusterConfig
from meshserve.config import ParallelConfig, PoolConfig
from meshserve.kvstore.cache_tensors import MLACache, block_bytes
from meshserve.workers.checkpoint import read_arch
from tests.deepseek_models import hf_deepseek_v32, write_deepseek_v32
from tests.integration.test_deepseek_hf import BLOCK, _check, _llm
from tests.tiny_models import hf_greedy, prompts
from tests.unit.cluster.cases import assert_no_held_blocks, collect, engine_config, serve

NEW_TOKENS = 12
TOPK = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(checkpoint dir, prompts, HF greedy outputs) of a tiny V3.2 with index_topk=8."""
    path = tmp_path_factory.mktemp("deepseek_v32") / "v32"
    hf = write_deepseek_v32(path, index_topk=TOPK)
    batch = prompts(3, seed=21, min_len=12, max_len=40)
    return path, batch, [hf_greedy(hf, p, NEW_TOKENS) for p in batch]


def test_the_indexer_choice_changes_the_output(case):
    """The same weights attending to every token (index_topk above the context) decode otherwise:
    a model that ignored the indexer could not pass the tests below."""
    _, batch, want = case
    dense = hf_deepseek_v32(index_topk=4096)
    assert [hf_greedy(dense, p, NEW_TOKENS) for p in batch] != want


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_greedy_matches_hf(case, backend):
    path, batch, want = case
    n = 3 if backend == "TORCH" else 2  # TRITON runs in the interpreter here
    llm = _llm(path, backend)
    attn = llm.core.executor.worker.runner.backends[0]
    assert isinstance(attn, SparseMLAAttention) and attn.backend.name == backend and attn.topk == TOPK
    _check(llm.generate(batch[:n], GREEDY), want[:n])


def test_chunks_preemption_and_prefix_hits_keep_outputs(case):
    path, batch, want = case
    _check(_llm(path, max_num_batched_tokens=8).generate(batch, GREEDY), want)  # indexer keys of earlier chunks
    tiny = _llm(path, num_kv_blocks=5, max_model_len=64)
    _check(tiny.generate(batch, GREEDY), want)
    assert tiny.core.scheduler.stats.num_preemptions > 0
    cached = _llm(path)
    _check(cached.generate(batch, GREEDY), want)
    second = cached.generate(batch, GREEDY)  # shared blocks carry their index keys too
    _check(second, want)
    assert [o.num_cached_tokens for o in second] == [(len(p) - 1) // BLOCK * BLOCK for p in batch]


def test_top_k_above_the_context_equals_dense_mla(tmp_path):
    """index_topk >= every sequence: sparse MLA attends to every token, as the V3 (dense) path does."""
    sparse = tmp_path / "sparse"
    write_deepseek_v32(sparse, index_topk=4096)
    dense = tmp_path / "dense"
    shutil.copytree(sparse, dense)
    cfg = json.loads((dense / "config.json").read_text())
    for key in ("index_topk", "index_n_heads", "index_head_dim"):
        cfg.pop(key)
    cfg["architectures"], cfg["model_type"] = ["DeepseekV3ForCausalLM"], "deepseek_v3"
    (dense / "config.json").write_text(json.dumps(cfg))
    weights = load_file(sparse / "model.safetensors")
    save_file({k: v for k, v in weights.items() if ".indexer." not in k}, dense / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    batch = prompts(3, seed=5, min_len=12, max_len=40)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=1)
    got = _llm(sparse).generate(batch, params)
    ref = _llm(dense).generate(batch, params)
    for a, b in zip(got, ref):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor([x.logprob for x in a.logprobs]),
                                   torch.tensor([x.logprob for x in b.logprobs]), rtol=1e-5, atol=1e-5)  # fmt: skip


def test_kv_pool_counts_the_index_keys(case):
    """One token costs (kv_lora_rank + rope) latent values plus index_head_dim key values per layer."""
    path, _, _ = case
    arch = read_arch(path)
    dims = arch.deepseek.mla
    per_block = arch.num_layers * BLOCK * (dims.latent_size + dims.indexer.head_dim) * 4  # float32 on CPU
    llm = _llm(path, num_kv_blocks=None, kv_cache_memory_bytes=100 * per_block + 7)
    assert llm.core.executor.worker.info.num_kv_blocks == 100
    caches = llm.core.executor.worker.runner.kv_caches
    assert all(isinstance(c, MLACache) and c.index_keys.shape[1:] == (BLOCK, dims.indexer.head_dim) for c in caches)
    specs = llm.core.executor.worker.runner.model.attention_specs()
    assert block_bytes(specs, BLOCK, torch.float32) == per_block


@pytest.mark.parametrize(("dcp", "backend"), [(2, "TORCH"), (2, "TRITON"), (1, "TORCH")])
def test_tp2_dcp_matches_hf(case, tmp_path, dcp, backend):
    """tp=2 over gloo, blocks of 4 tokens, prefill chunks of 12: with dcp=2 each rank stores every
    other token's latent and index key, scores its own, and the merged top-k equals the single-rank one."""
    from tests.integration.distributed import run_ranks
    from tests.integration.test_deepseek_dcp import NEW_TOKENS as RANK_TOKENS
    from tests.integration.test_deepseek_dcp import rank_main

    path, batch, want = case
    if backend == "TRITON":
        batch, want = batch[:2], want[:2]  # the Triton interpreter is slow on two busy cores
    out_file = tmp_path / "out.json"
    run_ranks(rank_main, 2, str(path), dcp, "ag_rs", backend, batch, str(out_file))
    got = json.loads(out_file.read_text())
    assert got == [w[:RANK_TOKENS] for w in want], f"tp=2 dcp={dcp} {backend}: {got} != HF {want}"


@pytest.mark.parametrize("decode_parallel", [None, (2, 2)], ids=["same_layout", "decode_tp2_dcp2"])
def test_disaggregated_hand_over_carries_the_index_keys(case, decode_parallel):
    """Prefill replica -> decode replica through the coordinator (ranks on threads; processes for the
    tp=2 decode pool): the latent and the index keys cross the transport (re-sharded to every other
    token per rank for dcp=2), the decode replica recomputes nothing, and its tokens equal HF's."""
    path, batch, want = case
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine = engine_config(path)
    engine = dataclasses.replace(engine, scheduler=dataclasses.replace(engine.scheduler, max_num_batched_tokens=16))
    tp_dcp = None if decode_parallel is None else ParallelConfig(tp=decode_parallel[0], dcp=decode_parallel[1])
    config = ClusterConfig(engine=engine, pools=PoolConfig(mode="disaggregated"),
                           runtime="threads" if tp_dcp is None else "processes", decode_parallel=tp_dcp)

    async def body(coord):
        got = await asyncio.gather(*(collect(coord, f"r{i}", p, params) for i, p in enumerate(batch)))
        (decode,) = coord.replicas("decode")
        assert decode.stats().num_kv_imports == len(batch) and decode.stats().num_recomputes == 0
        assert_no_held_blocks(coord)
        return got

    for i, (g, w) in enumerate(zip(serve(config, body), want)):
        assert g.token_ids == w, f"prompt {i}: meshserve {g.token_ids} != HF {w}"
