"""FP8 / MXFP4 numerics and the Triton FP8 kernels (TRITON_INTERPRET=1 on CPU, tests/conftest.py)
against float64 oracles computed element by element."""

import pytest
import torch

from meshserve.workers.quant import fp8_triton
from meshserve.workers.quant.fp8 import (
    dequantize_fp8_block,
    fp8_linear_reference,
    quantize_fp8_block,
    quantize_per_token_group,
)
from meshserve.workers.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from tests.quant_models import fp8_block, mxfp4


def _deq64(q, s, block):
    """float64 dequantization by explicit loops over blocks (the oracle)."""
    out = q.double().clone()
    bn, bk = block
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            out[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] *= s[i, j].double()
    return out


@pytest.mark.parametrize(("shape", "block"), [((96, 80), (32, 32)), ((200, 130), (128, 128)), ((5, 7), (128, 128))])
def test_block_quantization_matches_the_spec(shape, block):
    w = torch.randn(shape) * 3
    q, s = quantize_fp8_block(w, block)
    ref_q, ref_s, ref_deq = fp8_block(w, block)  # independent, block by block
    assert s.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    torch.testing.assert_close(s, ref_s, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    torch.testing.assert_close(dequantize_fp8_block(q, s, block, torch.float64), ref_deq, rtol=0, atol=0)
    torch.testing.assert_close(_deq64(q, s, block), ref_deq, rtol=0, atol=0)
    assert (ref_deq - w.double()).abs().max() <= w.abs().max() / 14  # 3 mantissa bits


def test_mxfp4_dequantizes_as_the_spec_and_round_trips():
    w = torch.randn(3, 8, 64)
    blocks, scales = quantize_mxfp4(w)
    ref_blocks, ref_scales, ref_deq = mxfp4(w)  # independent quantizer
    assert blocks.shape == (3, 8, 2, 16) and scales.shape == (3, 8, 2) and blocks.dtype == torch.uint8
    assert torch.equal(blocks, ref_blocks) and torch.equal(scales, ref_scales)
    torch.testing.assert_close(dequantize_mxfp4(blocks, scales, torch.float64), ref_deq, rtol=0, atol=0)
    # One hand-made byte: low nibble 0x3 (1.5) first, high nibble 0xA (-1.0); scale 2**(129 - 127).
    b = torch.zeros(1, 16, dtype=torch.uint8)
    b[0, 0] = 0xA3
    out = dequantize_mxfp4(b, torch.tensor([129], dtype=torch.uint8))
    assert out[:2].tolist() == [6.0, -4.0] and out[2:].abs().sum() == 0
    with pytest.raises(ValueError, match="do not pair"):
        dequantize_mxfp4(blocks, scales[..., :1])


@pytest.mark.parametrize("group", [32, 128])
def test_group_quant_kernel_is_bit_identical_to_torch(group):
    g = torch.Generator().manual_seed(2)  # this seed has a negative value that rounds to -0
    x = torch.randn(37, 200, generator=g) * torch.logspace(-2, 2, 200)  # groups of very different ranges
    x[3] = 0.0  # an all-zero token still gets a finite scale
    q, s = fp8_triton.quantize_groups(x, group)
    ref_q, ref_s = quantize_per_token_group(x, group)
    torch.testing.assert_close(s, ref_s, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


@pytest.mark.parametrize(("m", "n", "k", "block"), [
    (1, 96, 80, (32, 32)), (37, 160, 200, (128, 128)), (5, 64, 64, (16, 32)), (130, 48, 128, (128, 128))])
def test_block_gemm_kernel_matches_float64(m, n, k, block):
    x, w = torch.randn(m, k), torch.randn(n, k) * 0.1
    wq, ws = quantize_fp8_block(w, block)
    xq, xs = quantize_per_token_group(x, block[1])
    out = fp8_triton.block_gemm(xq, xs, wq, ws, block, torch.float32)
    ref = _deq64(xq, xs.repeat_interleave(1, 0), (1, block[1])) @ _deq64(wq, ws, block).T
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_fp8_block_linear_stays_within_activation_quantization_error():
    x, w = torch.randn(9, 256), torch.randn(192, 256) * 0.05
    wq, ws = quantize_fp8_block(w, (128, 128))
    y = fp8_triton.fp8_block_linear(x.view(3, 3, 256), wq, ws, (128, 128))
    ref = fp8_linear_reference(x.double(), wq, ws, (128, 128))
    assert y.shape == (3, 3, 192)
    rel = ((y.reshape(9, 192).double() - ref).norm() / ref.norm()).item()
    assert rel < 0.04, rel  # e4m3 activations: ~2.5% relative error on random data
