"""MLA's fused q/k_pe rotation and latent norm on CUDA at DeepSeek's sizes, bf16 included (the
interpreter computes bf16 wrongly): the rotation bit for bit the torch ops it replaces, both
rope layouts, and enough tokens and heads that a race between the in-place loads and stores
would show; the latent within one unit in the last place of fused_ops.rms_norm (its kernel may
contract the sum of squares into FMAs, this one may not: mla_rope.py). The model on the fused
path against its torch ops. Skipped without CUDA; the CPU tests (interpreter) are
tests/unit/workers/test_mla_rope.py.
"""

import pytest
import torch

from meshserve.workers.models import fused_ops
from meshserve.workers.models.mla_rope import rotary_mla_qk
from tests.deepseek_models import write_deepseek
from tests.unit.workers.test_fused_ops import step_logits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HEADS, NOPE, ROPE, RANK = 16, 128, 64, 512  # DeepSeek-V2-Lite's MLA
EPS = 1e-6
# One unit in the last place, relative (bf16 8 significant bits, fp16 11); float32: a few units
# (the squares' sum, 512 terms, in another association).
ULP = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-20}


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("tokens", [1, 1000])
@pytest.mark.parametrize("stacked", [False, True], ids=["apart", "stacked"])
def test_kernel_equals_the_torch_ops_on_cuda(interleaved, dtype, tokens, stacked):
    """stacked: q and compressed are views of one q_kv_a_proj output row (DeepSeek-V2-Lite's 3648)."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    q_width = HEADS * (NOPE + ROPE)
    rows = torch.randn(tokens, q_width + (RANK + ROPE if stacked else 0), generator=g, device="cuda").to(dtype)
    q = rows[:, :q_width].view(tokens, HEADS, NOPE + ROPE)
    compressed = (rows[:, q_width:] if stacked
                  else torch.randn(tokens, RANK + ROPE, generator=g, device="cuda").to(dtype))  # fmt: skip
    compressed_before = compressed.clone()
    angles = torch.rand(tokens, 1, ROPE // 2, generator=g, device="cuda") * 6.3
    cos, sin = (angles.cos() * 1.2).to(dtype), (angles.sin() * 1.2).to(dtype)
    weight = (0.5 + torch.rand(RANK, generator=g, device="cuda")).to(dtype)
    want_q, want_k, _ = rotary_mla_qk(q, compressed, cos, sin, weight, kv_lora_rank=RANK, interleaved=interleaved,
                                      eps=EPS, use_triton=False)  # fmt: skip
    want_latent = fused_ops.rms_norm(compressed[:, :RANK], weight, EPS)  # kv_a_layernorm's own kernel
    got_q, got_k, got_latent = rotary_mla_qk(q, compressed, cos, sin, weight, kv_lora_rank=RANK,
                                             interleaved=interleaved, eps=EPS)  # fmt: skip
    assert got_q.data_ptr() == q.data_ptr()
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(compressed, compressed_before)  # q's in-place rotation stays in q's part
    torch.testing.assert_close(got_latent, want_latent, atol=1e-6, rtol=ULP[dtype])
    x = compressed[:, :RANK].double()
    exact = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    torch.testing.assert_close(got_latent.double(), exact, atol=1e-5, rtol=max(2 * ULP[dtype], 1e-5))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2"])  # v2: q itself a view of q_kv_a_proj's output
def test_deepseek_on_fused_kernels_matches_unfused_on_cuda(tmp_path, monkeypatch, dtype, name):
    write_deepseek(tmp_path, name)
    got = step_logits(tmp_path, backend="TRITON", dtype=dtype, device="cuda")
    monkeypatch.setattr(fused_ops, "runs_triton", lambda x: False)
    want = step_logits(tmp_path, backend="TRITON", dtype=dtype, device="cuda")
    # The rotation is exact; the norms differ from F.rms_norm by float32 rounding.
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == "float32" else dict(atol=5e-2, rtol=5e-2)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **tol)
