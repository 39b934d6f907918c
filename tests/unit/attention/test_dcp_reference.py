"""DCP-sharded caches: every rank attends over its shard with global positions; the LSE merge
of the shards equals attention over the whole key set (the float64 oracle). TORCH and TRITON
(the interpreter on CPU), and the phase splits of the two (DCP asks each half for its LSE), run
the same table; tests/gpu/test_dcp_gpu.py runs it on the GPU."""

import pytest
import torch

from meshserve.attention.backend import KVCache, LayerParams
from meshserve.attention.backends.phase_split import phase_split_backend
from meshserve.attention.backends.torch_ref import TorchBackend
from meshserve.attention.backends.triton_paged import TritonBackend
from meshserve.attention.metadata import AttentionMetadata
from tests.unit.attention.scenarios import SCENARIO_BY_NAME, assert_matches, make_case, oracle

DCP_SCENARIOS = ["small_decode", "mixed_prefill_decode", "chunked_prefill", "long_decode", "gqa",
                 "sliding_window", "streaming_sinks", "sinks", "alibi", "softcap", "fp8_e4m3"]


def shard_run(case, dcp: int, rank: int, gen: torch.Generator, backend_cls=TorchBackend, *, dtype="float32",
              device="cpu", backend_kwargs=None):
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
    # Noise outside the sequences: a read past a shard's end shows up as a wrong number.
    data = (torch.randn((num_blocks, *src.data.shape[1:]), generator=gen) * 100).to(src.data.dtype)
    k_scale, v_scale = src.k_scale.cpu(), src.v_scale.cpu()
    cache = KVCache(data, k_scale, v_scale)
    for s, ctx in enumerate(sc.context_lens):  # earlier context, by plain indexing
        if ctx <= rank:
            continue
        pos = torch.arange(rank, ctx, dcp)
        lp = pos // dcp
        stored = torch.stack([case.keys64[s][pos], case.values64[s][pos]], dim=1)  # [n, 2, Hkv, D]
        if cache.is_fp8:
            stored = stored / torch.stack([k_scale, v_scale]).double()[None, :, None, None]
        cache.data[torch.tensor(tables[s])[lp // bs], :, lp % bs] = stored.to(data.dtype)
    # Built on the CPU (fast element writes), then moved.
    cache = KVCache(data.to(device), k_scale.to(device), v_scale.to(device))
    layer = LayerParams(*(None if t is None else t.to(device) for t in (case.layer.sinks, case.layer.alibi_slopes)))
    meta = AttentionMetadata.build(query_lens=sc.query_lens, seq_lens=seq_lens, block_tables=tables,
                                   block_size=bs, dcp_size=dcp, dcp_rank=rank, device=device)
    cc = torch.cuda.get_device_capability() if device == "cuda" else None
    problem = sc.problem(dtype, device=device, needs_lse=True, compute_capability=cc, dcp_size=dcp)
    backend = backend_cls(problem, **(backend_kwargs or {}))
    plan = backend.plan(meta)
    query, key, value = (t.to(device) for t in (case.query, case.key, case.value))
    backend.write_kv(key, value, cache, meta.slot_mapping)
    return backend.forward(query, key, value, cache, plan, layer=layer, return_lse=True)


def merge_shards(parts):
    """LSE merge of per-rank (out, lse) in float64: (merged out [T, H, Dv], lse [T, H])."""
    outs = torch.stack([o.double().cpu() for o, _ in parts])  # [dcp, T, H, D]
    lses = torch.stack([lse.double().cpu() for _, lse in parts])  # [dcp, T, H]
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.nan_to_num(torch.exp(lses - lse), nan=0.0)
    return (weights[..., None] * outs).sum(0), lse


@pytest.mark.parametrize("name", DCP_SCENARIOS)
@pytest.mark.parametrize("dcp", [2, 3])
@pytest.mark.parametrize("backend_cls", [TorchBackend, TritonBackend, phase_split_backend(TorchBackend, TritonBackend),
                                         phase_split_backend(TritonBackend, TorchBackend)], ids=lambda b: b.name)
def test_dcp_shards_merge_to_full_attention(name, dcp, backend_cls):
    case = make_case(SCENARIO_BY_NAME[name])
    gen = torch.Generator().manual_seed(dcp)
    merged, lse = merge_shards([shard_run(case, dcp, r, gen, backend_cls) for r in range(dcp)])
    ref_out, ref_lse = oracle(case)
    assert_matches(merged, lse, ref_out, ref_lse, torch.float32)


@pytest.mark.parametrize("name", ["small_decode", "long_decode", "sliding_window", "streaming_sinks", "sinks"])
def test_triton_dcp_split_decode(name):
    """Split-KV decode (a fixed 16-key partition, so several splits per shard) over DCP shards."""
    case = make_case(SCENARIO_BY_NAME[name])
    gen = torch.Generator().manual_seed(7)
    parts = [shard_run(case, 2, r, gen, TritonBackend, backend_kwargs={"decode_partition": 16}) for r in range(2)]
    merged, lse = merge_shards(parts)
    ref_out, ref_lse = oracle(case)
    assert_matches(merged, lse, ref_out, ref_lse, torch.float32)


def test_dcp_slot_mapping_stores_each_token_once():
    tables = [[3, 1], [0, 2, 4]]
    metas = [AttentionMetadata.build(query_lens=[5, 1], seq_lens=[5, 9], block_tables=tables, block_size=2,
                                     dcp_size=2, dcp_rank=r) for r in range(2)]
    # Sequence 0 positions 0..4, sequence 1 position 8: rank = pos % 2, local = pos // 2.
    assert metas[0].slot_mapping.tolist() == [6, -1, 7, -1, 2, 8]
    assert metas[1].slot_mapping.tolist() == [-1, 6, -1, 7, -1, -1]
