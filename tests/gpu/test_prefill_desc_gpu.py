"""TRITON prefill variants (K/V pages through TMA descriptors, register caps) against the
TORCH reference on the GPU, in bf16 and fp16; skipped without CUDA.

    pytest tests/gpu/test_prefill_desc_gpu.py

The CPU interpreter runs the same kernel code in fp32/fp16 (tests/unit/attention/
test_triton_prefill_desc.py); here the compiled sm_90 code runs: TMA loads, wgmma, spills.
Every cache slot outside the sequences is NaN, so a tile that reads past a sequence's end and
keeps those rows fails. bench/prefill_sweep.py checks the benchmark shapes the same way.
"""

import dataclasses
import functools

import pytest
import torch

from meshserve.attention.backends.torch_ref import TorchBackend
from meshserve.attention.backends.triton_paged import TritonBackend
from meshserve.attention.kernels.config import PrefillConfig
from tests.gpu.test_backends_gpu import GPU_SCENARIOS, _fresh, _to_cuda
from tests.unit.attention.scenarios import Scenario, assert_matches, make_case, poison_unowned_slots, run_backend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _cfg(m, n, w, s, **kw) -> PrefillConfig:
    return PrefillConfig(block_m=m, block_n=n, num_warps=w, num_stages=s, **kw)


# Kinds of variant bench/prefill_sweep.py times (head <= 128; head 256 uses HEAD_256). The first
# (descriptors, the Hopper default at pages of 64) runs every scenario, the others SUBSET.
VARIANTS = {
    "desc_128x64_w4": _cfg(128, 64, 4, 3, kv_desc=True),
    "desc_64x32_w4_r168": _cfg(64, 32, 4, 3, kv_desc=True, max_registers=168),
    "gather_128x64_w8": _cfg(128, 64, 8, 3),
    # fresh sequences (no cached context) from the step's K/V rows (kernels/kv_rows.py)
    "fresh_desc_128x64_w4": _cfg(128, 64, 4, 3, kv_desc=True, fresh_kv=True),
    "fresh_desc_128x64_w4_s2": _cfg(128, 64, 4, 2, kv_desc=True, fresh_kv=True),
}
HEAD_256 = _cfg(64, 32, 4, 2, kv_desc=True)
WITH_PREFILL = tuple(s for s in GPU_SCENARIOS if any(q > 1 for q in s.query_lens)) + (
    # The benchmark's heads at pages of 16 and 64 (one descriptor load per tile at 64).
    Scenario("bench_heads_p16", (2048, 700, 1), (0, 900, 3000), spec=dict(num_heads=32, num_kv_heads=8,
             head_size=128), max_model_len=4096),  # fmt: skip
    Scenario("bench_heads_p64", (2048, 700, 1), (0, 900, 3000), spec=dict(num_heads=32, num_kv_heads=8,
             head_size=128), block_size=64, max_model_len=4096),  # fmt: skip
)
# Every variant runs these; the first variant runs every scenario above.
SUBSET = ("bench_heads_p16", "bench_heads_p64", "gpu_mixed_long", "gpu_window_sinks", "gpu_long_prefill")


def _run(scenario, cfg, dtype):
    name = str(dtype).removeprefix("torch.")
    cc = torch.cuda.get_device_capability()
    problem = scenario.problem(name, device="cuda", compute_capability=cc)
    reasons = TritonBackend.validate_configuration(problem)
    if reasons:
        pytest.skip("; ".join(reasons))
    case = _to_cuda(make_case(scenario, dtype=dtype, seed=11))
    poison_unowned_slots(case)
    ref_out, ref_lse = run_backend(TorchBackend, _fresh(case), dtype=name, device="cuda")
    out, lse = run_backend(functools.partial(TritonBackend, prefill_config=cfg), _fresh(case), dtype=name,
                           device="cuda")  # fmt: skip
    assert_matches(out, lse, ref_out.double().cpu(), ref_lse.double().cpu(), dtype)
    if case.kv_cache is None:
        return None
    return TritonBackend(problem, prefill_config=cfg).prefill_descriptor_reasons(cfg, case.kv_cache)


def _check_path(scenario, cfg, reasons):
    """Caches with a power-of-two head take the descriptor path on sm_90+; others fall back."""
    head = scenario.attention_spec().head_size
    if reasons is None:  # no KV cache (encoder-only): nothing to read through descriptors
        return
    if head >= 16 and head & (head - 1) == 0:
        assert reasons == [], reasons
    else:
        assert any(f"head_size={head}" in r for r in reasons), reasons


@pytest.mark.parametrize("scenario", WITH_PREFILL, ids=lambda s: s.name)
def test_descriptor_prefill_matches_torch_in_bf16(scenario):
    cfg = HEAD_256 if scenario.attention_spec().head_size > 128 else VARIANTS["desc_128x64_w4"]
    _check_path(scenario, cfg, _run(scenario, cfg, torch.bfloat16))


@pytest.mark.parametrize("scenario", [s for s in WITH_PREFILL if s.name in SUBSET], ids=lambda s: s.name)
@pytest.mark.parametrize("variant", list(VARIANTS)[1:])
def test_other_prefill_variants_match_torch_in_bf16(variant, scenario):
    cfg = VARIANTS[variant]
    reasons = _run(scenario, cfg, torch.bfloat16)
    if cfg.kv_desc:
        _check_path(scenario, cfg, reasons)


@pytest.mark.parametrize("scenario", [s for s in WITH_PREFILL if s.name.startswith("bench")], ids=lambda s: s.name)
def test_prefill_descriptors_in_fp16(scenario):
    assert _run(scenario, VARIANTS["desc_128x64_w4"], torch.float16) == []


def test_head_80_falls_back_to_gathers_and_stays_right():
    scenario = next(s for s in GPU_SCENARIOS if s.name == "gpu_head_80_block_128")
    scenario = dataclasses.replace(scenario, query_lens=(300, 1))
    _check_path(scenario, VARIANTS["desc_128x64_w4"], _run(scenario, VARIANTS["desc_128x64_w4"], torch.bfloat16))
