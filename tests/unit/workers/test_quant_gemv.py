"""The one-launch split-K FP8 GEMV (quant/fp8_gemv.py) under TRITON_INTERPRET=1, against float64
dequantize-then-matmul oracles: both scale layouts, ragged N and K, split and unsplit launches
(the last-arriving split sums the partials), NaN-padded scale rows, counters left zeroed.

Activations are bf16 values held in float32 where the output is compared without rounding (the
interpreter rounds float32 -> bf16 stores toward zero, which the GPU does not).
"""

import pytest
import torch

from meshserve.workers.quant import fp8_gemv as gemv_mod
from meshserve.workers.quant.formats import SMALL_M_MAX
from meshserve.workers.quant.fp8_gemv import GemvConfig, fp8_gemv, plan_gemv

# The inputs and float64 oracles of the streaming kernel's tests (the same shapes: N, K ragged
# against every tile and scale block below).
from tests.unit.workers.test_quant_small_m import K, N, _weights, _x

# Under the interpreter the planner sees 8 SMs. default: 64 rows x 256 columns, 2 tiles -> 2 splits;
# wide: 128-column steps over 64-wide scale blocks (2 sub-steps), 4 splits of one step;
# unsplit: 16-row tiles already fill the 8 "SMs" at one program each.
# pdl: the interpreter launches plainly (no griddepcontrol); the GPU suite checks the real thing.
CONFIGS = {"default": None, "pdl": GemvConfig(pdl=True), "wide": GemvConfig(64, 128, 4, 2, programs_per_sm=4),
           "unsplit": GemvConfig(16, 64, 4, 2, programs_per_sm=1)}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("fmt", ["block", "channel"])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_gemv_matches_float64(m, fmt, config):
    wq, scale, block, w64 = _weights(fmt)
    x = _x(m)
    bias = (torch.randn(N, generator=torch.Generator().manual_seed(4)) * 0.1).bfloat16()
    y = fp8_gemv(x, wq, scale, block, bias, config=CONFIGS[config])
    ref = x.double() @ w64.T + bias.double()
    assert y.shape == (m, N) and y.dtype == torch.float32
    # Same operands; only float32 accumulation order differs (K = 300 terms of size ~0.05).
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


# The CUDA-core kernel for one row, 8-row tiles (13 of them): split (64 programs wanted on the 8
# "SMs": 3 splits of 128 columns) and unsplit (8 wanted: the tiles alone are more).
CORES = {"cores_split": GemvConfig(8, 128, 4, 1, programs_per_sm=8, cores=True),
         "cores_unsplit": GemvConfig(8, 64, 4, 1, programs_per_sm=1, cores=True)}


@pytest.mark.parametrize("config", list(CORES))
@pytest.mark.parametrize("fmt", ["block", "channel"])
def test_cores_kernel_matches_float64(fmt, config):
    wq, scale, block, w64 = _weights(fmt)
    x = _x(1)
    bias = (torch.randn(N, generator=torch.Generator().manual_seed(4)) * 0.1).bfloat16()
    cfg = CORES[config]
    assert (plan_gemv(N, K, scale_k=block and block[1], num_sms=8, config=cfg).splits > 1) == (config == "cores_split")
    y = fp8_gemv(x, wq, scale, block, bias, config=cfg)
    torch.testing.assert_close(y.double(), x.double() @ w64.T + bias.double(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cores=True takes one row"):
        fp8_gemv(_x(2), wq, scale, block, config=cfg)


def test_plans_split_only_narrow_weights_and_cover_k():
    sms = 132
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (768, 4096), (576, 7168)]:
        plan = plan_gemv(n, k, scale_k=128, num_sms=sms)
        tiles = -(-n // plan.config.block_n)
        assert plan.k_per_split % plan.config.block_k == 0 and plan.k_per_split % 128 == 0, (n, k, plan)
        assert (plan.splits - 1) * plan.k_per_split < k <= plan.splits * plan.k_per_split, (n, k, plan)
        assert tiles * plan.splits <= max(tiles, plan.config.programs_per_sm * sms), (n, k, plan)
        assert (plan.splits > 1) == (2 * tiles <= plan.config.programs_per_sm * sms), (n, k, plan)
    with pytest.raises(ValueError, match="block_k=256 must divide or be a multiple of the scale block along K"):
        plan_gemv(4096, 4096, scale_k=96, num_sms=sms)


def test_split_launch_is_deterministic_and_leaves_the_counters_zeroed():
    wq, scale, block, _ = _weights("block")
    x = _x(16)
    split = GemvConfig(16, 64, 4, 2, programs_per_sm=8)  # 7 tiles x 5 splits
    assert plan_gemv(N, K, scale_k=64, num_sms=8, config=split).splits == 5
    a, b = fp8_gemv(x, wq, scale, block, config=split), fp8_gemv(x, wq, scale, block, config=split)
    assert torch.equal(a, b)
    assert not gemv_mod._COUNTERS["cpu"].any()
    torch.testing.assert_close(a, fp8_gemv(x, wq, scale, block, config=CONFIGS["unsplit"]), rtol=1e-5, atol=1e-6)


def test_bf16_in_bf16_out():
    wq, scale, block, w64 = _weights("channel")
    x = _x(5).bfloat16()
    y = fp8_gemv(x, wq, scale, block)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), x.double() @ w64.T, rtol=2**-7, atol=1e-6)


def test_activations_from_tiny_to_past_the_fp16_range():
    """Rows of |x| ~ 2**18 (past fp16's 65504 before the kernel's 2**-8 operand scale) stay exact;
    |x| ~ 1e-4 loses at most 2**-17 absolute per element (the fp16 operand's subnormal step)."""
    wq, scale, block, w64 = _weights("channel")
    x = torch.cat([_x(1) * 2.0**18, _x(1, seed=3) * 1e-4]).bfloat16().float()
    y = fp8_gemv(x, wq, scale, block)
    ref = x.double() @ w64.T
    torch.testing.assert_close(y.double()[0], ref[0], rtol=1e-5, atol=1e-5 * 2.0**18)
    assert (y.double()[1] - ref[1]).abs().max().item() <= (w64.abs().sum(1) * 2**-17).max().item()


def test_block_scales_past_k_are_never_read():
    """K = 300 ends inside the last 128-wide step's second 64-wide sub-step: the scale after each
    row's last one is NaN here (a padded buffer), so any read past the row shows as NaN."""
    wq, scale, block, w64 = _weights("block")
    padded = torch.full((scale.shape[0], scale.shape[1] + 3), float("nan"))
    padded[:, :scale.shape[1]] = scale
    x = _x(3)
    y = fp8_gemv(x, wq, padded[:, :scale.shape[1]], block, config=CONFIGS["wide"])
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), x.double() @ w64.T, rtol=1e-5, atol=1e-5)


def test_gemv_refuses_bad_input():
    wq, scale, block, _ = _weights("block")
    with pytest.raises(ValueError, match=rf"0\.\.{SMALL_M_MAX} rows"):
        fp8_gemv(_x(SMALL_M_MAX + 1), wq, scale, block)
    with pytest.raises(ValueError, match="weight must be"):
        fp8_gemv(_x(2, k=K + 1), wq, scale, block)
    with pytest.raises(ValueError, match="float8_e4m3fn weight"):
        fp8_gemv(_x(2), wq.float(), scale, block)
    with pytest.raises(ValueError, match=r"scale must be float32 \[100\] for block None"):
        fp8_gemv(_x(2), wq, scale, None)
    with pytest.raises(ValueError, match="bias must be"):
        fp8_gemv(_x(2), wq, scale, block, torch.zeros(N + 1))
    with pytest.raises(ValueError, match="GemvConfig.block_n must be a power of two >= 16"):
        GemvConfig(block_n=8)
    with pytest.raises(ValueError, match="cores takes pointer loads and plain launches"):
        GemvConfig(8, 64, cores=True, tma=True)
    assert fp8_gemv(_x(0), wq, scale, block).shape == (0, N)
    # 32-bit weight offsets: a weight reaching past 2^31 - 1 elements is refused (meta tensors: no memory)
    big = torch.empty((1 << 20, 2048), dtype=torch.float8_e4m3fn, device="meta")
    assert not gemv_mod.fits_gemv(big) and gemv_mod.fits_gemv(big[: (1 << 20) - 1])  # 2^31 vs 2^31 - 2048
    with pytest.raises(ValueError, match="32 bits"):
        fp8_gemv(torch.empty((1, 2048), device="meta"), big, torch.empty(1 << 20, device="meta"), None)


@pytest.mark.parametrize("fmt", ["block", "channel"])
def test_descriptor_loads_agree_with_pointer_loads(fmt):
    """tma configs read weight tiles through a tensor descriptor where rows are 16-byte aligned
    (K = 320 here; rows past N and the last partial step come back as zeros); K = 300 falls back."""
    for k in (320, 300):
        wq, scale, block, w64 = _weights(fmt, k=k)
        x = _x(3, k=k)
        y = fp8_gemv(x, wq, scale, block, config=GemvConfig(64, 128, 4, 2, programs_per_sm=4, tma=True))
        torch.testing.assert_close(y.double(), x.double() @ w64.T, rtol=1e-5, atol=1e-5)
