"""A decode step's fused CPU ops (C++) against the unfused torch ops and a float64 oracle:
residual add + RMSNorm, SiLU * up, rotary embedding + K/V write, greedy's argmax; and the model
and the sampler wired to them."""

import pytest
import torch

from meshserve.attention.backend import KVCache
from meshserve.attention.backends import cpu_step_ops
from meshserve.attention.backends.torch_ref import scatter_kv
from meshserve.workers.models import fused_ops
from meshserve.workers.models.rope import apply_rotary


@pytest.fixture(scope="module", autouse=True)
def built():
    if cpu_step_ops.step_ops() is None:
        pytest.skip("the CPU module could not be built here (see the logged warning)")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _oracle_norm(s: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    s = s.double()
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("tokens", [1, 5, 33])
@pytest.mark.parametrize("hidden", [16, 200, 256])  # 200: a tail after the 16-wide lanes
@pytest.mark.parametrize("with_residual", [True, False], ids=["add_norm", "norm"])
def test_add_rms_norm(tokens, hidden, with_residual):
    g = _gen(tokens * hidden)
    x = torch.randn(tokens, hidden, generator=g) * 3
    residual = torch.randn(tokens, hidden, generator=g) if with_residual else None
    weight = torch.randn(hidden, generator=g) * 0.3 + 1.0
    out, total = cpu_step_ops.add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_total = (fused_ops.add_rms_norm(x, residual, weight, 1e-6, use_triton=False) if with_residual
                          else (fused_ops.rms_norm(x, weight, 1e-6, use_triton=False), None))
    if with_residual:
        assert torch.equal(total, ref_total)  # the stream is the float32 sum, exactly as `x + residual`
    else:
        assert total is None
    s = ref_total if with_residual else x
    torch.testing.assert_close(out.double(), _oracle_norm(s, weight, 1e-6), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref_out, atol=2e-6, rtol=2e-6)  # only the sum of squares' order differs


def test_add_rms_norm_keeps_leading_dimensions_and_rejects_mismatches():
    x = torch.randn(2, 3, 32, generator=_gen(1))
    out, _ = cpu_step_ops.add_rms_norm(x, None, torch.ones(32), 1e-5)
    torch.testing.assert_close(out.double(), _oracle_norm(x, torch.ones(32), 1e-5), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        cpu_step_ops.add_rms_norm(x, None, torch.ones(31), 1e-5)
    with pytest.raises(RuntimeError, match="residual"):
        cpu_step_ops.add_rms_norm(x, torch.randn(2, 32), torch.ones(32), 1e-5)


@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("inter", [16, 40, 768])  # 40: a tail
def test_silu_and_mul(tokens, inter):
    g = _gen(inter + tokens)
    gate_up = torch.randn(tokens, 2 * inter, generator=g) * 4
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 90.0, -90.0, 87.5, -120.0])  # zeros, past exp's range both ways
    out = cpu_step_ops.silu_and_mul(gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    want = gate * torch.sigmoid(gate) * up
    torch.testing.assert_close(out.double(), want, atol=1e-6, rtol=2e-6)
    torch.testing.assert_close(out, fused_ops.act_and_mul(gate_up, "silu", use_triton=False), atol=1e-6, rtol=2e-6)


def _rotary_case(tokens: int, heads: int, kv_heads: int, dim: int, seed: int):
    g = _gen(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g)
    angles = torch.rand(tokens, 1, dim // 2, generator=g) * 50
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    slots = torch.randperm(6 * 8, generator=g)[:tokens]
    slots[tokens // 2] = -1  # a token this rank does not store
    return qkv, cos, sin, slots


@pytest.mark.parametrize("tokens", [1, 9])
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 64), (3, 1, 128), (4, 2, 16)])
def test_rotary_write_kv_is_apply_rotary_and_the_reference_write_bit_for_bit(tokens, heads, kv_heads, dim):
    qkv, cos, sin, slots = _rotary_case(tokens, heads, kv_heads, dim, seed=tokens * dim)
    cache = torch.randn(6, 2, 8, kv_heads, dim, generator=_gen(5))
    ref_cache = KVCache(cache.clone())
    q, k, v_out = cpu_step_ops.rotary_write_kv(qkv, cos, sin, cache, slots, heads, kv_heads)
    qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    ref_q, ref_k = apply_rotary(qk, cos, sin).split([heads, kv_heads], dim=1)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    scatter_kv(ref_k, v, ref_cache, slots)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert q.is_contiguous() and k.is_contiguous()
    assert torch.equal(v_out, v) and v_out.data_ptr() == v.data_ptr()  # a view of qkv
    assert torch.equal(cache, ref_cache.data)  # k and v at the kept slots, nothing else touched


def test_rotary_write_kv_refuses_a_slot_outside_the_cache_before_writing():
    qkv, cos, sin, _ = _rotary_case(3, 4, 2, 16, seed=2)
    cache = torch.zeros(2, 2, 4, 2, 16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_step_ops.rotary_write_kv(qkv, cos, sin, cache, torch.tensor([0, 5, 8]), 4, 2)  # 8 slots: 0..7
    assert not cache.any()


@pytest.mark.parametrize("vocab", [1, 5, 16, 37, 4096])
def test_argmax_rows_is_max_indices(vocab):
    """torch's `max(dim).indices` is the oracle: the first maximum, a NaN counting as the largest."""
    g = _gen(vocab)
    x = torch.randn(12, vocab, generator=g)
    x[1] = x[1].round()  # many ties: the first of them
    x[2] = float("-inf")
    x[3, -1] = float("nan")
    if vocab > 3:
        x[4, 2], x[4, vocab - 1] = float("nan"), float("nan")  # the first NaN
        x[5, 1] = x[5].max() + 1  # a maximum in lane 1 of the first 16
        x[6, vocab - 1] = float("inf")
        x[7, 0], x[7, vocab // 2] = 50.0, 50.0  # a tie across lanes and vectors
    assert torch.equal(cpu_step_ops.argmax_rows(x), x.max(dim=-1).indices)
    assert cpu_step_ops.argmax_rows(x[:0]).shape == (0,)


def test_the_sampler_takes_the_compiled_argmax(monkeypatch):
    from meshserve.workers import sampler

    calls = []
    real = sampler.argmax_rows
    monkeypatch.setattr(sampler, "argmax_rows", lambda x: calls.append(1) or real(x))
    logits = torch.randn(4, 300, generator=_gen(8))
    assert torch.equal(sampler.first_max_index(logits), logits.max(dim=-1).indices) and calls == [1]
    assert torch.equal(sampler.first_max_index(logits.double()), logits.double().max(dim=-1).indices)  # torch's


def test_two_threads_give_the_one_thread_result():
    """Rows are split across intra-op threads (at::parallel_for); each is computed the same way."""
    g = _gen(3)
    x, res, w = torch.randn(4096, 64, generator=g), torch.randn(4096, 64, generator=g), torch.randn(64, generator=g)
    gate_up = torch.randn(2048, 256, generator=g)
    logits = torch.randn(512, 4096, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = (*cpu_step_ops.add_rms_norm(x, res, w, 1e-6), cpu_step_ops.silu_and_mul(gate_up),
               cpu_step_ops.argmax_rows(logits))
        torch.set_num_threads(2)
        two = (*cpu_step_ops.add_rms_norm(x, res, w, 1e-6), cpu_step_ops.silu_and_mul(gate_up),
               cpu_step_ops.argmax_rows(logits))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_the_model_takes_the_compiled_ops_on_a_float32_cpu(tmp_path, monkeypatch):
    """Llama through CPU_SDPA: the default path calls the compiled ops (the fused rotary write
    included) and its logits are those of the unfused torch ops within float32 rounding."""
    from tests.tiny_models import write_checkpoint
    from tests.unit.workers.test_fused_ops import step_logits

    write_checkpoint(tmp_path, "llama")
    calls = {"norm": 0, "silu": 0, "rotary": 0}
    for name, key in (("add_rms_norm", "norm"), ("silu_and_mul", "silu"), ("rotary_write_kv", "rotary")):
        real = getattr(cpu_step_ops, name)
        monkeypatch.setattr(cpu_step_ops, name, lambda *a, _r=real, _k=key: calls.__setitem__(_k, calls[_k] + 1)
                            or _r(*a))
    got = step_logits(tmp_path, backend="CPU_SDPA")
    assert all(calls.values()), calls
    monkeypatch.setattr(fused_ops, "_cpu_ops", lambda *a: None)  # the unfused torch ops
    want = step_logits(tmp_path, backend="CPU_SDPA")
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
