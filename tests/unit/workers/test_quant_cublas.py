"""The cuBLASLt-facing FP8 paths (quant/fp8_cublas.py, gemm_table.py) on CPU: the scale layouts
torch's blockwise scaled_mm checks, the padded activation quantization that writes them, the
one-time probe and its fallback, the rank-1 rescale identity in float64 and its kernel (Triton
interpreter), online FP8's rescale formulation end to end (CPU torch has per-tensor _scaled_mm),
and the dispatch table. The GPU numbers are tests/gpu/test_quant_gpu.py's."""

import logging

import pytest
import torch

from meshserve.workers.quant import fp8_cublas, fp8_triton, layers
from meshserve.workers.quant.formats import SMALL_M_MAX
from meshserve.workers.quant.fp8 import (
    dequantize_fp8_block,
    quantize_fp8_block,
    quantize_fp8_per_channel,
    quantize_per_token_group,
)
from meshserve.workers.quant.gemm_table import DEFAULT_TABLE, GemmTable, GemmWay, choose, choose_dense


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.fixture(autouse=True)
def fresh_probes(monkeypatch):
    monkeypatch.setattr(fp8_cublas, "_PROBES", {})


@pytest.mark.parametrize(("m", "align"), [(1, 4), (5, 4), (16, 4), (33, 4), (33, 16), (8, 1)])
def test_outer_major_group_quant_is_bit_identical_and_padded(m, align):
    x = _randn(m, 300, seed=m) * torch.logspace(-2, 2, 300)  # K ragged against the 128 groups
    q, s = fp8_triton.quantize_groups(x, 128, outer_major=True, row_align=align)
    m_out = -(-m // align) * align
    assert q.shape == (m_out, 300) and s.shape == (m_out, 3)
    assert s.stride() == (1, m_out)  # token-fastest: torch's BlockWise1x128 layout, no transpose
    ref_q, ref_s = quantize_per_token_group(x, 128)
    torch.testing.assert_close(s[:m], ref_s, rtol=0, atol=0)
    assert torch.equal(q[:m].view(torch.uint8), ref_q.view(torch.uint8))
    assert q[m:].float().abs().sum() == 0 and torch.all(s[m:] == 1e-12)  # padding: zero rows


@pytest.mark.parametrize("k_blocks", [3, 4, 11, 32])
def test_weight_scales_take_torchs_128x128_layout(k_blocks):
    ws = _randn(5, k_blocks, seed=1).abs() + 0.1  # [ceil(N / 128), ceil(K / 128)], checkpoint layout
    sb = fp8_cublas.torch_weight_scales(ws)
    k4 = -(-k_blocks // 4) * 4
    assert sb.shape == (k4, 5) and sb.stride() == (1, k4)  # ScaledBlas.cpp: size (L4, N/128), stride (1, L4)
    torch.testing.assert_close(sb[:k_blocks], ws.t(), rtol=0, atol=0)
    assert torch.all(sb[k_blocks:] == 0)
    if k_blocks % 4 == 0:
        assert sb.data_ptr() == ws.data_ptr()  # a view: nothing copied per call


def _contract_blockwise(xq, x_scale, weight, scale_b, out_dtype):
    """torch's blockwise scaled_mm as ScaledBlas.cpp specifies it (its shape and stride checks,
    then the math in float64): the stand-in for cuBLASLt on CPU."""
    m, k = xq.shape
    n = weight.shape[0]
    kb = -(-k // 128)
    k4 = -(-kb // 4) * 4
    assert x_scale.shape == (m, kb) and (x_scale.stride(0) == 1 and (x_scale.stride(1) == m or kb == 1))
    assert scale_b.shape == (k4, -(-n // 128)) and scale_b.stride(0) == 1 and scale_b.stride(1) == k4
    a = dequantize_fp8_block(xq, x_scale.contiguous(), (1, 128), torch.float64)
    w = dequantize_fp8_block(weight, scale_b[:kb].t().contiguous(), (128, 128), torch.float64)
    return (a @ w.T).to(out_dtype)


def _block_case(m, n=300, k=400, seed=0):
    wq, ws = quantize_fp8_block(_randn(n, k, seed=seed, scale=0.05), (128, 128))
    return _randn(m, k, seed=seed + 1), wq, ws


def test_probe_passes_with_the_contracted_layouts_and_is_reused(monkeypatch, caplog):
    calls = []

    def contract(*args):
        calls.append(args[0].shape[0])
        return _contract_blockwise(*args)

    monkeypatch.setattr(fp8_cublas, "blockwise_scaled_mm", contract)
    x, wq, ws = _block_case(33)  # 33 rows: padded to 36 for cuBLASLt, sliced back
    with caplog.at_level(logging.INFO, logger="meshserve.quant"):
        y = fp8_cublas.block_linear_cublas(x, wq, ws, (128, 128))
    xq, xs = quantize_per_token_group(x, 128)
    ref = dequantize_fp8_block(xq, xs, (1, 128), torch.float64) @ dequantize_fp8_block(wq, ws, (128, 128),
                                                                                      torch.float64).T
    assert y.shape == (33, 300)
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-6)
    assert fp8_cublas.probe_results() == {(300, 400, torch.float32, "cpu"): None}
    assert "probe passed" in caplog.text
    y2 = fp8_cublas.block_linear_cublas(_randn(7, 400, seed=5), wq, ws, (128, 128))
    assert y2.shape == (7, 300) and calls == [36, 8]  # one probe, then straight calls; rows padded to 4


def test_probe_falls_back_when_torch_refuses(caplog):
    x, wq, ws = _block_case(20)
    with caplog.at_level(logging.WARNING, logger="meshserve.quant"):
        assert fp8_cublas.block_linear_cublas(x, wq, ws, (128, 128)) is None  # CPU torch has no blockwise GEMM
    (reason,) = fp8_cublas.probe_results().values()
    assert reason.startswith("torch blockwise scaled_mm refused") and "Triton block GEMM" in caplog.text


def test_probe_falls_back_when_torch_has_no_blockwise_api(monkeypatch):
    """An older torch (no F.scaled_mm): the probe records why without calling anything."""
    monkeypatch.setattr(fp8_cublas, "missing_blockwise_api", lambda: "torch 2.8 has no torch.nn.functional.scaled_mm")
    monkeypatch.setattr(fp8_cublas, "blockwise_scaled_mm", lambda *a: pytest.fail("called without the API"))
    x, wq, ws = _block_case(20)
    assert fp8_cublas.block_linear_cublas(x, wq, ws, (128, 128)) is None
    (reason,) = fp8_cublas.probe_results().values()
    assert reason == "torch blockwise scaled_mm refused: torch 2.8 has no torch.nn.functional.scaled_mm"


def test_probe_falls_back_when_torch_disagrees(monkeypatch):
    monkeypatch.setattr(fp8_cublas, "blockwise_scaled_mm", lambda *a: _contract_blockwise(*a) * 1.1)
    x, wq, ws = _block_case(20)
    assert fp8_cublas.block_linear_cublas(x, wq, ws, (128, 128)) is None
    (reason,) = fp8_cublas.probe_results().values()
    assert "disagrees" in reason
    assert fp8_cublas.block_linear_cublas(x, wq, ws, (64, 64)) is None  # other blocks: never cuBLAS


def test_fp8_linear_serves_blocks_through_the_probe_or_falls_back(monkeypatch):
    """fp8_linear as on CUDA (device check forced): above the small-M rows the blockwise GEMM when the
    probe passes, the Triton block GEMM when it does not; the same product either way."""
    monkeypatch.setattr(layers, "_fast_path", lambda x: True)
    x, wq, ws = _block_case(SMALL_M_MAX + 1)
    x = x.bfloat16()
    fallback = layers.fp8_linear(x, wq, ws, (128, 128))  # CPU torch refuses: Triton
    monkeypatch.setattr(fp8_cublas, "_PROBES", {})
    monkeypatch.setattr(fp8_cublas, "blockwise_scaled_mm", _contract_blockwise)
    served = layers.fp8_linear(x, wq, ws, (128, 128))
    assert fp8_cublas.probe_results() == {(300, 400, torch.bfloat16, "cpu"): None}
    torch.testing.assert_close(served.float(), fallback.float(), rtol=2**-7, atol=2**-7 * fallback.abs().max().item())


def test_rank1_identity_in_float64():
    """(xq @ wq^T) * s_x[m] * s_w[n] is the product of the dequantized operands."""
    x, w = _randn(9, 256, seed=2), _randn(70, 256, seed=3, scale=0.05)
    xq, sx = quantize_per_token_group(x, 256)
    wq, sw = quantize_fp8_per_channel(w)
    raw = xq.double() @ wq.double().T
    ref = (xq.double() * sx.double()) @ (wq.double() * sw.double()[:, None]).T
    torch.testing.assert_close(raw * sx.double() * sw.double()[None, :], ref, rtol=1e-13, atol=0)


@pytest.mark.parametrize("m", [1, 5, 37])
def test_rank1_rescale_kernel_is_exact_in_float32(m):
    raw, sx, sw, bias = _randn(m, 300, seed=4), _randn(m, 1, seed=5).abs(), _randn(300, seed=6).abs(), _randn(300)
    out = fp8_triton.rank1_rescale(raw, sx, sw, torch.float32, bias)
    assert torch.equal(out, raw * sx * sw[None, :] + bias)
    assert torch.equal(fp8_triton.rank1_rescale(raw, sx.view(-1), sw, torch.float32), raw * sx * sw[None, :])
    with pytest.raises(ValueError, match=r"w_scale 299 for 300 columns"):
        fp8_triton.rank1_rescale(raw, sx, sw[:299], torch.float32)


@pytest.mark.parametrize("raw_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_channel_rescale_linear_matches_float64(raw_dtype):
    """Online FP8's rank-1 formulation end to end (interpreted kernels, CPU per-tensor _scaled_mm),
    float32 activations and output (the interpreter's bf16 stores truncate; bf16 output is the GPU
    test's): against float64 on the same quantized operands, float32 sums (float32 raw) or one
    bf16 rounding of the raw product (bf16 raw); against the dequantized-weight matmul, the e4m3
    activations' few %."""
    x = _randn(6, 320, seed=7).bfloat16().float()
    wq, sw = quantize_fp8_per_channel(_randn(200, 320, seed=8, scale=0.05))
    bias = _randn(200, seed=9)
    y = fp8_cublas.channel_rescale_linear(x, wq, sw, bias=bias, raw_dtype=raw_dtype)
    assert y.dtype == torch.float32 and y.shape == (6, 200)
    xq, sx = quantize_per_token_group(x, 320)
    product = (xq.double() * sx.double()) @ (wq.double() * sw.double()[:, None]).T
    rtol = 1e-5 if raw_dtype == torch.float32 else 2**-8  # bf16 raw: half a step of 2**-7
    torch.testing.assert_close(y.double() - bias.double(), product, rtol=rtol, atol=1e-6)
    ref = x.double() @ (wq.double() * sw.double()[:, None]).T + bias.double()
    assert ((y.double() - ref).norm() / ref.norm()).item() < 0.05


def test_fp8_linear_takes_the_rescale_formulation_where_the_table_says(monkeypatch):
    monkeypatch.setattr(layers, "_fast_path", lambda x: True)
    seen = []
    real = fp8_cublas.channel_rescale_linear
    monkeypatch.setattr(fp8_cublas, "channel_rescale_linear", lambda *a, **k: seen.append(a[0].shape) or real(*a, **k))
    wq, sw = quantize_fp8_per_channel(_randn(64, 128, seed=10, scale=0.05))
    x = _randn(2, 3, 128, seed=11).bfloat16()
    y = layers.fp8_linear(x, wq, sw, None, table=GemmTable(channel_rescale_max_rows=6))
    ref = x.double() @ (wq.double() * sw.double()[:, None]).T
    assert seen == [(6, 128)] and y.shape == (2, 3, 64)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 0.05


def test_dispatch_table():
    t = GemmTable(block_cublas_min_rows=17, channel_rescale_max_rows=64,
                     small_m_block=((4, GemmWay.GEMV), (16, GemmWay.STREAM)),
                     small_m_channel=((8, GemmWay.CHANNEL_RESCALE),))
    assert choose(t, block=True, rows=4, small_m=True) is GemmWay.GEMV
    assert choose(t, block=True, rows=5, small_m=True) is GemmWay.STREAM
    assert choose(t, block=True, rows=16, small_m=True) is GemmWay.STREAM
    assert choose(t, block=False, rows=8, small_m=True) is GemmWay.CHANNEL_RESCALE
    assert choose(t, block=False, rows=9, small_m=True) is GemmWay.CHANNEL_RESCALE  # past its buckets: large-M rules
    assert choose(t, block=False, rows=65, small_m=True) is GemmWay.CHANNEL_ROWWISE
    assert choose(DEFAULT_TABLE, block=True, rows=16, small_m=True) is GemmWay.GEMV  # measured: H100, 2026-12-05
    assert choose(DEFAULT_TABLE, block=False, rows=1, small_m=True) is GemmWay.GEMV_CORES
    with pytest.raises(ValueError, match=r"small_m_block names \['channel_rescale'\]"):
        GemmTable(small_m_block=((16, GemmWay.CHANNEL_RESCALE),))
    assert choose(GemmTable(small_m_channel=((1, GemmWay.GEMV_CORES), (16, GemmWay.GEMV))), block=False, rows=1,
                  small_m=True) is GemmWay.GEMV_CORES
    with pytest.raises(ValueError, match="gemv_cores serves one row"):
        GemmTable(small_m_block=((4, GemmWay.GEMV_CORES),))
    with pytest.raises(ValueError, match="small_m_channel row bounds must increase within 1..16"):
        GemmTable(small_m_channel=((8, GemmWay.GEMV), (4, GemmWay.STREAM)))
    assert choose(t, block=True, rows=16, small_m=False) is GemmWay.TRITON_BLOCK
    assert choose(t, block=True, rows=17, small_m=True) is GemmWay.CUBLAS_BLOCKWISE
    assert choose(t, block=False, rows=64, small_m=False) is GemmWay.CHANNEL_RESCALE
    assert choose(t, block=False, rows=65, small_m=False) is GemmWay.CHANNEL_ROWWISE
    assert choose(DEFAULT_TABLE, block=False, rows=1, small_m=False) is GemmWay.CHANNEL_ROWWISE  # not measured yet
    with pytest.raises(ValueError, match="channel_rescale_max_rows must be >= 0, not -1"):
        GemmTable(channel_rescale_max_rows=-1)
    with pytest.raises(ValueError, match="rescale_raw_dtype must be"):
        GemmTable(rescale_raw_dtype=torch.float16)
    # bf16/fp16 weights (StreamedLinear, small_m_gemm "on"): NOT measured; the GEMV's kernels by default
    assert [choose_dense(DEFAULT_TABLE, rows=r) for r in (1, 2, 16, 17)] == \
        [GemmWay.GEMV_CORES, GemmWay.GEMV, GemmWay.GEMV, GemmWay.DENSE_CUBLAS]
    dense = GemmTable(small_m_dense=((1, GemmWay.DENSE_CUBLAS), (4, GemmWay.STREAM), (8, GemmWay.GEMV)))
    assert [choose_dense(dense, rows=r) for r in (1, 4, 5, 8, 9)] == \
        [GemmWay.DENSE_CUBLAS, GemmWay.STREAM, GemmWay.GEMV, GemmWay.GEMV, GemmWay.DENSE_CUBLAS]
    with pytest.raises(ValueError, match=r"small_m_dense names \['triton_block'\]; allowed: \['gemv', 'gemv_cores', "
                                         r"'stream', 'dense_cublas'\]"):
        GemmTable(small_m_dense=((16, GemmWay.TRITON_BLOCK),))
    with pytest.raises(ValueError, match=r"small_m_channel names \['dense_cublas'\]"):
        GemmTable(small_m_channel=((16, GemmWay.DENSE_CUBLAS),))
    with pytest.raises(ValueError, match="small_m_dense: gemv_cores serves one row"):
        GemmTable(small_m_dense=((2, GemmWay.GEMV_CORES),))
