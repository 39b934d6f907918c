"""TRITON and FLASHINFER over DCP-sharded caches on one GPU (one process); skipped without CUDA.

Each scenario's cache is split as DCP ranks hold it (global position p on rank p % dcp, local
slot p // dcp, shuffled blocks with noise around them); every rank's (out, lse) over its shard,
merged by LSE, must equal the same backend's unsharded result (bf16 / fp16 tolerance). The
unsharded result is itself checked against the float64 oracle in test_backends_gpu.py; the
oracle's per-query Python loop over these long scenarios would take minutes per case here.
Which backend runs which scenario is its own validate_configuration's answer for the DCP problem.
"""

from functools import cache

import pytest
import torch

from meshserve.attention.registry import load_backend
from tests.gpu.test_backends_gpu import GPU_SCENARIOS
from tests.unit.attention.scenarios import assert_matches, make_case
from tests.unit.attention.test_dcp_reference import merge_shards, shard_run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@cache
def _case(name: str, dtype: str):
    """One case per (scenario, dtype), shared by both backends and dcp sizes (built on the CPU;
    shard_run moves the shards)."""
    return make_case(next(s for s in GPU_SCENARIOS if s.name == name), dtype=DTYPES[dtype])


@pytest.mark.parametrize("name", ["TRITON", "FLASHINFER"])
@pytest.mark.parametrize("dcp", [2, 4])
@pytest.mark.parametrize("dtype", ["bfloat16"])  # fp16: the unsharded runs in test_backends_gpu.py
@pytest.mark.parametrize("scenario", GPU_SCENARIOS, ids=lambda s: s.name)
def test_dcp_shards_merge_to_the_unsharded_result(name, dtype, dcp, scenario):
    backend_cls = load_backend(name)
    problem = scenario.problem(dtype, device="cuda", needs_lse=True,
                               compute_capability=torch.cuda.get_device_capability(), dcp_size=dcp)
    reasons = backend_cls.validate_configuration(problem)
    if reasons:
        pytest.skip("; ".join(reasons))
    case = _case(scenario.name, dtype)
    gen = torch.Generator().manual_seed(dcp)
    ref_out, ref_lse = merge_shards([shard_run(case, 1, 0, gen, backend_cls, dtype=dtype, device="cuda")])
    merged, lse = merge_shards([shard_run(case, dcp, r, gen, backend_cls, dtype=dtype, device="cuda")
                                for r in range(dcp)])
    assert_matches(merged, lse, ref_out, ref_lse, DTYPES[dtype])
