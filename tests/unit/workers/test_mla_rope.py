"""MLA's fused q/k_pe rotation and latent norm (Triton interpreter on CPU) against the torch ops
they replace (YarnRotary.apply on k_pe and q's rope part, then torch.cat; kv_a_layernorm), and
against float64 oracles.

fp32 and fp16 only: bf16 arithmetic is wrong in the interpreter (tests/gpu covers bf16). The
kernel rounds every product and sum of the rotation as torch's ops do, so it must equal them bit
for bit; the latent norm sums its squares in another order than torch: within float32 rounding
of it (and of the float64 norm).
"""

import pytest
import torch

from meshserve.workers.models.fused_ops import rms_norm
from meshserve.workers.models.mla_rope import rotary_mla_qk

HEADS, NOPE, ROPE, RANK = 5, 12, 8, 16  # 5 heads: a partly filled head block
LAYOUTS = [True, False]
EPS = 1e-6


def _case(tokens: int, dtype: torch.dtype, seed: int, *, pad: int = 0, stacked: bool = False):
    """q as the model passes it: a [T, H, nope + rope] view of a projection's output rows (pad:
    extra values per row, so that q's rows are strided); compressed [T, rank + rope]; the tables.
    stacked: q and compressed are views of one [T, q + rank + rope] buffer, as MLA's q_kv_a_proj
    output (both with row stride q + rank + rope)."""
    g = torch.Generator().manual_seed(seed)
    q_width = HEADS * (NOPE + ROPE)
    rows = torch.randn(tokens, q_width + pad + (RANK + ROPE if stacked else 0), generator=g).to(dtype)
    q = rows[:, :q_width].view(tokens, HEADS, NOPE + ROPE)
    compressed = rows[:, q_width + pad :] if stacked else torch.randn(tokens, RANK + ROPE, generator=g).to(dtype)
    angles = torch.rand(tokens, 1, ROPE // 2, generator=g, dtype=torch.float64) * 6.3
    scale = 1.3  # YaRN's attention factor multiplies the tables
    return q, compressed, (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def _weight(dtype: torch.dtype, rank: int = RANK) -> torch.Tensor:
    """kv_a_layernorm's weight: away from one, so that a missing scale shows."""
    return (0.5 + torch.rand(rank, generator=torch.Generator().manual_seed(9))).to(dtype)


def _norm_oracle(compressed, weight):
    """kv_a_layernorm in float64: x / sqrt(mean(x^2) + eps) * w."""
    x = compressed[:, :RANK].double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()


def _torch_ops(q, compressed, cos, sin, interleaved):
    """What MLAttention ran before the kernel: YarnRotary.apply's ops, then the cat."""
    def apply(x):
        x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., : ROPE // 2], x[..., ROPE // 2 :])
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return torch.cat((q[..., :NOPE], apply(q[..., NOPE:])), dim=-1), apply(compressed[:, None, RANK:])[:, 0]


def _oracle(x, cos, sin, interleaved):
    """Exact rotation in float64, the halves layout the model stores (even pair members first)."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@pytest.mark.parametrize("interleaved", LAYOUTS, ids=["interleaved", "halves"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("stacked", [False, True], ids=["apart", "stacked"])
def test_kernel_equals_the_torch_ops(interleaved, dtype, tokens, stacked):
    q, compressed, cos, sin = _case(tokens, dtype, seed=tokens, pad=3, stacked=stacked)
    weight = _weight(dtype)
    compressed_before = compressed.clone()
    want_q, want_k = _torch_ops(q, compressed, cos, sin, interleaved)
    want_latent = rms_norm(compressed[:, :RANK], weight, EPS, use_triton=False)  # kv_a_layernorm's torch path
    got_q, got_k, got_latent = rotary_mla_qk(q, compressed, cos, sin, weight, kv_lora_rank=RANK,
                                             interleaved=interleaved, eps=EPS, use_triton=True)  # fmt: skip
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place: q's nope values are not copied
    assert got_k.shape == (tokens, ROPE) and got_k.is_contiguous() and got_k.dtype == dtype
    assert got_latent.shape == (tokens, RANK) and got_latent.is_contiguous() and got_latent.dtype == dtype
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(compressed, compressed_before)  # the latent's source is left alone
    # And the rotation and the norm themselves are right (not only equal to the reference's ops).
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(got_k.double(), _oracle(compressed[:, None, RANK:], cos, sin, interleaved)[:, 0], **tol)
    torch.testing.assert_close(got_latent.double(), _norm_oracle(compressed, weight), **tol)
    # One float32 rounding of the squares' sum apart from torch's: at most one unit in the last place.
    ulp = dict(atol=1e-6, rtol=2e-7) if dtype == torch.float32 else dict(atol=1e-5, rtol=2**-10)
    torch.testing.assert_close(got_latent, want_latent, **ulp)


@pytest.mark.parametrize("interleaved", LAYOUTS, ids=["interleaved", "halves"])
def test_torch_path_is_yarn_rotary_apply_and_cat(interleaved):
    q, compressed, cos, sin = _case(4, torch.float32, seed=3)
    weight = _weight(torch.float32)
    before = q.clone()
    got_q, got_k, got_latent = rotary_mla_qk(q, compressed, cos, sin, weight, kv_lora_rank=RANK,
                                             interleaved=interleaved, eps=EPS, use_triton=False)  # fmt: skip
    want_q, want_k = _torch_ops(before, compressed, cos, sin, interleaved)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(got_latent, rms_norm(compressed[:, :RANK], weight, EPS, use_triton=False))
    assert torch.equal(q, before)  # the torch path returns new tensors
    torch.testing.assert_close(got_q[..., NOPE:].double(), _oracle(before[..., NOPE:], cos, sin, interleaved))
    torch.testing.assert_close(got_latent.double(), _norm_oracle(compressed, weight))


def test_latent_norm_at_deepseeks_rank_and_a_ragged_one():
    """kv_lora_rank 512 (a full power-of-two block) and 40 (a masked tail): the kernel's latent
    against float64, and a scale of the weight scales the output (the weight is read)."""
    for rank in (512, 40):
        g = torch.Generator().manual_seed(rank)
        rows = torch.randn(3, HEADS * (NOPE + ROPE) + rank + ROPE, generator=g) * 3
        q, compressed = rows[:, : HEADS * (NOPE + ROPE)].view(3, HEADS, NOPE + ROPE), rows[:, HEADS * (NOPE + ROPE):]
        cos, sin = torch.ones(3, ROPE // 2), torch.zeros(3, ROPE // 2)
        weight = _weight(torch.float32, rank)
        _, _, latent = rotary_mla_qk(q, compressed, cos, sin, weight, kv_lora_rank=rank, interleaved=False,
                                     eps=EPS, use_triton=True)  # fmt: skip
        x = compressed[:, :rank].double()
        want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
        torch.testing.assert_close(latent.double(), want, atol=1e-5, rtol=1e-5)
        _, _, doubled = rotary_mla_qk(q, compressed, cos, sin, 2 * weight, kv_lora_rank=rank, interleaved=False,
                                      eps=EPS, use_triton=True)  # fmt: skip
        assert torch.equal(doubled, 2 * latent)


def test_kernel_takes_2d_tables_and_no_tokens():
    q, compressed, cos, sin = _case(3, torch.float32, seed=5)
    weight = _weight(torch.float32)
    want_q, want_k = _torch_ops(q, compressed, cos, sin, True)
    got_q, got_k, _ = rotary_mla_qk(q, compressed, cos[:, 0], sin[:, 0], weight, kv_lora_rank=RANK,
                                    interleaved=True, eps=EPS, use_triton=True)  # fmt: skip
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    q, compressed, cos, sin = _case(0, torch.float32, seed=5)
    got_q, got_k, latent = rotary_mla_qk(q, compressed, cos, sin, weight, kv_lora_rank=RANK, interleaved=True,
                                         eps=EPS, use_triton=True)  # fmt: skip
    assert got_q.shape == (0, HEADS, NOPE + ROPE) and got_k.shape == (0, ROPE) and latent.shape == (0, RANK)


@pytest.mark.parametrize(("change", "field"), [
    (lambda q, c, cos, sin, w: (q, c, cos.half(), sin, w), "dtypes"),
    (lambda q, c, cos, sin, w: (q, c[:, :-1], cos, sin, w), "rope dim"),
    (lambda q, c, cos, sin, w: (q, c, cos[:, :, :2], sin, w), "cos/sin"),
    (lambda q, c, cos, sin, w: (q.transpose(1, 2), c, cos, sin, w), "q"),
    (lambda q, c, cos, sin, w: (q, c, cos, sin, w[:-1]), "norm_weight"),
])  # fmt: skip
def test_bad_inputs_name_the_field(change, field):
    q, compressed, cos, sin, weight = change(*_case(2, torch.float32, seed=1), _weight(torch.float32))
    before = q.clone()
    with pytest.raises(ValueError, match=field):
        rotary_mla_qk(q, compressed, cos, sin, weight, kv_lora_rank=RANK, interleaved=True, eps=EPS, use_triton=True)
    assert torch.equal(q, before)  # nothing written


@pytest.mark.parametrize(("name", "overrides"), [("deepseek_v2", {}), ("deepseek_v3", {"rope_interleave": False})],
                         ids=["v2-interleaved", "v3-halves"])
def test_deepseek_on_the_fused_kernels_matches_the_torch_ops(tmp_path, monkeypatch, name, overrides):
    """The model's CUDA wiring (this kernel with the latent norm, the residual adds in the norms),
    run in the interpreter by making the fused ops take the Triton path."""
    from meshserve.workers.models import deepseek, fused_ops
    from tests.deepseek_models import write_deepseek
    from tests.unit.workers.test_fused_ops import step_logits

    write_deepseek(tmp_path, name, **overrides)
    want = step_logits(tmp_path, backend="TORCH")
    calls = []
    monkeypatch.setattr(fused_ops, "runs_triton", lambda x: True)
    monkeypatch.setattr(deepseek, "rotary_mla_qk", lambda *a, **kw: calls.append(1) or rotary_mla_qk(*a, **kw))
    got = step_logits(tmp_path, backend="TORCH")
    assert len(got) == len(want) == 2 and len(calls) == 2 * 2  # two steps, two layers
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from meshserve.workers.models.mla_rope import _mla_rope_kernel
out = {}
for interleaved in (True, False):
    sig = {n: "*bf16" for n in ("q_ptr", "c_ptr", "k_ptr", "cos_ptr", "sin_ptr", "w_ptr", "lat_ptr")}
    sig |= {n: "i32" for n in ("stride_qt", "stride_qh", "stride_ct", "stride_cos", "stride_sin", "num_heads",
                               "rank")}
    sig["eps"] = "fp32"
    consts = dict(NOPE=128, RANK=512, HALF=32, BLOCK_H=16, BLOCK_HALF=32, BLOCK_RANK=512, INTERLEAVED=interleaved)
    sig |= {n: "constexpr" for n in consts}
    src = ASTSource(_mla_rope_kernel, sig, constexprs=consts)
    options = {"num_warps": 4, "enable_fp_fusion": False}
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    out[str(interleaved)] = [ptx.count("bar.sync"), ptx.count("fma.")]
print(json.dumps(out))
"""


def test_kernel_compiles_for_sm90_without_fma(tmp_path):
    """The interpreter accepts code the GPU compiler refuses: compile for sm_90 here (no GPU
    needed). No product may fuse into an FMA (torch rounds each); the interleaved variant, which
    stores to values other threads loaded, waits at one barrier more than the halves variant,
    whose one barrier is the latent norm's sum across warps."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts == {"True": [2, 0], "False": [1, 0]}
