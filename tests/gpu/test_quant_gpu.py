"""FP8 kernels on CUDA (sm89+) at model shapes, bf16 included (the interpreter's CPU tests cannot
cover bf16): the Triton per-token-group quantization and block GEMM against float64 oracles, the
online per-channel path, Fp8Linear, and MXFP4 dequantization on the GPU. Skipped without CUDA;
FP8 cases skip where quant/support.py says the GPU cannot serve them."""

import pytest
import torch

from meshserve.workers.quant.formats import WeightFormat
from meshserve.workers.quant.fp8 import dequantize_fp8_block, quantize_fp8_block, quantize_per_token_group
from meshserve.workers.quant.layers import Fp8Linear, fp8_linear
from meshserve.workers.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from meshserve.workers.quant.support import refusals

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _skip_unless(fmt: WeightFormat) -> None:
    reasons = refusals(fmt, "cuda", torch.cuda.get_device_capability(), (128, 128))
    if reasons:
        pytest.skip("; ".join(reasons))


def _randn(*shape, dtype=torch.bfloat16, scale=1.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)


# (N, K) of Llama-3-8B's projections (qkv, o, gate_up, down) and a ragged one (edge blocks).
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (576, 7168)]
MS = [1, 4, 33, 4096]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [1, 33, 4096])
def test_group_quant_kernel_is_bit_identical_to_torch(dtype, m):
    _skip_unless(WeightFormat.FP8_BLOCK)
    from meshserve.workers.quant.fp8_triton import quantize_groups

    x = _randn(m, 7168, dtype=dtype, scale=3.0)
    q, s = quantize_groups(x, 128)
    ref_q, ref_s = quantize_per_token_group(x, 128)
    torch.testing.assert_close(s, ref_s, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


@pytest.mark.parametrize(("n", "k"), SHAPES, ids=str)
@pytest.mark.parametrize("m", MS)
def test_block_gemm_matches_float64(m, n, k):
    """Same FP8 operands: only float32 accumulation and the bf16 output rounding differ."""
    _skip_unless(WeightFormat.FP8_BLOCK)
    from meshserve.workers.quant.fp8_triton import block_gemm

    wq, ws = quantize_fp8_block(_randn(n, k, scale=0.02, seed=1), (128, 128))
    xq, xs = quantize_per_token_group(_randn(m, k), 128)
    out = block_gemm(xq, xs, wq, ws, (128, 128), torch.bfloat16)
    ref = dequantize_fp8_block(xq, xs, (1, 128), torch.float64) @ dequantize_fp8_block(wq, ws, (128, 128),
                                                                                      torch.float64).T
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=2e-3 * ref.abs().max().item())


@pytest.mark.parametrize(("n", "k"), SHAPES[:2] + SHAPES[3:], ids=str)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("block", [(128, 128), None], ids=["block", "per_channel"])
def test_fp8_linear_against_dequantized_matmul(m, n, k, block):
    """bf16 activations quantized on the fly: within e4m3's activation error of x @ dequant(W)^T."""
    _skip_unless(WeightFormat.FP8_BLOCK if block else WeightFormat.FP8_CHANNEL)
    w = _randn(n, k, scale=0.02, seed=2)
    if block is None:
        scale = (w.float().abs().amax(1) / 448.0).clamp(min=1e-12)
        wq = (w.float() / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        w64 = wq.double() * scale.double()[:, None]
    else:
        wq, scale = quantize_fp8_block(w, block)
        w64 = dequantize_fp8_block(wq, scale, block, torch.float64)
    x = _randn(m, k, seed=3)
    y = fp8_linear(x, wq, scale, block)
    ref = x.double() @ w64.T
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    assert rel < 0.04, rel  # e4m3 activations: ~2.5% on random data; a wrong scale is >> 10%


def test_fp8_linear_module_bias_and_3d_input():
    _skip_unless(WeightFormat.FP8_BLOCK)
    layer = Fp8Linear(4096, 6144, bias=True, block=(128, 128)).cuda()
    wq, ws = quantize_fp8_block(_randn(6144, 4096, scale=0.02, seed=4), (128, 128))
    layer.weight.data.copy_(wq)
    layer.weight_scale_inv.copy_(ws)
    layer.bias.data = _randn(6144, seed=5, dtype=torch.bfloat16)
    x = _randn(2, 9, 4096, seed=6)
    ref = x.double() @ dequantize_fp8_block(wq, ws, (128, 128), torch.float64).T + layer.bias.double()
    y = layer(x)
    assert y.shape == (2, 9, 6144)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 0.04


def test_mxfp4_dequantizes_alike_on_gpu():
    w = torch.randn(8, 512, 2880)
    blocks, scales = quantize_mxfp4(w)
    cpu = dequantize_mxfp4(blocks, scales, torch.bfloat16)
    gpu = dequantize_mxfp4(blocks.cuda(), scales.cuda(), torch.bfloat16)
    assert torch.equal(gpu.cpu(), cpu)
