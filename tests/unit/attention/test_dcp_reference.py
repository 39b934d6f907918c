"""DCP-sharded caches: every rank attends over its shard with global positions; the LSE merge
of the shards equals attention over the whole key set (the float64 oracle)."""

import pytest
import torch

from meshserve.attention.backend import KVCache
from meshserve.attention.backends.torch_ref import TorchBackend
from meshserve.attention.metadata import AttentionMetadata
from tests.unit.attention.scenarios import SCENARIO_BY_NAME, assert_matches, make_case, oracle

DCP_SCENARIOS = ["small_decode", "mixed_prefill_decode", "chunked_prefill", "long_decode", "gqa",
                 "sliding_window", "streaming_sinks", "sinks", "alibi", "softcap", "fp8_e4m3"]


def shard_run(case, dcp: int, rank: int, gen: torch.Generator, backend_cls=TorchBackend):
    """Run `backend_cls` (TORCH by default) on DCP rank `rank`'s shard of `case`; returns (out, lse)."""
    sc = case.scenario
    bs = sc.block_size
    seq_lens = [c + q for c, q in zip(sc.context_lens, sc.query_lens)]
    local = [(s - rank + dcp - 1) // dcp for s in seq_lens]
    needed = [-(-n // bs) for n in local]
    num_blocks = sum(needed) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in needed:
        tables.append(perm[at: at + n])
        at += n
    src = case.kv_cache
    data = torch.zeros((num_blocks, *src.data.shape[1:]), dtype=src.data.dtype)
    cache = KVCache(data, src.k_scale, src.v_scale)
    for s, ctx in enumerate(sc.context_lens):  # earlier context, by plain indexing
        for pos in range(rank, ctx, dcp):
            lp = pos // dcp
            stored = torch.stack([case.keys64[s][pos], case.values64[s][pos]])
            if cache.is_fp8:
                stored = stored / torch.stack([src.k_scale, src.v_scale]).double()[:, None, None]
            cache.data[tables[s][lp // bs], :, lp % bs] = stored.to(data.dtype)
    meta = AttentionMetadata.build(query_lens=sc.query_lens, seq_lens=seq_lens, block_tables=tables,
                                   block_size=bs, dcp_size=dcp, dcp_rank=rank)
    backend = backend_cls(sc.problem(needs_lse=True))
    plan = backend.plan(meta)
    backend.write_kv(case.key, case.value, cache, meta.slot_mapping)
    return backend.forward(case.query, case.key, case.value, cache, plan, layer=case.layer, return_lse=True)


@pytest.mark.parametrize("name", DCP_SCENARIOS)
@pytest.mark.parametrize("dcp", [2, 3])
def test_dcp_shards_merge_to_full_attention(name, dcp):
    case = make_case(SCENARIO_BY_NAME[name])
    gen = torch.Generator().manual_seed(dcp)
    parts = [shard_run(case, dcp, r, gen) for r in range(dcp)]
    outs = torch.stack([o.double() for o, _ in parts])  # [dcp, T, H, D]
    lses = torch.stack([lse.double() for _, lse in parts])  # [dcp, T, H]
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.nan_to_num(torch.exp(lses - lse), nan=0.0)
    merged = (weights[..., None] * outs).sum(0)
    ref_out, ref_lse = oracle(case)
    assert_matches(merged, lse, ref_out, ref_lse, torch.float32)


def test_dcp_slot_mapping_stores_each_token_once():
    tables = [[3, 1], [0, 2, 4]]
    metas = [AttentionMetadata.build(query_lens=[5, 1], seq_lens=[5, 9], block_tables=tables, block_size=2,
                                     dcp_size=2, dcp_rank=r) for r in range(2)]
    # Sequence 0 positions 0..4, sequence 1 position 8: rank = pos % 2, local = pos // 2.
    assert metas[0].slot_mapping.tolist() == [6, -1, 7, -1, 2, 8]
    assert metas[1].slot_mapping.tolist() == [-1, 6, -1, 7, -1, -1]
