"""The fused decoder-layer kernels (Triton interpreter on CPU) against a float64 oracle and
against their torch path (the unfused ops the model runs on CPU).

fp32 and fp16 only: bf16 arithmetic is wrong in the interpreter (tests/gpu covers bf16).
"""

import pytest
import torch

from meshserve.attention.backend import KVCache
from meshserve.attention.backends.torch_ref import quantize_fp8
from meshserve.attention.kernels.write_kv import write_kv
from meshserve.attention.spec import AttentionSpec
from meshserve.errors import ConfigError
from meshserve.workers.models.arch import RopeScaling
from meshserve.workers.models.fused_ops import (
    TORCH_ACTIVATIONS,
    act_and_mul,
    add_rms_norm,
    rms_norm,
    rotary_qk_write_kv,
)
from meshserve.workers.models.rope import RotaryEmbedding, apply_rotary

DTYPES = [torch.float32, torch.float16]
TOKENS = [1, 5, 33]
# Tolerances against the float64 oracle: a kernel rounds once (half an ulp), plus float32 math.
ORACLE_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-3, rtol=1e-3)}
# Against the torch path, which rounds intermediate results to the activation dtype too.
TORCH_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=4e-3, rtol=4e-3)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _oracle_norm(s: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    s = s.double()
    scale = weight.double() + (1.0 if unit_offset else 0.0)
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * scale


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", [64, 300])
@pytest.mark.parametrize("unit_offset", [False, True], ids=["plain", "unit_offset"])
def test_add_rms_norm(dtype, tokens, hidden, unit_offset):
    g = _gen(tokens * hidden)
    x = (torch.randn(tokens, hidden, generator=g) * 2).to(dtype)
    residual = torch.randn(tokens, hidden, generator=g).to(dtype)
    weight = (torch.randn(hidden, generator=g) * 0.3 + (0.0 if unit_offset else 1.0)).to(dtype)
    out, total = add_rms_norm(x, residual, weight, 1e-6, unit_offset=unit_offset, use_triton=True)
    assert out.dtype == total.dtype == dtype and out.shape == total.shape == x.shape
    assert torch.equal(total, x + residual)  # the sum is rounded to the activation dtype, as the model adds
    want = _oracle_norm(total, weight, 1e-6, unit_offset)
    torch.testing.assert_close(out.double(), want, **ORACLE_TOL[dtype])
    ref_out, ref_total = add_rms_norm(x, residual, weight, 1e-6, unit_offset=unit_offset, use_triton=False)
    assert torch.equal(ref_total, total)
    torch.testing.assert_close(out, ref_out, **TORCH_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("unit_offset", [False, True], ids=["plain", "unit_offset"])
def test_rms_norm(dtype, tokens, unit_offset):
    hidden = 200
    g = _gen(tokens)
    x = (torch.randn(tokens, hidden, generator=g) * 3).to(dtype)
    weight = (torch.randn(hidden, generator=g) * 0.3 + (0.0 if unit_offset else 1.0)).to(dtype)
    out = rms_norm(x, weight, 1e-5, unit_offset=unit_offset, use_triton=True)
    torch.testing.assert_close(out.double(), _oracle_norm(x, weight, 1e-5, unit_offset), **ORACLE_TOL[dtype])
    torch.testing.assert_close(out, rms_norm(x, weight, 1e-5, unit_offset=unit_offset, use_triton=False),
                               **TORCH_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_of_heads_read_in_place_from_a_strided_qkv_view(dtype):
    """q/k norms: [T, H, D] views of the qkv projection, whose rows are not evenly spaced."""
    tokens, heads, kv_heads, dim = 5, 3, 1, 24
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=_gen(2)).to(dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    weight = torch.randn(dim, generator=_gen(3)).to(dtype)
    for x in (q, k):
        out = rms_norm(x, weight, 1e-6, use_triton=True)
        assert out.shape == x.shape and out.is_contiguous()
        torch.testing.assert_close(out.double(), _oracle_norm(x, weight, 1e-6, False), **ORACLE_TOL[dtype])


@pytest.mark.parametrize("shape", [(1, 256), (16, 200), (64, 4096), (5, 3, 24)], ids=str)
def test_float32_torch_norm_is_f_rms_norm(shape):
    """The CPU float32 path (6 dispatches instead of F.rms_norm's 13) against the float64 oracle
    and against F.rms_norm itself (the op the model ran before, HF's math), on contiguous rows
    and on a strided q/k-norm view of a qkv tensor."""
    g = _gen(len(shape))
    base = torch.randn(*shape[:-1], 2 * shape[-1], generator=g) * 3
    for x in (base[..., : shape[-1]].contiguous(), base[..., : shape[-1]]):  # contiguous, then strided
        weight = torch.randn(shape[-1], generator=g)
        out = rms_norm(x, weight, 1e-6, use_triton=False)
        assert out.shape == x.shape and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), _oracle_norm(x, weight, 1e-6, False), **ORACLE_TOL[torch.float32])
        torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (shape[-1],), weight, 1e-6),
                                   atol=0, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 16])
def test_apply_rotary_is_hf_rotate_half_bit_for_bit(dtype, tokens):
    """apply_rotary's roll and in-place negation give exactly HF's x * cos + rotate_half(x) * sin
    (cat of -x2 and x1), on contiguous heads and on a strided view of a qkv tensor."""
    g = _gen(tokens)
    qkv = (torch.randn(tokens, 9, 64, generator=g) * 4).to(dtype)
    cos, sin = (torch.randn(tokens, 1, 64, generator=g).to(dtype) for _ in range(2))
    before = qkv.clone()
    for x in (qkv[:, :6].contiguous(), qkv[:, :6]):
        rotate_half = torch.cat((-x[..., 32:], x[..., :32]), dim=-1)
        assert torch.equal(apply_rotary(x, cos, sin), x * cos + rotate_half * sin)
    assert torch.equal(qkv, before)  # the in-place negation works on the rolled copy, not the input


def _oracle_act(name: str, gate: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return gate * torch.sigmoid(gate)
    if name == "gelu":
        return 0.5 * gate * (1 + torch.erf(gate / 2**0.5))
    return 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("deferred", [False, True], ids=["tensor", "deferred"])
def test_add_rms_norm_float_writes_the_output_again_in_float32(dtype, deferred):
    """DeepSeek's norm before the MoE router: the kernel stores out and out.float() (exactly)."""
    from meshserve.workers.models.fused_ops import DeferredSum, add_rms_norm_float

    g = _gen(3 + deferred)
    T, N = 4, 200
    x = torch.randn(T, N, generator=g).to(dtype)
    given = DeferredSum(torch.randn(T, 2, N, generator=g).to(dtype), x) if deferred else x
    residual, weight = torch.randn(T, N, generator=g).to(dtype), torch.randn(N, generator=g).to(dtype)
    out, total, out_float = add_rms_norm_float(given, residual, weight, 1e-6, use_triton=True)
    want_out, want_total = add_rms_norm(given, residual, weight, 1e-6, use_triton=True)
    assert torch.equal(out, want_out) and torch.equal(total, want_total)
    assert out_float.dtype == torch.float32 and torch.equal(out_float, out.float())
    cpu = add_rms_norm_float(given, residual, weight, 1e-6, use_triton=False)
    assert torch.equal(cpu[2], cpu[0].float())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [1, 2, 6])
@pytest.mark.parametrize("extra", [False, True], ids=["routed", "routed+shared"])
def test_add_rms_norm_sums_a_deferred_moe_output_as_torch_did(dtype, k, extra):
    """An MoE layer's unsummed output (k weighted rows per token, + the shared experts' row) summed
    inside the norm kernel: out and the new residual equal, bit for bit, the kernel run on
    torch.sum over k then `+ extra` (the MoE's own combine before). The kernel adds the k rows in
    order in float32, torch.sum in its own order: the two agree whenever the float32 partial sums
    are exact (bf16 rows within about 2^13 of each other in a column; docs/engine.md), so the rows
    here lie on a grid of 2^-8 below 8 (exact sums, which still round to fp16: 14 bits)."""
    from meshserve.workers.models.fused_ops import DeferredSum

    g = _gen(k + 10 * extra)
    T, N = 5, 300
    parts = (torch.randint(-2047, 2048, (T, k, N), generator=g) / 256).to(dtype)
    shared = torch.randn(T, N, generator=g).to(dtype) if extra else None
    residual, weight = torch.randn(T, N, generator=g).to(dtype), torch.randn(N, generator=g).to(dtype)
    deferred = DeferredSum(parts, shared)
    out, total = add_rms_norm(deferred, residual, weight, 1e-6, use_triton=True)
    want_out, want_total = add_rms_norm(deferred.total(), residual, weight, 1e-6, use_triton=True)
    assert torch.equal(total, want_total) and torch.equal(out, want_out)
    summed = parts.sum(1) if shared is None else parts.sum(1) + shared
    assert torch.equal(deferred.total(), summed)
    cpu_out, cpu_total = add_rms_norm(deferred, residual, weight, 1e-6, use_triton=False)  # the torch path
    assert torch.equal(cpu_total, summed + residual)
    torch.testing.assert_close(cpu_out, want_out, **TORCH_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("inter", [64, 300, 1100])  # 1100: more than one column block
@pytest.mark.parametrize("act", sorted(TORCH_ACTIVATIONS))
def test_act_and_mul(dtype, tokens, inter, act):
    gate_up = (torch.randn(tokens, 2 * inter, generator=_gen(inter + tokens)) * 3).to(dtype)
    gate_up[0, :4] = torch.tensor([-30.0, 30.0, 0.0, -1e-3])  # saturation and the origin
    out = act_and_mul(gate_up, act, use_triton=True)
    assert out.shape == (tokens, inter) and out.dtype == dtype
    gate, up = gate_up.double().chunk(2, dim=-1)
    torch.testing.assert_close(out.double(), _oracle_act(act, gate) * up, **ORACLE_TOL[dtype])
    torch.testing.assert_close(out, act_and_mul(gate_up, act, use_triton=False), **TORCH_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 5])
def test_silu_and_mul_round_act_is_the_torch_ops(dtype, tokens):
    """round_act (DeepSeek's MLPs): silu(gate) rounded before the product, as torch's CUDA
    F.silu(gate) * up computes it (x / (1 + exp(-x)) in float32, rounded, times up, rounded).
    Here the interpreter's exp (numpy's) meets torch's CPU exp: an ulp apart at times, which a
    near-tie of the rounding can show; on the GPU both are CUDA's expf, and tests/gpu checks the
    kernel bit for bit against F.silu(gate) * up, bf16 included. So: fp16 equal but for a few in
    a thousand; fp32 (no rounding to absorb the exp's ulp) within an ulp or two."""
    gate_up = (torch.randn(tokens, 2 * 1100, generator=_gen(tokens)) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -1e-3])  # saturation and the origin
    out = act_and_mul(gate_up, "silu", round_act=True, use_triton=True)
    gate, up = gate_up.float().chunk(2, dim=-1)
    want = ((gate / (1.0 + torch.exp(-gate))).to(dtype).float() * up).to(dtype)
    if dtype == torch.float16:
        assert (out != want).float().mean() < 2e-3
    torch.testing.assert_close(out, want, rtol=2 * torch.finfo(dtype).eps, atol=0)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(act_and_mul(gate_up, "silu", round_act=True, use_triton=False),
                       torch.nn.functional.silu(gate) * up)
    with pytest.raises(ConfigError, match="round_act"):
        act_and_mul(gate_up, "gelu", round_act=True)


# -------------------------------------------------------------------------- rotary + KV write
NUM_BLOCKS, PAGE = 6, 16
NUM_HEADS, NUM_KV_HEADS = 4, 2


def _rotary_case(tokens: int, dim: int, dtype: torch.dtype, cache_dtype: torch.dtype, seed: int):
    g = _gen(seed)
    qkv = torch.randn(tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * dim, generator=g).to(dtype)
    positions = torch.randint(0, 500, (tokens,), generator=g)
    cos, sin = RotaryEmbedding(RopeScaling(theta=10000.0), dim, 512)(positions, dtype)  # [T, 1, D] each
    # Slots anywhere in a shuffled set of blocks, some tokens skipped (-1).
    slots = torch.randperm(NUM_BLOCKS * PAGE, generator=g)[:tokens]
    slots[torch.rand(tokens, generator=g) < 0.25] = -1
    fp8 = cache_dtype.itemsize == 1
    data = torch.full((NUM_BLOCKS, 2, PAGE, NUM_KV_HEADS, dim), 0.5 if not fp8 else 0.0).to(cache_dtype)
    # v_scale small enough that large values saturate at the FP8 maximum.
    cache = KVCache(data, torch.tensor(0.05), torch.tensor(0.003)) if fp8 else KVCache(data)
    return qkv, cos, sin, slots, cache


def _fused(qkv, cos, sin, dim, cache, slots, use_triton):
    return rotary_qk_write_kv(qkv, cos, sin, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=dim,
                              kv_cache=cache, slot_mapping=slots, use_triton=use_triton)


def _oracle_rotary(qkv, cos, sin, dim):
    tokens, half = qkv.shape[0], dim // 2
    x = qkv.double().view(tokens, -1, dim)[:, : NUM_HEADS + NUM_KV_HEADS]
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    out = x * cos.double().view(tokens, 1, dim) + rotated * sin.double().view(tokens, 1, dim)
    return out[:, :NUM_HEADS], out[:, NUM_HEADS:]


def _cache_at(cache: KVCache, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    block, offset = divmod(slot, PAGE)
    return cache.data[block, 0, offset], cache.data[block, 1, offset]


def _assert_cache_holds(cache, slots, k, v):
    """The cache holds exactly what write_kv stores for (k, v) at the slots, and nothing elsewhere."""
    written = set()
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        want_k, want_v = k[t], v[t]
        if cache.is_fp8:
            want_k = quantize_fp8(k[t], cache.k_scale, cache.data.dtype)
            want_v = quantize_fp8(v[t], cache.v_scale, cache.data.dtype)
        got_k, got_v = _cache_at(cache, slot)
        assert torch.equal(got_k.view(torch.uint8) if cache.is_fp8 else got_k,
                           want_k.view(torch.uint8) if cache.is_fp8 else want_k), f"K of token {t}"
        assert torch.equal(got_v.view(torch.uint8) if cache.is_fp8 else got_v,
                           want_v.view(torch.uint8) if cache.is_fp8 else want_v), f"V of token {t}"
        written.add(slot)
    untouched = [s for s in range(NUM_BLOCKS * PAGE) if s not in written]
    flat = cache.data.float().transpose(1, 2).reshape(NUM_BLOCKS * PAGE, 2, -1)
    assert torch.all(flat[untouched] == (0.0 if cache.is_fp8 else 0.5))


CACHE_CASES = [  # (activation dtype, cache dtype, head dim)
    (torch.float32, torch.float32, 16),
    (torch.float16, torch.float16, 40),  # half of 40 is not a power of two: masked lanes
    (torch.float32, torch.float8_e4m3fn, 16),
    (torch.float16, torch.float8_e4m3fn, 40),
]


def _name(value) -> str:
    return str(value).removeprefix("torch.")


@pytest.mark.parametrize(("dtype", "cache_dtype", "dim"), CACHE_CASES, ids=_name)
@pytest.mark.parametrize("tokens", TOKENS)
def test_rotary_qk_write_kv(dtype, cache_dtype, dim, tokens):
    qkv, cos, sin, slots, cache = _rotary_case(tokens, dim, dtype, cache_dtype, seed=tokens + dim)
    qkv[0, -dim:] = 4.0  # a V head past the FP8 maximum (448 * 0.003): saturates
    q, k, v = _fused(qkv, cos, sin, dim, cache, slots, use_triton=True)
    assert q.shape == (tokens, NUM_HEADS, dim) and k.shape == v.shape == (tokens, NUM_KV_HEADS, dim)
    assert q.dtype == k.dtype == v.dtype == dtype
    want_q, want_k = _oracle_rotary(qkv, cos, sin, dim)
    torch.testing.assert_close(q.double(), want_q, **ORACLE_TOL[dtype])
    torch.testing.assert_close(k.double(), want_k, **ORACLE_TOL[dtype])
    assert torch.equal(v, qkv.view(tokens, -1, dim)[:, NUM_HEADS + NUM_KV_HEADS :])
    _assert_cache_holds(cache, slots, k, v)

    # The unfused path: apply_rotary in the activation dtype, then the write_kv kernel.
    *_, ref_cache = _rotary_case(tokens, dim, dtype, cache_dtype, seed=tokens + dim)
    qk = qkv[:, : (NUM_HEADS + NUM_KV_HEADS) * dim].view(tokens, -1, dim)
    ref_q, ref_k = apply_rotary(qk, cos, sin).split([NUM_HEADS, NUM_KV_HEADS], dim=1)
    spec = AttentionSpec(num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_size=dim)
    write_kv(spec, ref_k, v, ref_cache, slots)
    torch.testing.assert_close(q, ref_q, **TORCH_TOL[dtype])
    torch.testing.assert_close(k, ref_k, **TORCH_TOL[dtype])
    # Cached values agree up to one step of the cache's grid (e4m3: 2**-3 relative) where k differs by an ulp.
    fp8_step = 0.125 if cache.is_fp8 else 0.0
    torch.testing.assert_close(cache.data.float(), ref_cache.data.float(),
                               atol=TORCH_TOL[dtype]["atol"], rtol=TORCH_TOL[dtype]["rtol"] + fp8_step)


@pytest.mark.parametrize(("dtype", "cache_dtype", "dim"), [CACHE_CASES[0], CACHE_CASES[2]], ids=_name)
def test_rotary_qk_write_kv_torch_path_is_the_unfused_ops(dtype, cache_dtype, dim):
    """use_triton=False is apply_rotary + the TORCH reference write, bit for bit; [T, D] tables too."""
    qkv, cos, sin, slots, cache = _rotary_case(5, dim, dtype, cache_dtype, seed=7)
    q, k, v = _fused(qkv, cos[:, 0], sin[:, 0], dim, cache, slots, use_triton=False)
    qk = qkv[:, : (NUM_HEADS + NUM_KV_HEADS) * dim].view(5, -1, dim)
    ref_q, ref_k = apply_rotary(qk, cos, sin).split([NUM_HEADS, NUM_KV_HEADS], dim=1)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    _assert_cache_holds(cache, slots, k, v)
    # The kernel accepts the [T, D] form as well.
    *_, cache2 = _rotary_case(5, dim, dtype, cache_dtype, seed=7)
    q2, k2, _ = _fused(qkv, cos[:, 0], sin[:, 0], dim, cache2, slots, use_triton=True)
    torch.testing.assert_close(q2, q, **TORCH_TOL[dtype])
    torch.testing.assert_close(k2, k, **TORCH_TOL[dtype])


# ------------------------------------------------------------------------------ the whole model
def step_logits(path, *, backend: str = "TRITON", dtype: str = "float32", device: str = "cpu") -> list[torch.Tensor]:
    """Logits of a prefill step of two prompts and a decode step (also used by tests/gpu)."""
    from meshserve.config import AttentionConfig, CacheConfig, ModelConfig
    from meshserve.workers.step import NewRequest, ScheduledSeq, StepPlan
    from meshserve.workers.worker import Worker
    from tests.tiny_models import prompts

    worker = Worker(ModelConfig(model=str(path), max_model_len=64, dtype=dtype),
                    CacheConfig(block_size=16, num_kv_blocks=16), AttentionConfig(backend=backend), device=device,
                    progress=False)
    worker.start()
    seen, model = [], worker.runner.model
    compute = model.compute_logits
    model.compute_logits = lambda hidden: seen.append(compute(hidden)) or seen[-1]
    batch, groups = prompts(2, min_len=5, max_len=19), worker.runner.num_groups
    tables = [[[3, 1]] * groups, [[0, 6]] * groups]  # shuffled blocks
    new = [NewRequest(f"r{i}", p, {"temperature": 0.0}) for i, p in enumerate(batch)]
    first = worker.runner.execute(StepPlan.from_seqs(0, [ScheduledSeq(f"r{i}", p, 0, tables[i])
                                               for i, p in enumerate(batch)], new)).sampled
    worker.runner.execute(StepPlan.from_seqs(1, [ScheduledSeq(f"r{i}", [first[i].token_id], len(p), tables[i])
                                       for i, p in enumerate(batch)]))
    return seen


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2"])  # plain, q/k norms, sandwich norms + Gemma
def test_model_on_the_fused_kernels_matches_the_torch_ops(tmp_path, monkeypatch, name):
    """The model's CUDA wiring, run in the interpreter by making the fused ops take the Triton path."""
    from meshserve.workers.models import fused_ops
    from tests.tiny_models import write_checkpoint

    write_checkpoint(tmp_path, name)
    want = step_logits(tmp_path)
    calls = []
    rotary = fused_ops.rotary_qk_write_kv
    monkeypatch.setattr(fused_ops, "runs_triton", lambda x: True)
    monkeypatch.setattr(fused_ops, "rotary_qk_write_kv", lambda *a, **kw: calls.append(1) or rotary(*a, **kw))
    got = step_logits(tmp_path)
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    assert bool(calls) == (name != "qwen3")  # q/k norms keep the backend's own write
