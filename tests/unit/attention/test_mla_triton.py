"""TRITON MLA on the CPU interpreter: absorbed decode and expanded prefill vs the TORCH reference.

The TORCH reference expands the latent to per-head K/V (as HF does); the decode kernel never
does, so agreement checks the absorption, the latent-space split-KV attention and the merge.
"""

import math
from dataclasses import replace

import pytest
import torch

from meshserve.attention.kernels.mla_write import write_latent_kv_triton
from meshserve.attention.mla.backends.torch_ref import TorchMLABackend
from meshserve.attention.mla.backends.triton_decode import TritonMLADecodeBackend
from meshserve.attention.mla.backends.triton_prefill import TritonMLAPrefillBackend
from meshserve.attention.mla.cache import LatentCache, write_latent_kv_torch
from meshserve.attention.mla.layer import MLAAttention, split_prefill_decode
from meshserve.attention.spec import KVCacheDtype
from meshserve.errors import ConfigError
from tests.unit.attention.mla_cases import DIMS, MLA_BY_NAME, make_mla_case, mla_oracle
from tests.unit.attention.scenarios import assert_matches

DECODE = ["small_decode", "long_decode", "many_heads_decode", "small_page_decode", "odd_dims", "fp8_e4m3"]
PREFILL = ["prefill", "chunked_prefill", "mixed", "odd_dims", "fp8_e4m3"]


def reference(case):
    meta = case.metadata
    backend = TorchMLABackend(case.scenario.problem())
    return backend.forward(case.query, case.cache, meta, case.weights, return_lse=True)


def decode_part(case):
    """The case cut down to its decode sequences (what MLAAttention hands the decode backend)."""
    _, decode = split_prefill_decode(case.metadata)
    npt = case.metadata.num_prefill_tokens
    return decode, case.query[npt:]


@pytest.mark.parametrize("name", DECODE)
@pytest.mark.parametrize("partition", [None, 16])
def test_absorbed_decode_matches_expanded_reference(name, partition):
    sc = MLA_BY_NAME[name]
    case = make_mla_case(sc, seed=1)
    write_latent_kv_torch(case.latent, case.k_pe, case.cache, case.metadata.slot_mapping)
    ref_out, ref_lse = reference(case)
    meta, query = decode_part(case)
    backend = TritonMLADecodeBackend(sc.problem(), partition=partition)
    plan = backend.plan(meta)
    if partition is not None:
        assert plan.num_splits == -(-max(meta.seq_lens_host) // 16)  # forced splits do run
    out, lse = backend.forward(query, case.cache, plan, case.weights, return_lse=True)
    npt = case.metadata.num_prefill_tokens
    assert_matches(out, lse, ref_out[npt:].double(), ref_lse[npt:].double(), torch.float32)
    no_lse = backend.forward(query, case.cache, plan, case.weights)
    torch.testing.assert_close(no_lse, out, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["small_decode", "long_decode", "many_heads_decode", "small_page_decode",
                                  "fp8_e4m3"])
def test_graph_plan_serves_any_length_written_into_its_buffers(name):
    """plan_for_graph plans once for max_model_len over static buffers; the same plan then serves
    the case's shorter lengths and tables written into those buffers in place (what a CUDA-graph
    replay sees): every row cut over the fixed splits by its own length; a short row's splits past
    its keys are empty (small_decode: 5 keys over 3 splits) and the merge ignores them."""
    sc = MLA_BY_NAME[name]
    case = make_mla_case(sc, seed=3)
    write_latent_kv_torch(case.latent, case.k_pe, case.cache, case.metadata.slot_mapping)
    ref_out, ref_lse = reference(case)
    meta, query = decode_part(case)
    n, longest = meta.num_decodes, sc.max_model_len
    seq_lens = torch.ones(n, dtype=torch.int32)  # the static buffers: padding-like values at plan time
    table = torch.zeros(n, longest // sc.block_size, dtype=torch.int32)
    static = replace(meta, seq_lens=seq_lens, block_table=table, seq_lens_host=(longest,) * n, max_seq_len=longest)
    backend = TritonMLADecodeBackend(sc.problem())
    plan = backend.plan_for_graph(static)
    assert plan.partition == 0 and plan.num_splits > 1
    seq_lens.copy_(meta.seq_lens)
    table[:, : meta.block_table.shape[1]] = meta.block_table
    plan.partial_o.fill_(float("nan"))  # empty splits write no output: the merge must not read it
    out, lse = backend.forward(query, case.cache, plan, case.weights, return_lse=True)
    npt = case.metadata.num_prefill_tokens
    assert_matches(out, lse, ref_out[npt:].double(), ref_lse[npt:].double(), torch.float32)
    # Each row fills the splits its keys reach in equal whole tiles; the splits past them stay empty.
    used = torch.isfinite(plan.partial_lse).any(-1).sum(0).tolist()
    bn, ns = backend.config.block_n, plan.num_splits
    lens = meta.seq_lens.tolist()
    assert used == [math.ceil(n / (math.ceil(math.ceil(n / ns) / bn) * bn)) for n in lens]
    with pytest.raises(ConfigError, match="num_prefills"):
        backend.plan_for_graph(case.metadata if case.metadata.num_prefills else replace(static, num_prefills=1))


@pytest.mark.parametrize("name", PREFILL)
def test_prefill_and_mixed_batches_match_float64_oracle(name):
    """MLAAttention with TRITON for both phases: write, split, prefill + decode, concatenate."""
    sc = MLA_BY_NAME[name]
    case = make_mla_case(sc, seed=2)
    attn = MLAAttention(sc.problem(), decode_backend="TRITON", prefill_backend="TRITON")
    assert isinstance(attn.prefill, TritonMLAPrefillBackend) and isinstance(attn.decode, TritonMLADecodeBackend)
    plan = attn.plan(case.metadata)
    attn.write_kv(case.latent, case.k_pe, case.cache, plan)
    out, lse = attn.forward(case.query, case.cache, plan, case.weights, return_lse=True)
    ref_out, ref_lse = mla_oracle(case)
    assert_matches(out, lse, ref_out, ref_lse, torch.float32)


def test_prefill_tiles_cover_every_query_once():
    from meshserve.attention.kernels.host_plans import mla_prefill_tiles as prefill_tiles

    seqs, q0s = prefill_tiles((5, 40, 17), (5, 90, 20), 16)
    assert sorted(zip(seqs, q0s)) == [(0, 0), (1, 0), (1, 16), (1, 32), (2, 0), (2, 16)]
    assert (seqs[0], q0s[0]) == (1, 32)  # most keys first


# The interpreter's fp32 -> fp8 cast drops the carry when rounding crosses a power of two
# (7.9 -> 4, not 8); the GPU's cast is right. The CPU runs FP8 writes through torch.
INTERPRETER_FP8 = pytest.mark.xfail(not torch.cuda.is_available(), strict=True,
                                    reason="Triton interpreter: fp32 -> fp8 cast loses the rounding carry")


@pytest.mark.parametrize("kv_dtype", [KVCacheDtype.AUTO, pytest.param(KVCacheDtype.FP8_E4M3, marks=INTERPRETER_FP8),
                                      pytest.param(KVCacheDtype.FP8_E5M2, marks=INTERPRETER_FP8)])
def test_write_kernel_stores_the_same_bits_as_the_reference(kv_dtype):
    gen = torch.Generator().manual_seed(4)
    caches = [LatentCache.allocate(3, 4, DIMS, dtype=torch.float32, kv_cache_dtype=kv_dtype, scale=0.05)
              for _ in range(2)]  # fmt: skip
    latent = torch.randn(7, 32, generator=gen) * 30  # large enough that FP8 saturates somewhere
    latent[0, :4] = torch.tensor([7.9, -15.9, 31.9, 0.49]) * 0.05  # rounding carries into the next power of 2
    k_pe = torch.randn(7, 8, generator=gen)
    slots = torch.tensor([0, 5, -1, 11, 2, -1, 7])
    write_latent_kv_torch(latent, k_pe, caches[0], slots)
    write_latent_kv_triton(latent, k_pe, caches[1], slots)
    assert torch.equal(caches[0].data.view(torch.uint8), caches[1].data.view(torch.uint8))
    assert caches[1].data.float().abs().sum() > 0


def test_decode_backend_refuses_prefill_and_foreign_plans():
    sc = MLA_BY_NAME["mixed"]
    case = make_mla_case(sc)
    backend = TritonMLADecodeBackend(sc.problem())
    with pytest.raises(ConfigError, match="metadata.num_prefills"):
        backend.plan(case.metadata)
    with pytest.raises(ConfigError, match="MLADecodePlan"):
        backend.forward(case.query, case.cache, case.metadata, case.weights)
