"""MLA backends on CUDA in half precision against the TORCH reference (and the float64 oracle).

DeepSeek's shapes (latent 512, rope 64, nope 128, v 128) at 16 heads, pages of 64. Which backend
runs which case is decided by the backend's own validate_configuration, never restated.
"""

import pytest
import torch

from meshserve.attention.kernels.mla_write import write_latent_kv_triton
from meshserve.attention.mla.backends.torch_ref import TorchMLABackend
from meshserve.attention.mla.cache import LatentCache, write_latent_kv_torch
from meshserve.attention.mla.layer import MLAAttention
from meshserve.attention.registry import BackendKind, load_backend
from meshserve.attention.spec import KVCacheDtype, MLADims
from tests.unit.attention.mla_cases import MLAScenario, make_mla_case
from tests.unit.attention.scenarios import assert_matches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

V3 = MLADims(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
GPU_MLA = (
    MLAScenario("gpu_decode", (1,) * 24, tuple(range(30, 24 * 97, 97)), num_heads=16, dims=V3, block_size=64,
                max_model_len=4096),
    MLAScenario("gpu_mixed", (300, 77, 1, 1, 1), (0, 1000, 2100, 64, 3), num_heads=16, dims=V3, block_size=64,
                max_model_len=4096),
    MLAScenario("gpu_fp8", (20, 1, 1), (50, 900, 33), num_heads=16, dims=V3, block_size=64, max_model_len=4096,
                kv_cache_dtype=KVCacheDtype.FP8_E4M3),
    MLAScenario("gpu_128_heads", (1,) * 8, (4000, 17, 900, 2500, 64, 65, 1, 3000), num_heads=128, dims=V3,
                block_size=64, max_model_len=4096),
)  # fmt: skip


def _run(attn: MLAAttention, case):
    plan = attn.plan(case.metadata)
    attn.write_kv(case.latent, case.k_pe, case.cache, plan)
    return attn.forward(case.query, case.cache, plan, case.weights, return_lse=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("sc", GPU_MLA, ids=lambda s: s.name)
@pytest.mark.parametrize("decode", ["TRITON", "FLASHINFER"])
def test_gpu_mla_matches_reference(sc, decode, dtype):
    name = str(dtype).removeprefix("torch.")
    problem = sc.problem(name, device="cuda")
    cls = load_backend(decode, BackendKind.MLA_DECODE)
    reasons = cls.validate_configuration(problem)
    if reasons:
        pytest.skip(f"{decode}: " + "; ".join(reasons))
    case = make_mla_case(sc, dtype=dtype, device="cuda", seed=7)
    torch_case = make_mla_case(sc, dtype=dtype, device="cuda", seed=7)
    out, lse = _run(MLAAttention(problem, decode_backend=decode, prefill_backend="TRITON"), case)
    ref_out, ref_lse = _run(MLAAttention(problem, decode_backend=TorchMLABackend(problem),
                                         prefill_backend=TorchMLABackend(problem)), torch_case)  # fmt: skip
    assert_matches(out, lse, ref_out.double().cpu(), ref_lse.double().cpu(), dtype)


@pytest.mark.parametrize("kv_dtype", [KVCacheDtype.AUTO, KVCacheDtype.FP8_E4M3, KVCacheDtype.FP8_E5M2])
def test_gpu_write_kernel_is_bit_exact(kv_dtype):
    gen = torch.Generator().manual_seed(4)
    caches = [LatentCache.allocate(8, 64, V3, dtype=torch.bfloat16, kv_cache_dtype=kv_dtype, scale=0.05,
                                   device="cuda") for _ in range(2)]  # fmt: skip
    latent = (torch.randn(300, 512, generator=gen) * 30).to(torch.bfloat16).cuda()
    latent[0, :3] = torch.tensor([7.9, -15.9, 31.9]) * 0.05  # rounding carries into the next power of two
    k_pe = torch.randn(300, 64, generator=gen).to(torch.bfloat16).cuda()
    slots = torch.randperm(512, generator=gen)[:300].cuda()
    slots[::7] = -1
    write_latent_kv_torch(latent, k_pe, caches[0], slots)
    write_latent_kv_triton(latent, k_pe, caches[1], slots)
    assert torch.equal(caches[0].data.view(torch.uint8), caches[1].data.view(torch.uint8))


@pytest.mark.parametrize("value_split", [1, 2])
@pytest.mark.parametrize("sc", [s for s in GPU_MLA if s.name != "gpu_mixed"], ids=lambda s: s.name)
def test_gpu_flashmla_decode_kernel_matches_reference(sc, value_split):
    """The FlashMLA-structured TRITON decode kernel (a config switch, not the default) in bf16."""
    from meshserve.attention.mla.backends.triton_common import flashmla_decode_config
    from meshserve.attention.mla.backends.triton_decode import TritonMLADecodeBackend

    problem = sc.problem("bfloat16", device="cuda")
    reasons = TritonMLADecodeBackend.validate_configuration(problem)
    if reasons:
        pytest.skip("; ".join(reasons))
    cfg = flashmla_decode_config(sc.num_heads, "bfloat16", "cuda", value_split=value_split)
    case = make_mla_case(sc, dtype=torch.bfloat16, device="cuda", seed=9)
    torch_case = make_mla_case(sc, dtype=torch.bfloat16, device="cuda", seed=9)
    decode = TritonMLADecodeBackend(problem, config=cfg)
    out, lse = _run(MLAAttention(problem, decode_backend=decode, prefill_backend="TRITON"), case)
    ref_out, ref_lse = _run(MLAAttention(problem, decode_backend=TorchMLABackend(problem),
                                         prefill_backend=TorchMLABackend(problem)), torch_case)  # fmt: skip
    assert_matches(out, lse, ref_out.double().cpu(), ref_lse.double().cpu(), torch.bfloat16)
