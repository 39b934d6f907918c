"""The one-launch split-K GEMV (quant/gemv.py) under TRITON_INTERPRET=1, against float64 oracles.

FP8 weights: dequantize-then-matmul oracles, both scale layouts, ragged N and K, split and unsplit
launches (the last-arriving split sums the partials), NaN-padded scale rows, counters left
zeroed. Activations are bf16 values held in float32 where the output is compared without rounding
(the interpreter rounds float32 -> bf16 stores toward zero, which the GPU does not).

bf16/fp16 weights (no scale; x in the weight's dtype, so the output is rounded to it): both
kernels, split and unsplit, with and without bias, a row stride past K; the split order itself
(partials built so that only the documented order gives the checked bits); StreamedLinear on the
kernel, as the table chooses it.
"""

import math

import pytest
import torch

from meshserve.workers.quant import gemv as gemv_mod
from meshserve.workers.quant.formats import SMALL_M_MAX
from meshserve.workers.quant.gemv import GemvConfig, plan_gemv, weight_gemv

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
    y = weight_gemv(x, wq, scale, block, bias, config=CONFIGS[config])
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
    y = weight_gemv(x, wq, scale, block, bias, config=cfg)
    torch.testing.assert_close(y.double(), x.double() @ w64.T + bias.double(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cores=True takes one row"):
        weight_gemv(_x(2), wq, scale, block, config=cfg)


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
    a, b = weight_gemv(x, wq, scale, block, config=split), weight_gemv(x, wq, scale, block, config=split)
    assert torch.equal(a, b)
    assert not gemv_mod._COUNTERS["cpu"].any()
    torch.testing.assert_close(a, weight_gemv(x, wq, scale, block, config=CONFIGS["unsplit"]), rtol=1e-5, atol=1e-6)


def test_bf16_in_bf16_out():
    wq, scale, block, w64 = _weights("channel")
    x = _x(5).bfloat16()
    y = weight_gemv(x, wq, scale, block)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), x.double() @ w64.T, rtol=2**-7, atol=1e-6)


def test_activations_from_tiny_to_past_the_fp16_range():
    """Rows of |x| ~ 2**18 (past fp16's 65504 before the kernel's 2**-8 operand scale) stay exact;
    |x| ~ 1e-4 loses at most 2**-17 absolute per element (the fp16 operand's subnormal step)."""
    wq, scale, block, w64 = _weights("channel")
    x = torch.cat([_x(1) * 2.0**18, _x(1, seed=3) * 1e-4]).bfloat16().float()
    y = weight_gemv(x, wq, scale, block)
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
    y = weight_gemv(x, wq, padded[:, :scale.shape[1]], block, config=CONFIGS["wide"])
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), x.double() @ w64.T, rtol=1e-5, atol=1e-5)


def test_gemv_refuses_bad_input():
    wq, scale, block, _ = _weights("block")
    with pytest.raises(ValueError, match=rf"0\.\.{SMALL_M_MAX} rows"):
        weight_gemv(_x(SMALL_M_MAX + 1), wq, scale, block)
    with pytest.raises(ValueError, match="weight must be"):
        weight_gemv(_x(2, k=K + 1), wq, scale, block)
    with pytest.raises(ValueError, match="float8_e4m3fn .with scale., bfloat16 or float16 weight, not torch.float32"):
        weight_gemv(_x(2), wq.float(), scale, block)
    with pytest.raises(ValueError, match="float8_e4m3fn weight needs its scale"):
        weight_gemv(_x(2), wq)
    with pytest.raises(ValueError, match=r"scale must be float32 \[100\] for block None"):
        weight_gemv(_x(2), wq, scale, None)
    with pytest.raises(ValueError, match="bias must be"):
        weight_gemv(_x(2), wq, scale, block, torch.zeros(N + 1))
    with pytest.raises(ValueError, match="GemvConfig.block_n must be a power of two >= 16"):
        GemvConfig(block_n=8)
    with pytest.raises(ValueError, match="cores takes pointer loads and plain launches"):
        GemvConfig(8, 64, cores=True, tma=True)
    assert weight_gemv(_x(0), wq, scale, block).shape == (0, N)
    # 32-bit weight offsets: a weight reaching past 2^31 - 1 elements is refused (meta tensors: no memory)
    big = torch.empty((1 << 20, 2048), dtype=torch.float8_e4m3fn, device="meta")
    assert not gemv_mod.fits_gemv(big) and gemv_mod.fits_gemv(big[: (1 << 20) - 1])  # 2^31 vs 2^31 - 2048
    with pytest.raises(ValueError, match="32 bits"):
        weight_gemv(torch.empty((1, 2048), device="meta"), big, torch.empty(1 << 20, device="meta"), None)


@pytest.mark.parametrize("fmt", ["block", "channel"])
def test_descriptor_loads_agree_with_pointer_loads(fmt):
    """tma configs read weight tiles through a tensor descriptor where rows are 16-byte aligned
    (K = 320 here; rows past N and the last partial step come back as zeros); K = 300 falls back."""
    for k in (320, 300):
        wq, scale, block, w64 = _weights(fmt, k=k)
        x = _x(3, k=k)
        y = weight_gemv(x, wq, scale, block, config=GemvConfig(64, 128, 4, 2, programs_per_sm=4, tma=True))
        torch.testing.assert_close(y.double(), x.double() @ w64.T, rtol=1e-5, atol=1e-5)


# --- bf16 / fp16 weights ---------------------------------------------------------------------

DENSE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Under the interpreter's 8 "SMs" (N = 100, K = 300): default (gemv.DENSE_CONFIG, 64 x 128): 2 tiles x
# 3 steps -> 3 splits; split: 4 tiles of 32 rows x 5 steps of 64 columns -> 5 splits; unsplit: 7
# tiles of 16 rows, one program each.
DENSE_CONFIGS = {"default": None, "split": GemvConfig(32, 64, 4, 2, programs_per_sm=4),
                 "unsplit": GemvConfig(16, 64, 4, 2, programs_per_sm=1)}
DENSE_SPLITS = {"default": 3, "split": 5, "unsplit": 1}


def _dense(dtype, n=N, k=K, pad=0, seed=1):
    """A [n, k] weight of `dtype` (a view with row stride k + pad when pad > 0)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k + pad, generator=g) * 0.05).to(dtype)
    return w[:, :k] if pad else w


def _assert_within_rounding(y, x, w, bias):
    """y against x @ w^T (+ bias) in float64: one rounding to y's dtype (at most one ulp: eps
    relative, whatever the rounding mode, the interpreter's truncating bf16 stores included) plus
    float32 accumulation (2**-20 of the sum of |terms|, K = 300 terms)."""
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    terms = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs())
    bound = torch.finfo(y.dtype).eps * ref.abs() + 2.0**-20 * terms
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"{int((err > bound).sum())} outputs past one {y.dtype} ulp; worst " \
        f"{(err - bound).max().item():.3g} past it"


@pytest.mark.parametrize("config", list(DENSE_CONFIGS))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("dtype", list(DENSE_DTYPES))
def test_dense_gemv_matches_float64(dtype, m, bias, config):
    dt = DENSE_DTYPES[dtype]
    w = _dense(dt, pad=24 if config == "split" else 0)  # the split launches read rows of stride K + 24
    x = _x(m).to(dt)
    b = (torch.randn(N, generator=torch.Generator().manual_seed(4)) * 0.5).to(dt) if bias else None
    cfg = DENSE_CONFIGS[config] or gemv_mod.DENSE_CONFIG
    assert plan_gemv(N, K, scale_k=None, num_sms=8, config=cfg).splits == DENSE_SPLITS[config]
    y = weight_gemv(x, w, bias=b, config=DENSE_CONFIGS[config])
    assert y.shape == (m, N) and y.dtype == dt
    _assert_within_rounding(y, x, w, b)
    assert not gemv_mod._COUNTERS.get("cpu", torch.zeros(1)).any()


# The CUDA-core kernel (one row), 16-byte loads of 8 weights: split (3 splits of 128
# columns on the 8 "SMs") and unsplit.
@pytest.mark.parametrize("config", list(CORES))
@pytest.mark.parametrize("dtype", list(DENSE_DTYPES))
def test_dense_cores_kernel_matches_float64(dtype, config):
    dt = DENSE_DTYPES[dtype]
    w, x = _dense(dt, pad=8), _x(1).to(dt)
    b = (torch.randn(N, generator=torch.Generator().manual_seed(4)) * 0.5).to(dt)
    y = weight_gemv(x, w, bias=b, config=CORES[config])
    assert y.shape == (1, N) and y.dtype == dt
    _assert_within_rounding(y, x, w, b)
    _assert_within_rounding(weight_gemv(x, w, config=CORES[config]), x, w, None)
    with pytest.raises(ValueError, match="cores=True takes one row"):
        weight_gemv(_x(2).to(dt), w, config=CORES[config])


def _order_probe(dtype):
    """x [1, 192] and w [3, 192] for 3 splits of 64 columns whose float32 partials are, per row,
    +2**25, -2**25 and 1 in some order: summed in split order 0, 1, 2 (float32, 2**25 + 1 rounds to
    2**25) a row gives 1 only where the 1 comes last (row 0), else 0; float64 would give 1 everywhere.
    Any other order, a split summed twice or left out gives other bits."""
    big = 2.0**14  # x 2**11: a product of 2**25 (exact in float32, not representable in fp16/bf16 operands)
    x = torch.zeros(1, 192)
    x[0, 0::64], x[0, 1::64] = 2.0**11, 1.0  # per split: column 64s holds 2**11, column 64s + 1 holds 1
    w = torch.zeros(3, 192)
    w[0, 0], w[0, 64], w[0, 129] = big, -big, 1.0  # splits: +2**25, -2**25, 1   -> 1
    w[1, 1], w[1, 64], w[1, 128] = 1.0, big, -big  # splits: 1, +2**25, -2**25   -> 0
    w[2, 0], w[2, 65], w[2, 128] = big, 1.0, -big  # splits: +2**25, 1, -2**25   -> 0
    return x.to(dtype), w.to(dtype)


@pytest.mark.parametrize("kernel", ["tensor_cores", "cores"])
@pytest.mark.parametrize("dtype", list(DENSE_DTYPES))
def test_dense_split_partials_are_summed_once_in_split_order(dtype, kernel):
    dt = DENSE_DTYPES[dtype]
    cfg = GemvConfig(16, 64, 4, 1, programs_per_sm=4) if kernel == "tensor_cores" else \
        GemvConfig(4, 64, 4, 1, programs_per_sm=4, cores=True)
    plan = plan_gemv(3, 192, scale_k=None, num_sms=8, config=cfg)
    assert (plan.splits, plan.k_per_split) == (3, 64)
    x, w = _order_probe(dt)
    bias = torch.tensor([0.0, 1.0, 2.0]).to(dt)
    for _ in range(2):  # the second launch finds the counters the first one left (zeroed)
        y = weight_gemv(x, w, bias=bias, config=cfg)
        assert y.tolist() == [[1.0, 1.0, 2.0]], y
    assert not gemv_mod._COUNTERS["cpu"].any()


def test_dense_gemv_refuses_bad_input():
    w = _dense(torch.bfloat16)
    with pytest.raises(ValueError, match="x must be torch.bfloat16 like the weight .* not torch.float16"):
        weight_gemv(_x(2).half(), w)
    with pytest.raises(ValueError, match="x must be torch.float16 like the weight .* not torch.float32"):
        weight_gemv(_x(2), w.half())
    with pytest.raises(ValueError, match="a torch.bfloat16 weight takes no scale: scale and block must be None"):
        weight_gemv(_x(2).bfloat16(), w, torch.ones(N))
    with pytest.raises(ValueError, match="scale and block must be None, not None and"):
        weight_gemv(_x(2).bfloat16(), w, None, (32, 64))
    with pytest.raises(ValueError, match="bias must be"):
        weight_gemv(_x(2).bfloat16(), w, bias=torch.zeros(N - 1))
    with pytest.raises(ValueError, match=rf"0\.\.{SMALL_M_MAX} rows"):
        weight_gemv(_x(SMALL_M_MAX + 1).bfloat16(), w)
    assert weight_gemv(_x(0).bfloat16(), w).shape == (0, N)


def test_streamed_linear_runs_the_chosen_dense_kernel(monkeypatch):
    """StreamedLinear (small_m_gemm "on") on the kernel the table's small_m_dense rows name, here on
    CPU under the interpreter (the device gate patched): the default table's GEMV_CORES at one
    row and GEMV at 3 and 16, the bias fused; STREAM where a table names it; F.linear above
    SMALL_M_MAX, for x in another dtype and for an empty small_m_dense; row-parallel: the kernel
    without the bias, added once after."""
    from meshserve.parallel.groups import ParallelContext
    from meshserve.workers.quant import gemm_table, layers, small_m
    from meshserve.workers.quant.gemm_table import GemmTable, GemmWay

    ran = []
    real_gemv, real_stream = gemv_mod.weight_gemv, small_m.stream_linear

    def spy_gemv(x, w, scale=None, block=None, bias=None, **kw):
        ran.append(("gemv", kw["config"], bias is not None))
        return real_gemv(x, w, scale, block, bias, **kw)

    def spy_stream(x, w, scale=None, block=None, bias=None, **kw):
        ran.append(("stream", None, bias is not None))
        return real_stream(x, w, scale, block, bias, **kw)

    monkeypatch.setattr(gemv_mod, "weight_gemv", spy_gemv)
    monkeypatch.setattr(small_m, "stream_linear", spy_stream)
    monkeypatch.setattr(layers, "_runs_decode_kernels", lambda x: True)
    dt = torch.float16
    w = torch.nn.Parameter(_dense(dt), requires_grad=False)
    b = torch.nn.Parameter((torch.randn(N, generator=torch.Generator().manual_seed(4)) * 0.5).to(dt),
                           requires_grad=False)
    layer = layers.StreamedLinear(w, b, None)
    for lead, want in [((1, 1), ("gemv", gemv_mod.DENSE_CORES_CONFIG, True)), ((3,), ("gemv", None, True)),
                       ((2, 8), ("gemv", None, True))]:
        x = _x(math.prod(lead)).to(dt).view(*lead, K)
        ran.clear()
        y = layer(x)
        assert ran == [want], (lead, ran)
        assert layers.dense_way(x, w) is gemm_table.choose_dense(gemm_table.DEFAULT_TABLE, rows=math.prod(lead))
        assert y.shape == (*lead, N)
        _assert_within_rounding(y.view(-1, N), x.view(-1, K), w, b)
        torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), rtol=2**-9, atol=2e-3)
    x = _x(SMALL_M_MAX + 1).to(dt)
    ran.clear()
    assert layers.dense_way(x, w) is GemmWay.DENSE_CUBLAS
    assert torch.equal(layer(x), torch.nn.functional.linear(x, w, b)) and ran == []
    assert layers.dense_way(_x(3), w) is GemmWay.DENSE_CUBLAS  # x's dtype is not the weight's
    assert layers.dense_way(_x(3).bfloat16(), w.bfloat16(), GemmTable(small_m_dense=())) is GemmWay.DENSE_CUBLAS
    big = torch.empty((1 << 20, 2048), dtype=torch.bfloat16, device="meta")  # past 32-bit offsets: cuBLAS
    assert layers.dense_way(torch.empty((1, 2048), dtype=torch.bfloat16, device="meta"), big) is GemmWay.DENSE_CUBLAS
    assert layers.dense_way(torch.empty((1, 2048), dtype=torch.bfloat16, device="meta"), big[:-1]) is GemmWay.GEMV_CORES
    streamed = layers.StreamedLinear(w, b, None, table=GemmTable(small_m_dense=((16, GemmWay.STREAM),)))
    ran.clear()
    _assert_within_rounding(streamed(_x(4).to(dt)), _x(4).to(dt), w, b)
    assert ran == [("stream", None, True)]
    row_parallel = layers.StreamedLinear(w, b, ParallelContext())
    ran.clear()
    y = row_parallel(_x(3).to(dt))
    assert ran == [("gemv", None, False)]  # the bias joins after the (here one-rank) all-reduce
    torch.testing.assert_close(y, torch.nn.functional.linear(_x(3).to(dt), w, b), rtol=2**-9, atol=2e-3)
