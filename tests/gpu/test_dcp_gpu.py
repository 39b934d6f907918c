"""TRITON and FLASHINFER over DCP-sharded caches on one GPU (one process); skipped without CUDA.

Each scenario's cache is split as DCP ranks hold it (global position p on rank p % dcp, local
slot p // dcp, shuffled blocks with noise around them); every rank's (out, lse) over its shard,
merged by LSE, must equal the unsharded result (bf16 tolerance). The unsharded result is
TRITON's for both backends, itself checked against the float64 oracle in test_backends_gpu.py
(the oracle's per-query Python loop over these long scenarios would take minutes per case here).
Which backend runs which scenario is its own validate_configuration's answer for the DCP problem.

The two halves run as separate device calls: `-k TRITON` and `-k FLASHINFER`.

FlashInfer JIT-compiles (nvcc, ~40 s each on a cold machine; the cache does not outlive a lease)
one module per distinct (kernel family, q/kv dtype, head dim, sliding window on/off, soft-cap
on/off, ...). This file builds as few as the scenarios need:
- every FLASHINFER run is sharded (dcp 2 and 4): prefill rows, and windowed decode rows, run on
  the prefill wrapper with a custom mask by global position and window_left -1 (FA2: FlashInfer
  takes FA2 for a custom mask), so no window variant is built;
- decode rows run with `decode_tensor_cores=True` (FlashInfer's tensor-core decode is the same
  FA2 paged-prefill module), so no separate decode module is built; the other decode kernel is
  covered unsharded in test_backends_gpu.py, and the DCP logic (local page lists, empty rows) is
  the same host code for both;
- the unsharded reference is TRITON's (an unsharded FLASHINFER run would build FA3 modules for
  its causal rows on Hopper, and its own decode and window variants).
Distinct FlashInfer modules: 7 (counted from FlashInfer 0.5.3's module keys, not yet seen on a
device; bench/h200_handover.sh dcp-flashinfer prints how many were built): FA2 paged prefill
(q bf16) for (kv bf16, head 128), (kv bf16, head 128, soft-cap), (kv fp8_e4m3, head 128),
(kv fp8_e5m2, head 128), (kv bf16, head 64), (kv bf16, head 256), plus FlashInfer's
segment_packbits module (it packs the custom mask).
The head-64/256, FP8 and soft-cap scenarios exist for their variant; every other scenario shares
the first one. Estimated cold `-k FLASHINFER`: 7 x ~40 s of builds plus ~36 runs.
"""

from functools import cache

import pytest
import torch

from meshserve.attention.registry import load_backend
from tests.gpu.test_backends_gpu import GPU_SCENARIOS
from tests.unit.attention.scenarios import assert_matches, make_case
from tests.unit.attention.test_dcp_reference import merge_shards, shard_run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DTYPE = "bfloat16"  # fp16: the unsharded runs in test_backends_gpu.py
BY_NAME = {s.name: s for s in GPU_SCENARIOS}
# What each backend is built with here (see the docstring: one FlashInfer module per variant).
BACKEND_KWARGS = {"TRITON": {}, "FLASHINFER": {"decode_tensor_cores": True}}


@cache
def _case(name: str):
    """One case per scenario, shared by both backends and dcp sizes (built on the CPU; shard_run
    moves the shards)."""
    return make_case(BY_NAME[name], dtype=torch.bfloat16)


@cache
def _unsharded(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """TRITON over the whole cache (dcp 1): the reference of both halves, computed once per scenario."""
    triton = load_backend("TRITON")
    reasons = triton.validate_configuration(_problem(BY_NAME[name], 1))
    assert not reasons, f"TRITON cannot give the unsharded reference: {reasons}"
    gen = torch.Generator().manual_seed(0)
    return merge_shards([shard_run(_case(name), 1, 0, gen, triton, dtype=DTYPE, device="cuda")])


def _problem(scenario, dcp: int):
    return scenario.problem(DTYPE, device="cuda", needs_lse=True,
                            compute_capability=torch.cuda.get_device_capability(), dcp_size=dcp)


def _params():
    # backend first, so that a FlashInfer module built by one scenario serves the next ones at once
    return [pytest.param(name, dcp, s.name, id=f"{name}-dcp{dcp}-{s.name}")
            for name in ("TRITON", "FLASHINFER") for s in GPU_SCENARIOS for dcp in (2, 4)]


@pytest.mark.parametrize(("name", "dcp", "scenario"), _params())
def test_dcp_shards_merge_to_the_unsharded_result(name, dcp, scenario):
    try:
        backend_cls = load_backend(name)
    except ImportError as exc:
        pytest.skip(f"{name} cannot be imported: {exc}")
    reasons = backend_cls.validate_configuration(_problem(BY_NAME[scenario], dcp))
    if reasons:
        pytest.skip("; ".join(reasons))
    ref_out, ref_lse = _unsharded(scenario)
    gen = torch.Generator().manual_seed(dcp)
    merged, lse = merge_shards([shard_run(_case(scenario), dcp, r, gen, backend_cls, dtype=DTYPE, device="cuda",
                                          backend_kwargs=BACKEND_KWARGS[name]) for r in range(dcp)])
    assert_matches(merged, lse, ref_out, ref_lse, torch.bfloat16)
