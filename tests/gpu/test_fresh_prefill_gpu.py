"""Prefill of fresh sequences (no cached context) from the step's own K/V instead of the pages,
against the TORCH reference in bf16 on the GPU; skipped without CUDA (and FlashInfer for its
cases):
- FLASHINFER with ragged_prefill=True: FlashInfer's ragged wrapper for steps whose prefills all
  start at position 0 (the paged wrapper otherwise);
- TRITON with PrefillConfig.fresh_kv (row descriptors, one load per 64-key tile at any page size);
- TRITON with PrefillConfig.gluon: the Gluon kernel for Hopper (kernels/prefill_gluon.py: a TMA
  loader warp, two consumer warpgroups), which only the GPU can run; where it does not apply (the
  window and soft-cap scenario, a GPU other than sm_90) the portable kernel runs its tiles.

After write_kv, every cache slot of a sequence that read the step's K/V is set to NaN (and every
slot no sequence owns), so a kernel that still read the pages there fails. The mixed case (a
chunk over cached context, a fresh prompt, decodes) must keep FlashInfer on its paged wrapper
and still be right. bench/flashinfer_aot.sh runs the FLASHINFER cases to build (and prove
prebuilt) the modules they use: the ragged and the paged runs share one FlashInfer module.

    pytest tests/gpu/test_fresh_prefill_gpu.py
"""

import dataclasses

import pytest
import torch

from meshserve.attention.backends.torch_ref import TorchBackend
from meshserve.attention.backends.triton_paged import TritonBackend
from meshserve.attention.kernels.config import PrefillConfig
from meshserve.attention.registry import load_backend
from tests.gpu.test_backends_gpu import _fresh, _to_cuda
from tests.unit.attention.scenarios import (
    Scenario,
    assert_matches,
    forward_with_fresh_slots_poisoned,
    make_case,
    poison_unowned_slots,
    run_backend,
    strided_view,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

LLAMA3_8B = dict(num_heads=32, num_kv_heads=8, head_size=128)
FRESH = tuple(
    Scenario(f"fresh_prompts_page{page}", (700, 64, 300, 1, 1), (0, 0, 0, 900, 4000), spec=LLAMA3_8B,
             block_size=page, max_model_len=8192)
    for page in (16, 64)
) + (
    Scenario("fresh_window_softcap", (500, 130, 1), (0, 0, 700), spec=dict(num_heads=8, num_kv_heads=2,
             head_size=128, sliding_window=256, logits_soft_cap=30.0), query_gain=4.0, max_model_len=4096),
)  # fmt: skip
# Shapes for TRITON's kernels only (FlashInfer's would be modules of their own to build and carry):
# head 64, and MHA (one query head per KV head).
TRITON_ONLY = (
    Scenario("fresh_prompts_head64", (700, 129, 128, 1, 1), (0, 0, 0, 300, 2000),
             spec=dict(num_heads=16, num_kv_heads=4, head_size=64), max_model_len=4096),
    Scenario("fresh_prompts_mha", (257, 40), (0, 0), spec=dict(num_heads=8, num_kv_heads=8, head_size=128),
             max_model_len=4096),
)  # fmt: skip
KINDS = ("flashinfer_ragged", "triton_fresh_desc", "triton_fresh_gluon", "triton_fresh_gluon_serial")
CASES = [pytest.param(k, s, id=f"{k}-{s.name}") for s in FRESH for k in KINDS] + [
    pytest.param(k, s, id=f"{k}-{s.name}") for s in TRITON_ONLY for k in KINDS if k.startswith("triton")]
# A chunk after 700 cached tokens, a fresh prompt, decodes.
MIXED = Scenario("mixed_cached_fresh_decode", (300, 64, 1, 1), (700, 0, 900, 63), spec=LLAMA3_8B,
                 max_model_len=8192)  # fmt: skip
TRITON_FRESH = PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=3, kv_desc=True, fresh_kv=True)
TRITON_GLUON = PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=2, kv_desc=True, fresh_kv=True,
                             gluon=True)  # fmt: skip
TRITON_GLUON_SERIAL = dataclasses.replace(TRITON_GLUON, gluon_overlap=False)


def _backend(kind: str, problem):
    if kind == "triton_fresh_desc":
        return TritonBackend(problem, prefill_config=TRITON_FRESH)
    if kind.startswith("triton_fresh_gluon"):
        return TritonBackend(problem, prefill_config=TRITON_GLUON_SERIAL if kind.endswith("serial") else TRITON_GLUON)
    try:
        cls = load_backend("FLASHINFER")
    except ImportError as exc:
        pytest.skip(f"FLASHINFER cannot be imported: {exc}")
    reasons = cls.validate_configuration(problem)
    if reasons:
        pytest.skip("; ".join(reasons))
    return cls(problem, ragged_prefill=True)


def _fresh_seqs(scenario) -> list[int]:
    return [s for s, (q, c) in enumerate(zip(scenario.query_lens, scenario.context_lens)) if c == 0 and q > 1]


def _case(scenario):
    problem = scenario.problem("bfloat16", device="cuda", needs_lse=True,
                               compute_capability=torch.cuda.get_device_capability())  # fmt: skip
    case = _to_cuda(make_case(scenario, dtype=torch.bfloat16, seed=12))
    poison_unowned_slots(case)
    ref_out, ref_lse = run_backend(TorchBackend, _fresh(case), dtype="bfloat16", device="cuda")
    return problem, case, (ref_out.double().cpu(), ref_lse.double().cpu())


@pytest.mark.parametrize("kind,scenario", CASES)
def test_fresh_prefill_reads_the_steps_kv_and_matches_the_reference(kind, scenario):
    problem, case, ref = _case(scenario)
    backend = _backend(kind, problem)
    out, lse, plan = forward_with_fresh_slots_poisoned(backend, _fresh(case), _fresh_seqs(scenario))
    assert_matches(out, lse, *ref, torch.bfloat16)
    if kind == "flashinfer_ragged":
        assert plan.ragged and plan.prefill._backend == backend.prefill_kernel
    elif kind.startswith("triton_fresh_gluon"):  # the Gluon kernel ran where it applies, and only there
        reasons = backend.gluon_prefill_reasons(case.query, case.key, strided_view(case.value))
        plain = problem.spec.sliding_window is None and problem.spec.logits_soft_cap is None
        if torch.cuda.get_device_capability()[0] == 9 and plain:
            assert reasons == [], reasons
        else:
            assert reasons
    else:
        assert set(plan.fresh_tile_seq.tolist()) == set(_fresh_seqs(scenario)) and plan.tile_seq.numel() == 0
        reasons = backend.fresh_descriptor_reasons(TRITON_FRESH, case.key, strided_view(case.value))
        if torch.cuda.get_device_capability() >= (9, 0):  # else the pointer path ran, and the reason says why
            assert reasons == [], reasons
        else:
            assert any("compute capability" in r for r in reasons), reasons


@pytest.mark.parametrize("kind", ["flashinfer_ragged", "triton_fresh_desc", "triton_fresh_gluon"])
def test_mixed_step_with_cached_context_stays_right(kind):
    """FLASHINFER keeps its paged wrapper for the whole step; TRITON splits it: the fresh prompt
    reads the step's K/V (its slots are NaN), the chunk and the decodes the pages."""
    problem, case, ref = _case(MIXED)
    backend = _backend(kind, problem)
    fresh = [] if kind == "flashinfer_ragged" else [1]
    out, lse, plan = forward_with_fresh_slots_poisoned(backend, _fresh(case), fresh)
    assert_matches(out, lse, *ref, torch.bfloat16)
    if kind == "flashinfer_ragged":
        assert not plan.ragged and backend.ragged_prefill_reasons(case.metadata)
    else:
        assert plan.fresh_tile_seq.tolist() and set(plan.fresh_tile_seq.tolist()) == {1}
        assert set(plan.tile_seq.tolist()) == {0}

