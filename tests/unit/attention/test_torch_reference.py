"""The TORCH reference backend against the float64 oracle, over every named scenario."""

import pytest
import torch

from meshserve.attention.backends.torch_ref import TorchBackend
from tests.unit.attention.scenarios import SCENARIOS, assert_matches, make_case, oracle, run_backend


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_scenario(scenario, dtype):
    reasons = TorchBackend.validate_configuration(scenario.problem(str(dtype).removeprefix("torch.")))
    assert reasons == [], reasons
    case = make_case(scenario, dtype=dtype)
    ref_out, ref_lse = oracle(case)
    out, lse = run_backend(TorchBackend, case, dtype=str(dtype).removeprefix("torch."))
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_matches(out, lse, ref_out, ref_lse, dtype)
