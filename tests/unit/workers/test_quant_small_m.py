"""The weight-streaming small-M kernel (quant/small_m.py) and the one-launch activation quantizers
(fp8_triton.py) under TRITON_INTERPRET=1, against float64 dequantize-then-matmul oracles.

Activations are bf16 values (held in float32 where the output must be compared exactly: the
interpreter rounds float32 -> bf16 stores toward zero, which the GPU does not; bf16 outputs are
checked to one bf16 step). N and K are not multiples of any tile; both scale layouts; bf16 weights.
"""

import pytest
import torch

from meshserve.workers.quant import fp8_triton
from meshserve.workers.quant.formats import SMALL_M_MAX
from meshserve.workers.quant.fp8 import (
    dequantize_fp8_block,
    quantize_fp8_block,
    quantize_fp8_per_channel,
    quantize_per_token_group,
)
from meshserve.workers.quant.small_m import StreamPlan, plan_stream, stream_linear

N, K = 100, 300  # ragged against every tile and scale block below


def _x(m, k=K, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * scale).bfloat16().float()  # bf16 values


def _weights(fmt, n=N, k=K, seed=1):
    """(weight, scale, block, float64 [n, k] oracle) for one weight format."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    if fmt == "block":
        q, s = quantize_fp8_block(w, (32, 64))
        # The oracle multiplies block by block in float64, apart from the kernel's indexing.
        ref = q.double().clone()
        for i in range(s.shape[0]):
            for j in range(s.shape[1]):
                ref[i * 32:(i + 1) * 32, j * 64:(j + 1) * 64] *= s[i, j].double()
        return q, s, (32, 64), ref
    if fmt == "channel":
        q, s = quantize_fp8_per_channel(w)
        return q, s, None, q.double() * s.double()[:, None]
    wb = w.bfloat16()
    return wb, None, None, wb.double()


# split_k: 3 splits of 128 columns; wide: 128-column steps over 64-wide scale blocks (2 sub-steps).
PLANS = {"default": None, "narrow": StreamPlan(16, 32), "split_k": StreamPlan(32, 64, splits=3, k_per_split=128),
         "wide": StreamPlan(16, 128, splits=2, k_per_split=256)}


@pytest.mark.parametrize("plan", list(PLANS), ids=str)
@pytest.mark.parametrize("fmt", ["block", "channel", "bf16"])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_stream_linear_matches_float64(m, fmt, plan):
    wq, scale, block, w64 = _weights(fmt)
    x = _x(m)
    bias = (torch.randn(N, generator=torch.Generator().manual_seed(4)) * 0.1).bfloat16()
    weight = wq.float() if fmt == "bf16" else wq  # float32 output: compared without bf16 rounding
    y = stream_linear(x, weight, scale, block, bias, plan=PLANS[plan])
    ref = x.double() @ w64.T + bias.double()
    assert y.shape == (m, N) and y.dtype == torch.float32
    # Same operands; only float32 accumulation order differs (K = 300 terms of size ~0.05).
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["block", "channel", "bf16"])
def test_stream_linear_bf16_io(fmt):
    """bf16 activations in, bf16 out: the kernel's own dtypes (one bf16 step of the oracle)."""
    wq, scale, block, w64 = _weights(fmt)
    x = _x(5).bfloat16()
    y = stream_linear(x, wq, scale, block, plan=PLANS["split_k"])
    ref = x.double() @ w64.T
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), ref, rtol=2**-7, atol=1e-6)


def test_tiny_activations_keep_their_precision():
    """The 2**-8 pre-scale into fp16 operands, as the module docstring states: |x| >= 2**-6 stays
    exact; smaller values (here 1e-4 and 2**-8) lose at most 2**-17 absolute each."""
    wq, scale, _, w64 = _weights("channel")
    small = _x(1, scale=2**-6)
    exact = (small.sign() * (small.abs() + 2**-6)).bfloat16().float()  # |x| >= 2**-6
    x = torch.cat([exact, _x(1, seed=3, scale=1e-4), small])
    y = stream_linear(x, wq, scale)
    ref = x.double() @ w64.T
    bound = (w64.abs().sum(1) * 2**-17).max().item()
    assert (y.double()[1:] - ref[1:]).abs().max().item() <= bound
    torch.testing.assert_close(y.double()[0], ref[0], rtol=1e-5, atol=1e-7)


def test_stream_linear_is_deterministic_and_splits_agree():
    wq, scale, block, _ = _weights("block")
    x = _x(16)
    plan = PLANS["split_k"]
    a, b = stream_linear(x, wq, scale, block, plan=plan), stream_linear(x, wq, scale, block, plan=plan)
    assert torch.equal(a, b)
    torch.testing.assert_close(a, stream_linear(x, wq, scale, block), rtol=1e-5, atol=1e-6)


def test_stream_linear_refuses_bad_input():
    wq, scale, block, _ = _weights("block")
    with pytest.raises(ValueError, match=rf"1\.\.{SMALL_M_MAX} rows"):
        stream_linear(_x(SMALL_M_MAX + 1), wq, scale, block)
    with pytest.raises(ValueError, match="weight.shape"):
        stream_linear(_x(2, k=K + 1), wq, scale, block)
    with pytest.raises(ValueError, match="scale must be given"):
        stream_linear(_x(2), wq, None, block)
    with pytest.raises(ValueError, match="block_k=48 must divide or be a multiple"):
        stream_linear(_x(2), wq, scale, block, plan=StreamPlan(16, 48))
    with pytest.raises(ValueError, match="k_per_split=96 must be a multiple"):
        stream_linear(_x(2), wq, scale, block, plan=StreamPlan(16, 32, splits=4, k_per_split=96))
    assert stream_linear(_x(0), wq, scale, block).shape == (0, N)


def test_plan_fills_the_gpu_and_splits_only_narrow_weights():
    sms = 132
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:  # Llama-3-8B, tp = 1
        plan = plan_stream(n, k, weight_bytes=1, scale_k=128, num_sms=sms)
        assert plan.splits == 1 and -(-n // plan.block_n) >= sms, (n, plan)
        assert plan.block_k % 128 == 0  # whole scale blocks per step (unrolled sub-steps)
    plan = plan_stream(768, 4096, weight_bytes=2, scale_k=None, num_sms=sms)  # qkv at tp = 8
    programs = -(-768 // plan.block_n) * plan.splits
    assert plan.splits > 1 and programs >= sms and plan.k_per_split % plan.block_k == 0
    assert (plan.splits - 1) * plan.k_per_split < 4096 <= plan.splits * plan.k_per_split


@pytest.mark.parametrize("m", [1, 5, 37])
def test_row_quant_kernel_is_bit_identical_to_torch(m):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(m, 5000, generator=g) * torch.logspace(-3, 2, 5000)  # rows wider than one block
    q, s = fp8_triton.quantize_rows(x)
    ref_q, ref_s = quantize_per_token_group(x, 5000)  # one group per token = per-token scales
    assert s.shape == (m, 1)
    torch.testing.assert_close(s, ref_s, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


def test_group_quant_many_rows_per_program_is_bit_identical():
    x = torch.randn(70, 260, generator=torch.Generator().manual_seed(8)) * 5  # 70 rows: 16-row programs + a tail
    q, s = fp8_triton.quantize_groups(x, 128)
    ref_q, ref_s = quantize_per_token_group(x, 128)
    torch.testing.assert_close(s, ref_s, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


def test_oracle_helper_agrees_with_the_library_dequantization():
    wq, scale, block, w64 = _weights("block")
    torch.testing.assert_close(dequantize_fp8_block(wq, scale, block, torch.float64), w64, rtol=0, atol=0)


@pytest.mark.parametrize(("m", "small_m", "fmt", "bound"), [
    (3, True, "block", 2**-7), (3, True, "channel", 2**-7), (16, True, "block", 2**-7),
    (17, True, "block", 0.05), (3, False, "block", 0.05)])  # fmt: skip
def test_fp8_linear_dispatch_on_the_fast_path(monkeypatch, m, small_m, fmt, bound):
    """fp8_linear as it runs on CUDA (the device check forced, kernels interpreted): up to
    SMALL_M_MAX rows and small_m on -> the W8A16 kernel (bf16 rounding only, bias fused); else the
    quantized-activation block path (e4m3 activations: a few % on random data)."""
    from meshserve.workers.quant import layers

    monkeypatch.setattr(layers, "_fast_path", lambda x: True)
    wq, scale, block, w64 = _weights(fmt)
    x = _x(m).bfloat16().view(1, m, K)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(9)).bfloat16()
    y = layers.fp8_linear(x, wq, scale, block, small_m=small_m, bias=bias)
    ref = x.double() @ w64.T + bias.double()
    assert y.shape == (1, m, N) and y.dtype == torch.bfloat16
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    assert rel < bound, rel
    if bound < 0.01:  # the streamed result is not the quantized-activation one
        quantized = layers.fp8_linear(x, wq, scale, block, small_m=False, bias=bias) if fmt == "block" else None
        assert quantized is None or ((quantized.double() - ref).norm() / ref.norm()).item() > 2 * rel


@pytest.mark.parametrize("plan", ["wide", "default"])
def test_block_scales_past_k_are_never_read(plan):
    """A step wider than the scale block, over a K that ends inside it (K = 300: the last 128-wide
    step's second 64-wide sub-step starts at 320 > K), must not read the scale after the row's
    last one: here the scales sit in a NaN-padded buffer, so any such read shows as NaN."""
    wq, scale, block, w64 = _weights("block")
    padded = torch.full((scale.shape[0], scale.shape[1] + 3), float("nan"))
    padded[:, :scale.shape[1]] = scale
    view = padded[:, :scale.shape[1]]  # row stride 8, 3 NaNs after each row's 5 scales
    x = _x(3)
    y = stream_linear(x, wq, view, block, plan=PLANS[plan] or StreamPlan(16, 128))
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), x.double() @ w64.T, rtol=1e-5, atol=1e-5)
