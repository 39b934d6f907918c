"""The fused decoder-layer kernels on CUDA at model sizes, bf16 included (the interpreter
computes bf16 wrongly), and the model on them against its unfused torch ops; skipped without
CUDA. The kernels' CPU tests (interpreter, float64 oracle) are tests/unit/workers/test_fused_ops.py.
"""

import importlib.util

import pytest
import torch

from meshserve.attention.backend import KVCache
from meshserve.attention.kernels.write_kv import write_kv
from meshserve.attention.spec import AttentionSpec
from meshserve.workers.models import fused_ops
from meshserve.workers.models.arch import RopeScaling
from meshserve.workers.models.rope import RotaryEmbedding
from tests.tiny_models import write_checkpoint
from tests.unit.workers.test_fused_ops import step_logits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Against the float64 oracle a kernel is off by its single rounding; against the torch ops by
# those ops' extra roundings too (act(gate), and x * cos and rotate_half(x) * sin, each rounded
# before they are added: up to an ulp of the terms where the sum cancels, hence TORCH_TOL's atol).
TOL = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=4e-3, rtol=4e-3),
       torch.float32: dict(atol=2e-5, rtol=2e-5)}
TORCH_TOL = TOL | {torch.bfloat16: dict(atol=6e-2, rtol=2e-2), torch.float16: dict(atol=8e-3, rtol=4e-3)}


def _randn(*shape, dtype, scale=1.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [2048, 5120, 16384])
@pytest.mark.parametrize("unit_offset", [False, True], ids=["plain", "unit_offset"])
def test_add_rms_norm_on_cuda(dtype, hidden, unit_offset):
    x, residual = _randn(257, hidden, dtype=dtype, scale=2.0), _randn(257, hidden, dtype=dtype, seed=1)
    weight = _randn(hidden, dtype=dtype, scale=0.3, seed=2) + (0 if unit_offset else 1)
    out, total = fused_ops.add_rms_norm(x, residual, weight, 1e-6, unit_offset=unit_offset)
    assert torch.equal(total, x + residual)
    s = total.double()
    want = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * (weight.double() + unit_offset)
    torch.testing.assert_close(out.double(), want, **TOL[dtype])
    ref, _ = fused_ops.add_rms_norm(x, residual, weight, 1e-6, unit_offset=unit_offset, use_triton=False)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    one = fused_ops.rms_norm(x, weight, 1e-6, unit_offset=unit_offset)
    torch.testing.assert_close(one, fused_ops.rms_norm(x, weight, 1e-6, unit_offset=unit_offset, use_triton=False),
                               **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", sorted(fused_ops.TORCH_ACTIVATIONS))
def test_act_and_mul_on_cuda(dtype, act):
    gate_up = _randn(300, 2 * 14336, dtype=dtype, scale=3.0)
    out = fused_ops.act_and_mul(gate_up, act)
    torch.testing.assert_close(out, fused_ops.act_and_mul(gate_up, act, use_triton=False), **TORCH_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [1408, 10944])  # DeepSeek-V2-Lite's routed/shared experts (x2) and dense MLP
def test_silu_and_mul_round_act_is_torch_bit_for_bit(dtype, inter):
    """DeepSeek's GatedMLP: the fused kernel (round_act) must equal F.silu(gate) * up exactly."""
    gate_up = _randn(64, 2 * inter, dtype=dtype, scale=4.0)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -1e-3])  # saturation and the origin
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(fused_ops.act_and_mul(gate_up, "silu", round_act=True), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("tokens", [1, 8, 64, 512])
@pytest.mark.parametrize("inter", [1408 * 2, 10944])  # DeepSeek-V2-Lite: shared experts, dense layer 0
def test_deepseek_mlp_fused_gate_up_matches_the_unfused_mlp(tokens, inter):
    """One gate_up GEMM and the round_act kernel against HF's gate GEMM, up GEMM, silu, mul (bf16),
    and both against float64. Not bit for bit: cuBLAS may reduce a [2I] GEMM's K in another order
    (another split-K choice) than an [I] one, which moves a bf16 output by one rounding."""
    from meshserve.workers.models.moe import GatedMLP

    mlp = GatedMLP(2048, inter).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(_randn(*p.shape, dtype=torch.bfloat16, scale=0.02))
        x = _randn(tokens, 2048, dtype=torch.bfloat16, scale=1.0)
        gate, up = mlp.gate_up_proj.weight.chunk(2)
        F = torch.nn.functional
        want = mlp.down_proj(F.silu(F.linear(x, gate)) * F.linear(x, up))
        got = mlp(x)
        g64, u64 = (F.linear(x.double(), w.double()) for w in (gate, up))
        ref = F.linear(F.silu(g64) * u64, mlp.down_proj.weight.double())
        scale = ref.abs().max().item()
        for out in (got, want):  # the same bf16 error budget for both formulations
            torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2 * scale)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-2 * scale)


@pytest.mark.parametrize("tokens", [1, 8, 256])
@pytest.mark.parametrize(("hidden", "k", "shared"), [(2048, 6, True), (2880, 4, False), (7168, 8, True)],
                         ids=["v2_lite", "gpt_oss", "v3"])  # fmt: skip
def test_add_rms_norm_forms_a_deferred_moe_sum_as_torch_bit_for_bit(tokens, hidden, k, shared):
    """bf16 MoE rows (weighted like the router's: 0..1) summed inside the norm, against the MoE's
    own torch.sum over k (+ shared experts) then the norm: equal bit for bit (docs/engine.md:
    the float32 partial sums are exact for bf16 rows within about 2^13 of each other)."""
    parts = _randn(tokens, k, hidden, dtype=torch.float32, scale=0.3, seed=1)
    parts = (parts * torch.rand(tokens, k, 1, device="cuda")).to(torch.bfloat16)
    extra = _randn(tokens, hidden, dtype=torch.bfloat16, scale=0.3, seed=2) if shared else None
    residual = _randn(tokens, hidden, dtype=torch.bfloat16, scale=1.0, seed=3)
    weight = _randn(hidden, dtype=torch.bfloat16, scale=1.0, seed=4)
    deferred = fused_ops.DeferredSum(parts, extra)
    out, total = fused_ops.add_rms_norm(deferred, residual, weight, 1e-6)
    want_out, want_total = fused_ops.add_rms_norm(deferred.total(), residual, weight, 1e-6)
    assert int((total != want_total).sum()) == 0 and int((out != want_out).sum()) == 0


def _fp8_ok() -> bool:
    return torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(32, 8, 128), (8, 1, 64), (16, 8, 256)])
@pytest.mark.parametrize("fp8", [False, True], ids=["cache_dtype", "fp8_e4m3"])
def test_rotary_qk_write_kv_on_cuda(dtype, heads, kv_heads, dim, fp8):
    if fp8 and not _fp8_ok():
        pytest.skip("FP8 caches need compute capability >= 8.9")
    tokens, blocks, page = 300, 40, 16
    qkv = _randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    positions = torch.randint(0, 4000, (tokens,), device="cuda")
    rotary = RotaryEmbedding(RopeScaling(theta=500000.0), dim, 4096)
    rotary.reset_tables("cuda")
    cos, sin = rotary(positions, dtype)
    slots = torch.randperm(blocks * page, device="cuda")[:tokens]
    slots[::7] = -1
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    scales = (torch.tensor(0.02, device="cuda"), torch.tensor(0.01, device="cuda"))

    def cache():
        return KVCache(torch.zeros(blocks, 2, page, kv_heads, dim, device="cuda").to(cache_dtype), *scales)

    fused_cache, ref_cache = cache(), cache()
    q, k, v = fused_ops.rotary_qk_write_kv(qkv, cos, sin, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                                           kv_cache=fused_cache, slot_mapping=slots)
    # The cache holds exactly what write_kv stores for the returned k and v.
    write_kv(AttentionSpec(num_heads=heads, num_kv_heads=kv_heads, head_size=dim), k, v, ref_cache, slots)
    assert torch.equal(fused_cache.data.view(torch.uint8), ref_cache.data.view(torch.uint8))
    ref_q, ref_k, ref_v = fused_ops.rotary_qk_write_kv(
        qkv, cos, sin, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, kv_cache=cache(), slot_mapping=slots,
        use_triton=False)
    torch.testing.assert_close(q, ref_q, **TORCH_TOL[dtype])
    torch.testing.assert_close(k, ref_k, **TORCH_TOL[dtype])
    assert torch.equal(v, ref_v)


@pytest.mark.parametrize(("arch", "backend", "dtype"), [
    ("llama", "TRITON", "float32"), ("llama", "TRITON", "bfloat16"), ("gemma2", "TRITON", "bfloat16"),
    ("qwen3", "TRITON", "bfloat16"), ("llama", "FLASHINFER", "bfloat16"),
])
def test_model_on_fused_kernels_matches_unfused_on_cuda(tmp_path, monkeypatch, arch, backend, dtype):
    if backend == "FLASHINFER" and importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not installed")
    write_checkpoint(tmp_path, arch, overrides={"head_dim": 64})  # 64: FlashInfer's head sizes
    got = step_logits(tmp_path, backend=backend, dtype=dtype, device="cuda")
    monkeypatch.setattr(fused_ops, "runs_triton", lambda x: False)
    want = step_logits(tmp_path, backend=backend, dtype=dtype, device="cuda")
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == "float32" else dict(atol=5e-2, rtol=5e-2)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **tol)
