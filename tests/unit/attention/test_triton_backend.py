"""TRITON against the float64 oracle over every named scenario (CPU: the Triton interpreter)."""

import pytest
import torch

from meshserve.attention.backends.triton_paged import TritonBackend
from tests.unit.attention.scenarios import SCENARIOS, assert_matches, make_case, oracle, run_backend


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_scenario(scenario, dtype):
    name = str(dtype).removeprefix("torch.")
    reasons = TritonBackend.validate_configuration(scenario.problem(name))
    assert reasons == [], reasons
    case = make_case(scenario, dtype=dtype)
    ref_out, ref_lse = oracle(case)
    out, lse = run_backend(TritonBackend, case, dtype=name)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_matches(out, lse, ref_out, ref_lse, dtype)
