"""DeepSeek-V3.2's parts: its config switch, and the lightning indexer against HF transformers' own
DeepseekV32Indexer (same weights, same tokens: the same top-k per query); the index key cache
in the KV pool (sizes, copy-on-write, hand-over layout); the registry's sparse table."""

from dataclasses import replace

import pytest
import torch

from meshserve.attention.backend import AttentionProblem
from meshserve.attention.mla.indexer import index_scores, topk_ordered
from meshserve.attention.mla.spec import mla_spec
from meshserve.attention.registry import BackendKind, explain, select_backend
from meshserve.attention.spec import IndexerDims
from meshserve.errors import ConfigError
from meshserve.kvstore.cache_tensors import allocate_caches, block_bytes, copy_blocks
from meshserve.workers.models.arch import arch_from_hf_config
from meshserve.workers.models.deepseek_indexer import Indexer
from meshserve.workers.models.yarn_rope import YarnRotary
from tests.deepseek_models import COMMON, V32, hf_deepseek_v32


def v32_config(**override) -> dict:
    import transformers

    cfg = transformers.DeepseekV32Config(**{**COMMON, **V32, **override}).to_dict()
    return cfg | {"architectures": ["DeepseekV32ForCausalLM"]}


def test_index_topk_switches_sparse_mla_on():
    arch = arch_from_hf_config(v32_config())
    assert arch.architecture == "DeepseekV32ForCausalLM"
    assert arch.deepseek.mla.indexer == IndexerDims(num_heads=16, head_dim=16, topk=8)
    dense = v32_config() | {"architectures": ["DeepseekV3ForCausalLM"]}
    dense.pop("index_topk")
    assert arch_from_hf_config(dense).deepseek.mla.indexer is None


@pytest.mark.parametrize(("drop", "override", "field"), [
    ("index_topk", {}, "config.json:index_topk"),
    ("index_n_heads", {}, "config.json:index_n_heads"),
    (None, {"index_topk": 0}, "index_topk"),
    (None, {"index_head_dim": 4}, "index_head_dim"),  # narrower than the rope part (8)
])  # fmt: skip
def test_bad_indexer_configs_name_the_field(drop, override, field):
    cfg = v32_config() | override
    if drop:
        cfg.pop(drop)
    with pytest.raises(ConfigError, match=field):
        arch_from_hf_config(cfg)


@pytest.mark.parametrize("topk", [3, 8])
def test_indexer_chooses_what_hf_chooses(topk):
    hf = hf_deepseek_v32(seed=5, index_topk=topk)
    attn = hf.model.layers[1].self_attn
    arch = arch_from_hf_config(v32_config(index_topk=topk))
    ours = Indexer(arch.hidden_size, arch.deepseek.mla)
    ours.load_state_dict(attn.indexer.state_dict())
    seq = 30
    x = torch.randn(1, seq, arch.hidden_size, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(seq)
    with torch.no_grad():
        q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
        cos_sin = hf.model.rotary_emb(x, positions[None])
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()[None]
        want = attn.indexer(x, q_resid, cos_sin, causal, positions[None])[0]  # [S, topk]
        rotary = YarnRotary(arch.deepseek.rope, arch.deepseek.mla.qk_rope_head_dim, 64)
        q, w, k = ours(x[0], q_resid[0], rotary(positions, x.dtype), rotary)
        scores = index_scores(q, w, k.expand(seq, seq, -1)).masked_fill(~causal[0], float("-inf"))
        got = topk_ordered(scores, positions.expand(seq, seq), topk).positions
    for t in range(seq):
        hf_rows = {p for p in want[t].tolist() if p <= t}  # HF pads early rows with masked picks
        assert {p for p in got[t].tolist() if p >= 0} == hf_rows, f"token {t}"


def sparse_spec(kv_cache_dtype="auto"):
    dims = arch_from_hf_config(v32_config()).deepseek.mla
    return mla_spec(4, dims, kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize(("kv_dtype", "key_bytes"), [("auto", 16 * 4), ("fp8_e4m3", 16 + 4)])
def test_pool_blocks_carry_index_keys(kv_dtype, key_bytes):
    spec = sparse_spec(kv_dtype)
    latent = spec.mla.latent_size * (1 if kv_dtype != "auto" else 4)
    assert block_bytes([spec, spec], 4, torch.float32) == 2 * 4 * (latent + key_bytes)
    caches = allocate_caches([spec], num_blocks=5, block_size=4, dtype=torch.float32)
    cache = caches[0]
    cache.index_keys.copy_(torch.randn(cache.index_keys.shape).to(cache.index_keys.dtype))
    if cache.index_scale is not None:
        cache.index_scale.uniform_(0.5, 2.0)
    before_keys, before_scale = cache.index_keys.float().clone(), cache.index_scale
    before_scale = None if before_scale is None else before_scale.clone()
    copy_blocks(caches, [(1, 3)])  # copy-on-write of a shared block takes its index keys along
    assert torch.equal(cache.index_keys[3].float(), before_keys[1])
    assert torch.equal(cache.index_keys[2].float(), before_keys[2])
    if before_scale is not None:
        assert torch.equal(cache.index_scale[3], before_scale[1])


@pytest.mark.parametrize(("kv_dtype", "tensors"), [("auto", 2), ("fp8_e4m3", 3)])
def test_kv_hand_over_moves_the_index_keys_too(kv_dtype, tensors):
    """Each layer's latent, index keys (and FP8 key scales) are tensors of the hand-over layout."""
    from meshserve.kvtransfer.rank_io import KVRankIO

    caches = allocate_caches([sparse_spec(kv_dtype)] * 2, num_blocks=3, block_size=4, dtype=torch.float32)
    io = KVRankIO(caches, model_id="m", block_size=4)
    assert len(io.caches) == len(io.layout.layers) == 2 * tensors
    assert io.layout.layers[1] == (str(caches[0].index_keys.dtype).removeprefix("torch."), (4, 16))


def test_registry_keeps_dense_and_sparse_mla_apart():
    problem = AttentionProblem(spec=sparse_spec(), needs_lse=True)
    assert select_backend(problem, kind=BackendKind.MLA_SPARSE).name == "TORCH"
    refused = {v.name: v.reasons for v in explain(problem, BackendKind.MLA_DECODE)}
    assert all(any("sparse MLA (indexer top-k) not supported" in r for r in rs) for rs in refused.values())
    dense = AttentionProblem(spec=replace(sparse_spec(), mla=replace(sparse_spec().mla, indexer=None)))
    verdicts = {v.name: v.reasons for v in explain(dense, BackendKind.MLA_SPARSE)}
    assert all(any("spec.mla.indexer is None" in r for r in rs) for rs in verdicts.values())


def test_engine_wide_backend_names_for_sparse_layers():
    from meshserve.attention.mla.sparse_layer import SparseMLAAttention

    problem = AttentionProblem(spec=sparse_spec(), needs_lse=True)
    assert SparseMLAAttention.named(problem, "torch").backend.name == "TORCH"
    assert SparseMLAAttention.named(problem, "FLASHINFER").backend.name == "TORCH"  # dense MLA decode only
    with pytest.raises(ConfigError, match="mla_sparse_backend"):
        SparseMLAAttention.named(problem, "CPU_SDPA")
