"""MLA at the attention level: spec helpers, the latent cache, and the TORCH reference vs float64."""

import math

import pytest
import torch

from meshserve.attention.mla.backend import MLAWeights
from meshserve.attention.mla.backends.torch_ref import TorchMLABackend
from meshserve.attention.mla.cache import LatentCache, gather_latent, latent_bytes_per_token, write_latent_kv
from meshserve.attention.mla.spec import deepseek_softmax_scale, mla_reasons, mla_spec, yarn_mscale
from meshserve.attention.spec import AttentionSpec, KVCacheDtype, MLADims
from meshserve.errors import ConfigError, NoBackendError
from tests.unit.attention.mla_cases import DIMS, MLA_BY_NAME, MLA_SCENARIOS, make_mla_case, mla_oracle, run_mla
from tests.unit.attention.scenarios import assert_matches

V3 = MLADims(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536)


@pytest.mark.parametrize("sc", MLA_SCENARIOS, ids=lambda s: s.name)
def test_torch_reference_matches_float64_oracle(sc):
    case = make_mla_case(sc)
    out, lse = run_mla(TorchMLABackend(sc.problem()), case)
    ref_out, ref_lse = mla_oracle(case)
    assert_matches(out, lse, ref_out, ref_lse, torch.float32)


def test_absorbed_form_equals_expanded_form_in_float64():
    """The identity the decode kernels rely on: q.(W_UK c) = (W_UK^T q).c and sum p W_UV c = W_UV sum p c."""
    gen = torch.Generator().manual_seed(3)
    heads, n = 3, 11
    w = MLAWeights.from_kv_b_proj(torch.randn(heads * 32, 32, generator=gen, dtype=torch.float64), heads, DIMS)
    latent = torch.randn(n, 32, generator=gen, dtype=torch.float64)
    q_nope = torch.randn(1, heads, 16, generator=gen, dtype=torch.float64)
    k_nope, v = w.expand(latent)
    expanded = torch.einsum("thd,nhd->thn", q_nope, k_nope)
    absorbed = torch.einsum("thr,nr->thn", w.absorb(q_nope), latent)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-12, atol=1e-12)
    p = torch.softmax(expanded, dim=-1)
    o_expanded = torch.einsum("thn,nhv->thv", p, v)
    o_absorbed = w.up_project(torch.einsum("thn,nr->thr", p, latent), torch.float64)
    torch.testing.assert_close(o_absorbed, o_expanded, rtol=1e-12, atol=1e-12)


def test_deepseek_scale_matches_hf_yarn_mscale():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    rope = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096}  # fmt: skip
    assert deepseek_softmax_scale(V3, rope) == pytest.approx(yarn_apply_mscale(rope, 192**-0.5), rel=1e-12)
    assert deepseek_softmax_scale(V3, None) == pytest.approx(192**-0.5)
    assert deepseek_softmax_scale(V3, {"rope_type": "default"}) == pytest.approx(192**-0.5)
    assert yarn_mscale(1.0, 1.0) == 1.0 and yarn_mscale(math.e, 0.5) == pytest.approx(1.05)


def test_mla_spec_shape_and_reasons():
    spec = mla_spec(16, V3, scale=0.1)
    assert (spec.num_kv_heads, spec.head_size, spec.v_size, spec.softmax_scale) == (1, 192, 128, 0.1)
    assert mla_reasons(spec) == []
    plain = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64)
    assert "not an MLA layer" in mla_reasons(plain)[0]
    bad = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=100, mla=V3)
    text = "; ".join(mla_reasons(bad))
    assert "num_kv_heads=2" in text and "head_size=100 != qk_nope_head_dim + qk_rope_head_dim = 192" in text
    with pytest.raises(NoBackendError, match="not an MLA layer"):
        TorchMLABackend(MLA_BY_NAME["small_decode"].problem().__class__(spec=plain))


@pytest.mark.parametrize(("field", "value"), [("kv_lora_rank", 0), ("qk_rope_head_dim", -1), ("v_head_dim", 2.5)])
def test_mla_dims_reject_bad_values(field, value):
    kwargs = dict(kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8) | {field: value}
    with pytest.raises(ConfigError) as err:
        MLADims(**kwargs)
    assert err.value.field == field and "an integer >= 1" in str(err.value)


@pytest.mark.parametrize("kv_dtype", [KVCacheDtype.AUTO, KVCacheDtype.FP8_E4M3, KVCacheDtype.FP8_E5M2])
def test_latent_cache_write_and_gather_round_trip(kv_dtype):
    gen = torch.Generator().manual_seed(1)
    scale = 0.02 if kv_dtype.is_fp8 else 1.0
    cache = LatentCache.allocate(4, 4, DIMS, dtype=torch.float32, kv_cache_dtype=kv_dtype, scale=scale)
    latent, k_pe = torch.randn(6, 32, generator=gen), torch.randn(6, 8, generator=gen)
    slots = torch.tensor([9, -1, 10, 11, 12, 13])  # block 2 offsets 1..3, then block 3; token 1 skipped
    write_latent_kv(latent, k_pe, cache, slots)
    got_lat, got_pe = gather_latent(cache, torch.tensor([0, 2, 3], dtype=torch.int32), 10)
    keep = slots >= 0
    tol = dict(rtol=0.13, atol=scale) if kv_dtype.is_fp8 else dict(rtol=0, atol=0)
    torch.testing.assert_close(got_lat[5:10], latent[keep], **tol)
    torch.testing.assert_close(got_pe[5:10], k_pe[keep], **tol)
    assert cache.data[0].float().abs().sum() == 0 and cache.data[2, 0].float().abs().sum() == 0


def test_latent_cache_errors_name_the_field():
    cache = LatentCache.allocate(2, 4, DIMS, dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"latent=\(3, 31\)"):
        write_latent_kv(torch.zeros(3, 31), torch.zeros(3, 8), cache, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ConfigError, match="k_pe"):
        write_latent_kv(torch.zeros(3, 32), torch.zeros(2, 8), cache, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        LatentCache(torch.zeros(2, 4, 40), 40)


def test_latent_cache_is_far_smaller_than_expanded_kv():
    per_token = latent_bytes_per_token(V3, torch.bfloat16, KVCacheDtype.AUTO)
    assert per_token == 576 * 2
    assert latent_bytes_per_token(V3, torch.bfloat16, KVCacheDtype.FP8_E4M3) == 576
    expanded = 2 * 128 * 128 * 2 * 2  # K (nope part alone) and V for 128 heads, bf16
    assert expanded / per_token > 50


def test_weights_from_kv_b_proj_checks_shape():
    with pytest.raises(ConfigError, match="kv_b_proj.weight"):
        MLAWeights.from_kv_b_proj(torch.zeros(10, 32), 4, DIMS)
    w = torch.arange(2 * 32 * 32, dtype=torch.float32).view(64, 32)
    split = MLAWeights.from_kv_b_proj(w, 2, DIMS)
    assert torch.equal(split.w_uk[1], w[32:48]) and torch.equal(split.w_uv[1], w[48:64])
