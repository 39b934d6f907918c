"""Sparse MLA (DeepSeek-V3.2) on CUDA in half precision: TRITON against the TORCH sparse reference,
and the lightning indexer's choice on the GPU against the same choice on the CPU.

DeepSeek's shapes (latent 512, rope 64, nope 128, v 128, index_topk 2048) at 16 and 128 heads,
pages of 64, contexts up to 4000 tokens, so most tokens choose 2048 of many more rows. Which
backend runs is decided by its own validate_configuration, never restated here.
"""

import pytest
import torch

from meshserve.attention.mla.indexer import index_candidates, write_index_keys
from meshserve.attention.registry import BackendKind, load_backend
from meshserve.attention.spec import IndexerDims, KVCacheDtype, MLADims
from tests.unit.attention.mla_cases import MLAScenario
from tests.unit.attention.scenarios import assert_matches
from tests.unit.attention.sparse_cases import chosen_rows, full_metadata, run_sparse, sparse_case, sparse_problem

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

V3 = MLADims(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
TOPK = 2048
INDEX = IndexerDims(num_heads=64, head_dim=128, topk=TOPK)  # DeepSeek-V3.2-Exp's indexer
GPU_SPARSE = (
    MLAScenario("gpu_sparse_decode", (1,) * 16, tuple(range(30, 16 * 251, 251)), num_heads=16, dims=V3,
                block_size=64, max_model_len=4096),
    MLAScenario("gpu_sparse_mixed", (300, 77, 1, 1), (0, 2500, 3900, 64), num_heads=16, dims=V3, block_size=64,
                max_model_len=4096),
    MLAScenario("gpu_sparse_fp8", (20, 1, 1), (50, 3000, 33), num_heads=16, dims=V3, block_size=64,
                max_model_len=4096, kv_cache_dtype=KVCacheDtype.FP8_E4M3),
    MLAScenario("gpu_sparse_128_heads", (1,) * 6, (4000, 17, 2900, 2100, 65, 3000), num_heads=128, dims=V3,
                block_size=64, max_model_len=4096),
)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("sc", GPU_SPARSE, ids=lambda s: s.name)
def test_gpu_sparse_triton_matches_reference(sc, dtype):
    problem = sparse_problem(sc, index=INDEX, dtype=str(dtype).removeprefix("torch."), device="cuda")
    reasons = load_backend("TRITON", BackendKind.MLA_SPARSE).validate_configuration(problem)
    if reasons:
        pytest.skip("TRITON: " + "; ".join(reasons))
    case, cache = sparse_case(sc, seed=7, dtype=dtype, device="cuda", index=INDEX)
    rows = chosen_rows(case.metadata, TOPK, seed=3)
    out, lse = run_sparse("TRITON", case, cache, rows, index=INDEX)
    ref_out, ref_lse = run_sparse("TORCH", case, cache, rows, index=INDEX)
    assert_matches(out, lse, ref_out.double().cpu(), ref_lse.double().cpu(), dtype)


@pytest.mark.parametrize("kv_dtype", [KVCacheDtype.AUTO, KVCacheDtype.FP8_E4M3])
def test_gpu_indexer_choice_matches_cpu(kv_dtype):
    """Same stored keys, queries and weights: the GPU's top-2048 scores equal the CPU's (fp32)."""
    sc = MLAScenario("gpu_index", (200, 1, 1), (0, 3000, 4000), num_heads=16, dims=V3, block_size=64,
                     max_model_len=4096, kv_cache_dtype=kv_dtype)  # fmt: skip
    tops = []
    for device in ("cpu", "cuda"):
        case, cache = sparse_case(sc, seed=2, dtype=torch.float32, device=device, index=INDEX)
        gen = torch.Generator().manual_seed(9)
        keys = torch.randn(sum(sc.seq_lens), 128, generator=gen)
        q = torch.randn(case.metadata.num_tokens, 64, 128, generator=gen)
        w = torch.randn(case.metadata.num_tokens, 64, generator=gen)
        write_index_keys(keys.to(device), cache, full_metadata(case).slot_mapping.to(device))
        tops.append(index_candidates(q.to(device), w.to(device), cache, case.metadata, TOPK))
    cpu, gpu = tops
    torch.testing.assert_close(gpu.scores.cpu(), cpu.scores, rtol=1e-4, atol=1e-4)
    same = (gpu.positions.cpu() == cpu.positions).float().mean().item()
    assert same > 0.99, f"only {same:.3f} of the chosen positions agree"  # near-ties may swap places
